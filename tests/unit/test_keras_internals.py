"""Every Keras (and tf.data) internal hvdtrain relies on, checked against the installed version
in one process: a Keras upgrade that moves one fails here, by name, instead of deep in a run.
And the fence: no module of hvdtrain but ``keras_internals`` touches one."""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import re
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import REPO
from hvdtrain import keras_internals as internals


def _compiled() -> keras.Model:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"], loss_weights=None)
    return model


def test_the_keras_pin_is_the_tested_range():
    """pyproject.toml lets pip install exactly the Keras versions this file was run on (a wider
    pin must come with a run of these tests), and ``keras_version`` reads the installed one."""
    [pin] = [Requirement(line) for line in re.findall(r'^\s*"(keras\b[^"]*)"',
                                                      (REPO / "pyproject.toml").read_text(), re.M)]
    (low_major, low_minor), (high_major, high_minor) = internals.TESTED_KERAS
    assert pin.specifier == SpecifierSet(f">={low_major}.{low_minor},<{high_major}.{high_minor}")
    assert internals.keras_version() == Version(keras.__version__).release[:2]


def test_backup_and_restore_sets_the_epoch_fit_starts_at(tmp_path):
    """Keras' ``BackupAndRestore`` tells ``fit`` where to start in the attribute
    ``initial_epoch_of`` reads: a run stopped after its second epoch starts again at 2. (Eager
    steps: tracing ``fit``'s function twice cost 10 s of this test.)"""
    x, y = np.zeros((4, 4)), np.zeros(4)
    seen = []

    def compiled() -> keras.Model:
        model = _compiled()
        model.run_eagerly = True
        return model

    class Interrupt(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append(internals.initial_epoch_of(self.model))

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    def fit(model: keras.Model) -> keras.callbacks.History:
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        return model.fit(x, y, epochs=4, verbose=0, callbacks=[backup, Interrupt()])

    with pytest.raises(RuntimeError, match="interrupted"):
        fit(compiled())
    resumed = compiled()
    assert fit(resumed).epoch == [2, 3]
    assert seen == [0, 2] and internals.initial_epoch_of(resumed) == 2


def test_compile_arguments():
    model = _compiled()
    arguments = internals.compile_arguments(model)
    assert arguments["loss"] == "sparse_categorical_crossentropy"
    assert arguments["metrics"] == ["accuracy"] and "optimizer" in arguments


def test_sublayers_and_optimizer_variables():
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)], name="inner")
    outer = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(1)])
    assert any(layer.name == "inner" for layer in internals.sublayers(outer))
    assert len([layer for layer in internals.sublayers(outer)
                if isinstance(layer, keras.layers.Dense)]) == 2
    optimizer = keras.optimizers.Adam()
    optimizer.build(outer.trainable_variables)
    assert [v.path for v in internals.optimizer_variables_built_for(optimizer)] == [
        v.path for v in outer.trainable_variables]


def test_initial_epoch_is_what_fit_starts_at():
    model = _compiled()
    internals.set_initial_epoch(model, 2)
    history = model.fit(np.zeros((4, 4)), np.zeros(4), epochs=3, verbose=0)
    assert history.epoch == [2]
    internals.set_initial_epoch(model, None)


def test_batched_datasets_are_recognised():
    rows = tf.data.Dataset.from_tensor_slices(np.arange(10.0))
    assert not internals.dataset_is_batched(rows)
    assert internals.dataset_is_batched(rows.batch(2).map(lambda x: x).prefetch(1))
    assert internals.dataset_is_batched(rows.padded_batch(2))
    assert not internals.dataset_is_batched(rows.batch(2).unbatch())
    assert internals.dataset_is_batched(keras.utils.timeseries_dataset_from_array(
        np.zeros((20, 2)), None, sequence_length=4, batch_size=3))


def test_the_symbolic_build_builds_loss_and_metrics_without_counting_a_batch():
    """Keras' own build before ``fit`` builds the compiled loss and metrics from a batch's
    shapes (Keras reads them at epoch ends) without an update; the outputs' specs come from
    the same symbolic pass; the loss tracker is the metric reported as ``loss``; a masked
    output's first rows keep their mask cut alike."""
    model = _compiled()
    x, y = np.ones((2, 4), np.float32), np.array([0, 1])
    internals.build_symbolically(model, x, y, None)
    assert model._compile_metrics.built and model._compile_loss.built
    assert all(float(np.sum(v.numpy())) == 0.0 for v in model._compile_metrics.variables)
    specs, masked = internals.symbolic_outputs(model, x)
    assert specs.shape == (2, 3) and not masked
    assert internals.loss_tracker(model).name == "loss"
    probabilities = keras.layers.Dense(3, activation="softmax")(tf.ones((2, 4)))
    assert internals.keras_logits(probabilities) is not None
    assert internals.keras_logits(internals.with_logits(tf.ones(2), tf.zeros(2))) is not None


def test_random_states_and_op_determinism_round_trip():
    """TensorFlow's global seed and operation-seed counter, Keras' global seed generator and
    op determinism are where hvdtrain reads and restores them."""
    keras.utils.set_random_seed(5)
    float(tf.random.uniform(()))
    float(keras.random.uniform(()))
    tf_state, keras_state = internals.tf_random_state(), internals.keras_random_state()
    expected = float(tf.random.uniform(())), float(keras.random.uniform(()))
    keras.utils.set_random_seed(9)
    internals.set_tf_random_state(tf_state)
    internals.set_keras_random_state(keras_state)
    assert (float(tf.random.uniform(())), float(keras.random.uniform(()))) == expected
    before = internals.op_determinism_enabled()
    internals.set_op_determinism(not before)
    assert internals.op_determinism_enabled() == (not before)
    internals.set_op_determinism(before)


def test_synchronized_moments_are_computed_by_the_function_sync_moments_replaced_sets():
    """``ops.moments(..., synchronized=True)`` (a synchronized BatchNormalization's statistics)
    reaches the replacement, float16 inputs cast to float32 first; Keras' own afterwards."""
    from keras.src.backend.tensorflow import nn

    seen = []

    def moments(x, axes, keepdims):
        seen.append((x.dtype, list(axes), keepdims))
        return tf.zeros([3]), tf.ones([3])

    keras_own = nn._compute_moments_sync
    with internals.sync_moments_replaced(moments):
        mean, variance = keras.ops.moments(tf.ones([4, 3], tf.float16), axes=[0],
                                           synchronized=True)
    assert nn._compute_moments_sync is keras_own
    assert seen == [(tf.float32, [0], False)]
    assert mean.dtype == tf.float16 and float(variance[0]) == 1.0


def test_keras_callbacks_print_through_the_function_silenced_on_other_ranks(capsys):
    """Keras' printing callbacks (``EarlyStopping(verbose=1)`` here) and its progress bar print
    through the function ``keras_messages_silenced`` replaces: nothing inside it, Keras' own
    printing again after it (and always where it is not asked to silence)."""
    stopping = keras.callbacks.EarlyStopping(verbose=1)
    stopping.stopped_epoch = 3                   # what it prints at train end: it stopped
    bar = keras.callbacks.ProgbarLogger()
    bar.set_params({"verbose": 1, "epochs": 2, "steps": 1})

    def print_both() -> str:
        stopping.on_train_end()
        bar.on_epoch_begin(0)
        return capsys.readouterr().out

    with internals.keras_messages_silenced():
        assert print_both() == ""
    with internals.keras_messages_silenced(False):
        assert "Epoch 1/2" in print_both()
    assert print_both() == "Epoch 4: early stopping\nEpoch 1/2\n"


def test_optimizer_keys_and_slot_names_are_keras_own():
    """The key Keras' TensorFlow optimizers index state by (a Keras or a TensorFlow variable),
    and the name of a slot (Keras names a slot after its variable's path)."""
    optimizer = keras.optimizers.Adam()
    for variable in (keras.Variable(np.zeros(2), name="w"), tf.Variable(np.zeros(2))):
        assert internals.optimizer_key(variable) == optimizer._var_key(variable)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    optimizer.build(model.trainable_variables)
    kernel = model.trainable_variables[0]
    names = [slot.name for slot in optimizer.variables]
    assert internals.slot_name(kernel.path, "momentum") in names
    assert internals.slot_name(kernel.path, "velocity") in names


def test_optimizer_hooks_are_where_keras_keys_state_and_clips():
    """A class with ``OptimizerHooks`` mixed in maps Keras' keys (here another variable's
    state updates ``b``) and clips as its ``hvdtrain_clipped`` says (here Keras' own
    ``clipnorm``, reached through it)."""
    clipped_calls = []

    class Hooked(internals.OptimizerHooks, keras.optimizers.SGD):
        def hvdtrain_key(self, key):
            return aliases.get(key, key)

        def hvdtrain_clipped(self, grads, keras_clipping):
            clipped_calls.append(len(grads))
            return keras_clipping(grads)

    a, b = keras.Variable([0.0, 0.0], name="a"), keras.Variable([1.0, 1.0], name="b")
    aliases = {internals.optimizer_key(b): internals.optimizer_key(a)}
    optimizer = Hooked(learning_rate=1.0, momentum=0.5, clipnorm=1.0)
    optimizer.build([a])
    optimizer.apply([tf.constant([3.0, 4.0])], [b])      # the gradient clipped to norm 1
    assert clipped_calls == [1] and np.allclose(b.numpy(), [0.4, 0.2])
    [momentum] = [v for v in optimizer.variables if v.name == internals.slot_name(a.path,
                                                                                  "momentum")]
    assert np.allclose(momentum.numpy(), [-0.6, -0.8]) and np.allclose(a.numpy(), [0.0, 0.0])


def test_fit_finalizes_through_the_method_finalizing_deferred_hides():
    """Keras' ``fit`` ends with the optimizer's ``finalize_variable_values``: not inside
    ``finalizing_deferred``, once after it; the class's own method is back after the block."""
    calls = []

    class Counting(keras.optimizers.SGD):
        def finalize_variable_values(self, var_list):
            calls.append(len(var_list))
            super().finalize_variable_values(var_list)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(Counting(), "mse", run_eagerly=True)
    x, y = np.zeros((2, 2)), np.zeros((2, 1))
    with internals.finalizing_deferred(model.optimizer):
        model.fit(x, y, verbose=0)
    assert calls == [] and "finalize_variable_values" not in vars(model.optimizer)
    model.fit(x, y, verbose=0)
    assert calls == [2]


def test_a_resized_variable_stays_the_same_object_in_every_list_that_holds_it():
    optimizer = keras.optimizers.Adam()
    weight = keras.Variable(np.ones((3, 2), np.float32), name="kernel")
    optimizer.build([weight])
    slot = optimizer.variables[2]
    internals.resize_variable(slot, np.arange(3, dtype=np.float32))
    assert optimizer.variables[2] is slot and optimizer._momentums[0] is slot
    assert tuple(slot.shape) == (3,) and slot.numpy().tolist() == [0, 1, 2]
    slot.assign(slot + 1)
    assert slot.numpy().tolist() == [1, 2, 3]


def test_the_saving_walk_asks_what_keras_save_asks_in_its_order_and_keeps_nothing(tmp_path):
    """``saving_walked`` reaches each saveable as ``model.save`` does (stage 3's lockstep
    depends on the order), reading no variable; ``method_replaced`` is undone after."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    saveables = [*model.layers, model.optimizer]

    def walk(save: Any) -> list[str]:
        asked: list[str] = []
        with contextlib.ExitStack() as stack:
            for saveable in saveables:
                def recorded(store: Any, name: str = saveable.name) -> None:
                    asked.append(name)
                    store["0"] = np.zeros(1)
                stack.enter_context(internals.method_replaced(saveable, "save_own_variables",
                                                              recorded))
            save()
        return asked

    walked = walk(lambda: internals.saving_walked(model))
    assert walked == walk(lambda: model.save(tmp_path / "m.keras"))
    assert walked == walk(lambda: model.save_weights(tmp_path / "m.weights.h5"))
    assert sorted(walked) == sorted(s.name for s in saveables)
    assert "save_own_variables" not in vars(model.layers[0])
    assert (tmp_path / "m.keras").exists()


def test_layers_built_while_automatic_names_are_kept_do_not_shift_the_next_names():
    """Rank 0's float32 copy of a trained model must not rename the next model it builds."""
    keras.layers.Dense(1, name=None)
    with internals.automatic_names_kept():
        inside = [keras.layers.Dense(1).name for _ in range(2)]
    after = keras.layers.Dense(1).name
    assert len(set(inside)) == 2 and after == inside[0]


def test_a_config_at_a_constant_rate_leaves_the_optimizers_schedule():
    """A schedule written as Keras' examples write them (no ``get_config``) is where Keras keeps
    it (``_learning_rate``): the config has a constant rate, the optimizer its schedule."""

    class Halving(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.1 / (1.0 + tf.cast(step, tf.float32))

    schedule = Halving()
    optimizer = keras.optimizers.Adam(schedule)
    with pytest.raises(NotImplementedError):
        optimizer.get_config()
    assert isinstance(internals.config_at_a_constant_rate(optimizer)["learning_rate"], float)
    assert optimizer._learning_rate is schedule


# --- the fence ---------------------------------------------------------------------------------

PACKAGE = REPO / "hvdtrain"
FENCE = PACKAGE / "keras_internals.py"
KERAS_CLASSES = (keras.Model, keras.layers.Layer, keras.optimizers.Optimizer,
                 keras.optimizers.LossScaleOptimizer, keras.Variable, keras.callbacks.Callback,
                 keras.metrics.Metric, keras.losses.Loss)
ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr", "__getattribute__",
                       "__setattr__", "__delattr__")


def _private(name: str) -> bool:
    """A private name (hvdtrain's own ``_hvdtrain_`` attributes on Keras objects aside)."""
    return name.startswith("_") and not name.startswith(("__", "_hvdtrain"))


def _named_attributes(tree: ast.AST) -> set[str]:
    """The attribute names a module reads or writes, also by name (``getattr(x, "_name")``)."""
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called(node) in ATTRIBUTE_FUNCTIONS:
            names |= {arg.value for arg in node.args
                      if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}
    return names


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else None)


@functools.cache
def keras_private_names() -> tuple[set[str], set[str], set[str]]:
    """(Keras' private names: of its main classes and of a built model's, optimizer's,
    layer's, variable's... own attributes, and every private name ``keras_internals`` reads;
    the private methods of those classes, which a subclass must not override; their public
    methods, which hvdtrain must not replace on an object)."""
    model = _compiled()
    model.optimizer.build(model.trainable_variables)
    objects = [model, model.optimizer, *model.layers, model.trainable_variables[0],
               keras.metrics.Mean(), keras.losses.MeanSquaredError(), keras.callbacks.History()]
    names = {name for cls in KERAS_CLASSES for name in dir(cls) if _private(name)}
    names |= {name for value in objects for name in vars(value) if _private(name)}
    names |= {name for name in _named_attributes(ast.parse(FENCE.read_text())) if _private(name)}
    methods = {name for cls in KERAS_CLASSES for name in dir(cls)
               if _private(name) and inspect.isfunction(getattr(cls, name))}
    public = {name for cls in KERAS_CLASSES for name in dir(cls)
              if not name.startswith("_") and inspect.isfunction(getattr(cls, name))}
    return names, methods, public


class _Fence(ast.NodeVisitor):
    """What one module of hvdtrain touches of Keras' internals: ``(line, what)``. A private
    name on ``self`` that the enclosing class assigns or defines itself is its own, not
    Keras'."""

    def __init__(self, names: set[str], methods: set[str], public: set[str]) -> None:
        self.names, self.methods, self.public = names, methods, public
        self.own: list[set[str]] = [set()]
        self.found: list[tuple[int, str]] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.found += [(item.lineno, f"def {item.name} (overrides Keras' private method)")
                       for item in node.body if isinstance(item, ast.FunctionDef)
                       and item.name in self.methods]
        self.own.append({target.attr for target in ast.walk(node)
                         if isinstance(target, ast.Attribute) and _on_self(target)
                         and isinstance(target.ctx, ast.Store)} | _defined_in(node))
        self.generic_visit(node)
        self.own.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.names and not (_on_self(node) and node.attr in self.own[-1]):
            self.found.append((node.lineno, ast.unparse(node)))
        elif (node.attr in self.public and isinstance(node.ctx, (ast.Store, ast.Del))
              and not _on_self(node)):
            self.found.append((node.lineno, f"{ast.unparse(node)} replaced on an object"))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if _called(node) in ATTRIBUTE_FUNCTIONS:
            self.found += [(node.lineno, ast.unparse(node)) for arg in node.args
                           if isinstance(arg, ast.Constant) and arg.value in self.names]
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self._keras_src(node, [alias.name for alias in node.names])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self._keras_src(node, [node.module or ""])

    def _keras_src(self, node: ast.stmt, modules: list[str]) -> None:
        self.found += [(node.lineno, f"imports {module}") for module in modules
                       if module == "keras.src" or module.startswith("keras.src.")]


def _defined_in(node: ast.ClassDef) -> set[str]:
    """The names a class's body defines (its methods, class attributes, annotations)."""
    names = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
    for item in node.body:
        targets = item.targets if isinstance(item, ast.Assign) else (
            [item.target] if isinstance(item, ast.AnnAssign) else [])
        names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id == "self"


def private_keras_uses(path: Path, fence: _Fence) -> list[str]:
    fence.found = []
    fence.visit(ast.parse(path.read_text(), str(path)))
    return [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in sorted(fence.found)]


def test_no_module_but_keras_internals_touches_keras_internals():
    """Every private Keras attribute or method (one of Keras' main classes', one of its
    objects', or one ``keras_internals`` reads), an override of Keras' private methods, a
    Keras method replaced on an object, or ``keras.src``: only in ``keras_internals``, so a
    Keras upgrade that moves one fails in this file's checks above."""
    fence = _Fence(*keras_private_names())
    found = [use for path in sorted(PACKAGE.rglob("*.py")) if path != FENCE
             for use in private_keras_uses(path, fence)]
    assert found == [], "private Keras use outside hvdtrain/keras_internals.py:\n" + \
        "\n".join(found)


def test_the_fence_finds_each_kind_of_private_use():
    """``keras.src``, an override of a Keras private method and the call of Keras' own, a
    private attribute read on ``self`` (a mixin) and by name, a method replaced on an object;
    not a class's own private attribute."""
    fence = _Fence(*keras_private_names())
    source = (
        "from keras.src import backend\n"
        "class Mixin:\n"
        "    def _var_key(self, variable):\n"
        "        return super()._var_key(variable)\n"
        "    def apply(self, grads):\n"
        "        return self._trainable_variables, getattr(self, '_learning_rate')\n"
        "class Own:\n"
        "    _name = 'own'\n"
        "    def __init__(self):\n"
        "        self._lock = None\n"
        "    def _model(self):\n"
        "        return self._lock, self._name, self._model\n"
        "def patch(optimizer):\n"
        "    optimizer.finalize_variable_values = None\n")
    fence.visit(ast.parse(source))
    assert [line for line, _ in sorted(fence.found)] == [1, 3, 4, 6, 6, 14]
