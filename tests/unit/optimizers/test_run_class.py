"""The one way an optimizer gets a class for the run: the same class for the same setting, its
own class back after the block (also after an error) unless kept, a new class replacing the
one given before rather than stacking on it."""

from __future__ import annotations

import keras
import pytest

from hvdtrain.collectives import GradientReduction, LocalCollectives
from hvdtrain.optimizers.reduction import distributed_for_the_run, reducing_class
from hvdtrain.optimizers.run_class import attached, become, class_for_the_run, give_back, own_class


def REDUCE(gradients, reduction, variables):
    return LocalCollectives().reduce_gradients(gradients, reduction)


def _reducing(cls: type, passes: int = 1) -> type:
    return reducing_class(cls, GradientReduction("average"), passes, False, REDUCE)


def test_the_same_setting_gives_the_same_class_named_as_the_users():
    cls = _reducing(keras.optimizers.SGD)
    assert cls is _reducing(keras.optimizers.SGD) and cls is not _reducing(keras.optimizers.SGD, 2)
    assert cls.__name__ == "SGD" and issubclass(cls, keras.optimizers.SGD)


def test_the_class_comes_back_after_the_block_also_after_an_error():
    optimizer = keras.optimizers.SGD()
    with pytest.raises(RuntimeError, match="in the run"):
        with distributed_for_the_run([optimizer], GradientReduction("average"), REDUCE):
            assert type(optimizer) is _reducing(keras.optimizers.SGD)
            raise RuntimeError("in the run")
    assert type(optimizer) is keras.optimizers.SGD


def test_a_kept_class_stays_with_what_was_attached_until_given_back():
    optimizer, sharding = keras.optimizers.Adam(), object()
    with class_for_the_run([optimizer], _reducing, sharding) as run:
        assert attached(optimizer) is sharding
        run.keep()
    assert own_class(optimizer) is keras.optimizers.Adam and attached(optimizer) is sharding
    give_back(optimizer)
    assert type(optimizer) is keras.optimizers.Adam and attached(optimizer) is None


def test_a_new_class_replaces_the_one_given_before():
    optimizer = keras.optimizers.SGD()
    become(optimizer, _reducing)
    become(optimizer, lambda cls: _reducing(cls, 2))
    assert type(optimizer) is _reducing(keras.optimizers.SGD, 2)
    assert own_class(optimizer) is keras.optimizers.SGD
