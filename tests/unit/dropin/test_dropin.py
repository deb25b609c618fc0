"""The Horovod drop-in (``hvdtrain.keras``, ``hvdtrain.tensorflow``) in one process: how
Horovod's arguments map to the trainer's gradient reduction, what imports (and what is refused)
without Horovod, a world of one, ``DistributedOptimizer`` on the user's optimizer, Keras 2
checkpoint names. On 2 real ranks: tests/distributed/horovod/test_horovod_dropin.py."""

from __future__ import annotations

import subprocess

import pytest

from conftest import BIN, REPO, RUN_TIMEOUT, rank_env
from hvdtrain.collectives import GradientReduction, LocalCollectives

REFUSAL = "needs the Horovod backend, and this job runs on TensorFlow's collectives"


def test_horovod_arguments_map_to_the_trainers_gradient_reduction():
    import hvdtrain.tensorflow as hvd

    assert hvd.gradient_reduction() == GradientReduction("average")
    assert hvd.gradient_reduction(hvd.Sum, hvd.Compression.fp16, True) == GradientReduction(
        "sum", "fp16", sparse_as_dense=True)
    assert hvd.gradient_reduction(gradient_predivide_factor=4.0) == GradientReduction(
        "average", prescale=0.25, postscale=4.0)
    with pytest.raises(ValueError, match="op != Average"):
        hvd.gradient_reduction(hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="op must be"):
        hvd.gradient_reduction(hvd.Max)
    with pytest.raises(ValueError, match="sum, average or adasum"):
        GradientReduction("max")


def test_our_ops_and_compressors_are_horovods_values_and_both_translate():
    """Without Horovod the drop-in's ops are ``hvdtrain.dropin.ops``': Horovod's ints as an
    IntEnum, so scripts that compare them with Horovod's (or mix the two) see equal values;
    either kind of op and compressor maps to the same reduction."""
    horovod = pytest.importorskip("horovod.tensorflow")
    from hvdtrain.dropin import core as dropin, ops as dropin_ops

    for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        ours, theirs = getattr(dropin_ops, name), getattr(horovod, name)
        assert ours == theirs and hash(ours) == hash(theirs)
        assert dropin_ops.op_name(ours) == dropin_ops.op_name(theirs) == name.lower()
    for name in ("none", "fp16"):
        assert dropin_ops.compression_name(getattr(dropin_ops.Compression, name)) == name
        assert dropin_ops.compression_name(getattr(horovod.Compression, name)) == name
        assert dropin.gradient_reduction(dropin_ops.Sum, getattr(dropin_ops.Compression, name)) \
            == dropin.gradient_reduction(horovod.Sum, getattr(horovod.Compression, name))
    with pytest.raises(ValueError, match="compression must be"):
        dropin_ops.compression_name(object)
    with pytest.raises(ValueError, match="unknown reduction op"):
        dropin_ops.op_name(7)


NO_HOROVOD_IMPORT_CHECK = """
import sys
import keras
import hvdtrain.keras as hvd
import hvdtrain.tensorflow as hvd_tf
from hvdtrain.dropin import core as dropin

assert dropin.BACKEND == "tensorflow", dropin.BACKEND
print("why:", dropin.BACKEND_WHY)
assert not [name for name in sys.modules if name.split(".")[0] == "horovod"]
assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd_tf.Min, hvd_tf.Max, hvd_tf.Product) == tuple(range(6))
assert hvd_tf.gradient_reduction(hvd.Sum, hvd.Compression.fp16).compression == "fp16"
for refused in (lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(), op=hvd.Adasum),
                lambda: hvd.elastic.run(print), lambda: hvd.elastic.KerasState(None),
                hvd_tf.join, lambda: hvd.start_timeline("t.json"),
                lambda: hvd.init(process_sets=[[0]]),
                lambda: hvd_tf.elastic.TensorFlowState([]),
                lambda: hvd_tf.elastic.ObjectState(hvd_tf.broadcast_object, hvd_tf.rank)):
    try:
        refused()
    except Exception as error:
        print("refused:", type(error).__name__, error)
    else:
        raise AssertionError(f"not refused: {refused}")
"""


@pytest.mark.slow   # a fresh process each: what importing the drop-in loads is the point
@pytest.mark.parametrize("hidden", [False, True], ids=["HVDTRAIN_BACKEND=tensorflow",
                                                       "horovod-not-importable"])
def test_the_dropin_imports_without_horovod_on_the_tensorflow_backend(hidden, no_horovod):
    """Asked for TensorFlow's collectives, or where ``import horovod`` fails, both APIs import
    without loading any Horovod module, offer Horovod's constants and refuse in one line what
    needs Horovod (nothing here starts a rank)."""
    env = {"PYTHONPATH": no_horovod} if hidden else {"HVDTRAIN_BACKEND": "tensorflow"}
    result = subprocess.run([str(BIN / "python"), "-c", NO_HOROVOD_IMPORT_CHECK], cwd=REPO,
                            env=rank_env(**env), text=True, capture_output=True,
                            timeout=RUN_TIMEOUT, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    why = ("auto: Horovod is not usable here (ImportError: No module named 'horovod'" if hidden
           else "as asked")
    assert f"why: {why}" in result.stdout
    refusals = [line for line in result.stdout.splitlines() if line.startswith("refused:")]
    assert len(refusals) == 8
    assert all(line.startswith("refused: UserError ") and REFUSAL in line for line in refusals)


def test_a_world_of_one_reduces_to_the_scaled_tensor():
    import tensorflow as tf

    reduced = LocalCollectives().reduce_gradients(
        [tf.constant([2.0]), None], GradientReduction("average", prescale=0.5, postscale=3.0))
    assert reduced[1] is None and reduced[0].numpy().tolist() == [3.0]


def test_distributed_optimizer_is_the_users_own_optimizer_made_distributed():
    """The drop-in's ``DistributedOptimizer`` returns the optimizer passed in, made distributed
    (only its class changes): what a rebuild from ``get_config`` would lose stays, a schedule
    without ``get_config`` (Keras examples' warm-up cosine), a subclass's own ``__init__``
    arguments, variables already built; ``name=`` renames it; a second call replaces the
    settings instead of reducing twice; ``hvdtrain.tensorflow``'s is the same function."""
    import keras
    import tensorflow as tf

    import hvdtrain.keras as hvd
    import hvdtrain.tensorflow as hvd_tf
    from hvdtrain.dropin.core import reducing_class
    from workloads import WarmUpCosine

    class ScaledSGD(keras.optimizers.SGD):
        def __init__(self, scale: float, **kwargs) -> None:
            super().__init__(**kwargs)
            self.scale = scale

    schedule = WarmUpCosine(0.1, total_steps=10, warmup_steps=2)
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    optimizer.build([keras.Variable(tf.zeros(3))])
    built = [id(variable) for variable in optimizer.variables]
    with pytest.raises(NotImplementedError):
        optimizer.get_config()                         # it cannot be rebuilt from its config
    assert hvd.DistributedOptimizer(optimizer, name="distributed_sgd") is optimizer
    assert optimizer._learning_rate is schedule        # (where Keras 3 keeps a schedule)
    assert [id(variable) for variable in optimizer.variables] == built
    assert optimizer.name == "distributed_sgd" and isinstance(optimizer, keras.optimizers.SGD)
    assert type(optimizer) is reducing_class(keras.optimizers.SGD, hvd_tf.gradient_reduction(),
                                             1, False)
    assert hvd_tf.DistributedOptimizer(optimizer, op=hvd.Sum,
                                       backward_passes_per_step=2) is optimizer
    assert type(optimizer) is reducing_class(keras.optimizers.SGD,
                                             hvd_tf.gradient_reduction(hvd.Sum), 2, False)
    scaled = ScaledSGD(2.0, learning_rate=0.1)
    assert hvd.DistributedOptimizer(scaled) is scaled and scaled.scale == 2.0


def test_keras_2_checkpoint_names_become_keras_3_names():
    from hvdtrain.keras.callbacks import keras3_checkpoint_path

    assert keras3_checkpoint_path("ckpt-{epoch}.h5", False) == "ckpt-{epoch}.keras"
    assert keras3_checkpoint_path("best", False) == "best.keras"
    assert keras3_checkpoint_path("model.keras", False) == "model.keras"
    assert keras3_checkpoint_path("w.h5", True) == "w.weights.h5"
    assert keras3_checkpoint_path("w.weights.h5", True) == "w.weights.h5"


def test_a_distributed_optimizers_partial_sums_are_saved_with_it(tmp_path):
    """``backward_passes_per_step`` > 1: ``tf.train.Checkpoint`` of the optimizer holds the
    gradients summed so far and the pass counter (a resumed script continues in phase)."""
    import keras
    import tensorflow as tf

    from hvdtrain.keras_internals import set_class
    from hvdtrain.optimizers.reduction import reducing_class

    optimizer = keras.optimizers.SGD(0.1)
    set_class(optimizer, reducing_class(type(optimizer), GradientReduction("average"), 2, True,
                                        lambda grads, reduction, variables:
                                        LocalCollectives().reduce_gradients(grads, reduction)))
    variable = keras.Variable([1.0, 2.0])
    optimizer.apply([tf.constant([0.5, 0.25])], [variable])      # the first of two passes
    saved = dict(tf.train.list_variables(
        tf.train.Checkpoint(optimizer=optimizer).write(str(tmp_path / "ckpt"))))
    sums = [name for name in saved if "_hvdtrain_accumulated" in name]
    counters = [name for name in saved if "_hvdtrain_calls" in name]
    assert len(sums) == 1 and len(counters) == 1
    reader = tf.train.load_checkpoint(str(tmp_path / "ckpt"))
    assert reader.get_tensor(sums[0]).tolist() == [0.5, 0.25]
    assert reader.get_tensor(counters[0]) == 1
    assert variable.numpy().tolist() == [1.0, 2.0]                # not applied yet
