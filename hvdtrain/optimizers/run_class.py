"""The one way hvdtrain gives a user's Keras optimizer another class, and gives it back.

As in Horovod, the class is a subclass of the optimizer's own made on the fly (one per mixin,
class and setting), under the same name, so ``isinstance``, ``get_config`` and saved models stay
the optimizer's own; the optimizer becomes it by changing its class only (same object, same
variables, same attributes). The mixin (a ``RunOptimizer``) overrides ``apply``, through which
Keras 3 routes ``apply_gradients`` and ``fit``. ``class_for_the_run`` does it while a block runs
and gives the optimizer its own class back afterwards, also after an error: stage 0's reduction
of a model's own ``train_step`` (``reduction``) and ZeRO (``zero``); the Horovod drop-in's
``DistributedOptimizer`` keeps the class (``become``). Every private Keras access it needs is in
``hvdtrain.keras_internals``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Sequence

import keras

from hvdtrain.keras_internals import optimizer_variables_built_for, set_class

# The attribute holding what a run attaches to an optimizer (ZeRO's sharding), set past Keras'
# attribute tracking (which wraps lists and dicts and would save them with the optimizer).
_ATTACHED = "_hvdtrain_run"


class RunOptimizer:
    """Mixed in before the user's optimizer class: ``apply`` with Keras' own checks and lazy
    build, then ``apply_for_the_run``; what ``applied_by_keras`` says stays the user's class's
    own update (``keras_apply``). ``hvdtrain_settings``: the class's setting (``run_class``)."""

    hvdtrain_settings: Any = None

    def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None
              ) -> Any:
        if trainable_variables is None and not self.built:
            return super().apply(grads, trainable_variables)   # Keras says what is missing
        variables = (optimizer_variables_built_for(self) if trainable_variables is None
                     else list(trainable_variables))
        grads = list(grads)
        if self.applied_by_keras(grads, variables):
            return self.keras_apply(grads, variables)
        if not self.built:      # Keras builds lazily; variables may not be created in a tf.cond
            self.build(variables)
        return self.apply_for_the_run(grads, variables)

    def keras_apply(self, grads: list[Any], variables: list[Any]) -> Any:
        """The update of the user's class (``super().apply`` of the mixin's own methods would
        reach ``RunOptimizer.apply`` again)."""
        return super().apply(grads, variables)

    def applied_by_keras(self, grads: list[Any], variables: list[Any]) -> bool:
        """Whether this call is Keras' own update (no gradients: Keras does nothing)."""
        return not grads

    def apply_for_the_run(self, grads: list[Any], variables: list[Any]) -> Any:
        raise NotImplementedError


@functools.cache
def run_class(mixin: type, optimizer_class: type, settings: Any = None) -> type:
    """The subclass of ``optimizer_class`` with ``mixin`` (a ``RunOptimizer``) before it and
    ``settings`` (hashable) as its ``hvdtrain_settings``: one class per mixin, class and setting, so
    the same setting gives the same class."""
    return type(optimizer_class.__name__, (mixin, optimizer_class), {
        "__module__": optimizer_class.__module__,
        "__qualname__": optimizer_class.__qualname__,
        "hvdtrain_settings": settings,
    })


def own_class(optimizer: keras.optimizers.Optimizer) -> type:
    """The optimizer's class before hvdtrain gave it one (its class if none)."""
    cls = type(optimizer)
    return cls.__bases__[1] if issubclass(cls, RunOptimizer) else cls


def become(optimizer: keras.optimizers.Optimizer, class_of: Callable[[type], type]) -> None:
    """Give ``optimizer`` for good the class ``class_of`` makes of its own class (one given
    before is replaced, not stacked)."""
    set_class(optimizer, class_of(own_class(optimizer)))


def attached(optimizer: keras.optimizers.Optimizer) -> Any:
    """What ``class_for_the_run`` attached to ``optimizer`` (None: nothing)."""
    return vars(optimizer).get(_ATTACHED)


def give_back(optimizer: keras.optimizers.Optimizer, cls: type | None = None) -> None:
    """``optimizer`` in ``cls`` (default: its own class) again, without what was attached."""
    set_class(optimizer, own_class(optimizer) if cls is None else cls)
    if _ATTACHED in vars(optimizer):
        object.__delattr__(optimizer, _ATTACHED)


class Kept:
    """What ``class_for_the_run`` yields: ``keep()`` leaves the optimizers in their run class,
    with what was attached, past the block (``give_back`` ends it)."""

    def __init__(self) -> None:
        self.kept = False

    def keep(self) -> None:
        self.kept = True


@contextlib.contextmanager
def class_for_the_run(optimizers: Sequence[keras.optimizers.Optimizer],
                      class_of: Callable[[type], type], attach: Any = None) -> Iterator[Kept]:
    """Each optimizer in the class ``class_of`` makes of its class while the block runs, with
    ``attach`` (if any) attached (``attached``); its class back afterwards, also after an
    error, unless the block called ``keep()``."""
    originals = [type(optimizer) for optimizer in optimizers]
    for optimizer, cls in zip(optimizers, originals):
        set_class(optimizer, class_of(cls))
        if attach is not None:
            object.__setattr__(optimizer, _ATTACHED, attach)
    kept = Kept()
    try:
        yield kept
    finally:
        if not kept.kept:
            for optimizer, cls in zip(optimizers, originals):
                give_back(optimizer, cls)
