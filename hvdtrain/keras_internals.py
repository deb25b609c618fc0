"""Every use of Keras 3 internals in hvdtrain, in one place.

hvdtrain reproduces parts of Keras' own ``fit`` (its loss and metric bookkeeping, its rank
rules for targets) and needs a few facts Keras keeps in private attributes. Each such use is a
function here, so a Keras upgrade that moves one breaks this module alone, and
``tests/unit/test_keras_internals.py`` fails loudly naming it; that test also fails naming the
file and line of any such use elsewhere in the package. ``pyproject.toml`` pins Keras to the
tested range.

Over 450 lines: it is the fence itself, the one list of every Keras (and tf.data) internal
hvdtrain touches, each a short function; split, the fence would be in several places.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Sequence

import keras

TESTED_KERAS = ((3, 10), (3, 16))   # [lowest, highest) major.minor tested


def compile_arguments(model: keras.Model) -> dict[str, Any]:
    """What was passed to ``model.compile`` (Keras keeps it in the compile config; ``model.loss``
    alone would lose ``loss_weights`` and the metrics)."""
    return dict(getattr(getattr(model, "_compile_config", None), "config", {}) or {})


def sublayers(model: keras.Model) -> list[keras.layers.Layer]:
    """Every layer inside ``model``, nested models' layers included."""
    return list(model._flatten_layers(include_self=False))


def loop_bodies(model: keras.Model) -> set[int]:
    """The layers (by id) a recurrent layer calls inside its loop over time steps (its cells
    and what they hold): a call wrapped there would be wrapped once per step, inside the
    loop, where a recomputation cannot reach the loop's captured values. Their owner, the
    recurrent layer, is what gathers or recomputes instead."""
    return {id(inner) for layer in sublayers(model) if isinstance(layer, keras.layers.RNN)
            for inner in layer._flatten_layers(include_self=False)}


def optimizer_variables_built_for(optimizer: keras.optimizers.Optimizer) -> list[Any]:
    """The model variables a built optimizer updates, in its own order (its slot variables
    follow that order): what a checkpoint builds it for again before restoring its state, and
    what ``apply`` updates when it is given no variables."""
    return list(optimizer._trainable_variables)


def optimizer_key(variable: Any) -> Any:
    """The key Keras' TensorFlow optimizers index a variable's state by (their ``_var_key``:
    the ``_unique_id`` of the TensorFlow variable, a Keras variable's ``value``)."""
    return (variable.value if isinstance(variable, keras.Variable) else variable)._unique_id


def slot_name(path: str, name: str) -> str:
    """The name Keras gives an optimizer's state variable ``name`` (``"momentum"``...) for the
    model variable at ``path`` (``add_variable_from_reference``'s naming)."""
    return f"{path.replace('/', '_')}_{name}"


class OptimizerHooks:
    """Mixed in before a Keras optimizer class: two private steps of Keras' update, under
    hvdtrain's names, so a class hvdtrain gives an optimizer overrides these instead.
    ``hvdtrain_key(key)``: the key Keras indexes a variable's state and its weight-decay
    exclusion by (``_var_key``, called by ``build``, ``apply`` and the weight decay).
    ``hvdtrain_clipped(grads, keras_clipping)``: the gradients after clipping
    (``_clip_gradients``, Keras' ``clipnorm``, ``global_clipnorm`` and ``clipvalue``, called
    by ``apply``); ``keras_clipping`` is Keras' own."""

    def _var_key(self, variable: Any) -> Any:
        return self.hvdtrain_key(super()._var_key(variable))

    def _clip_gradients(self, grads: Any) -> Any:
        return self.hvdtrain_clipped(grads, super()._clip_gradients)

    def hvdtrain_key(self, key: Any) -> Any:
        return key

    def hvdtrain_clipped(self, grads: Any, keras_clipping: Callable[[Any], Any]) -> Any:
        return keras_clipping(grads)


@contextlib.contextmanager
def finalizing_deferred(optimizer: keras.optimizers.Optimizer) -> Iterator[None]:
    """Keras' ``fit`` ends by calling ``optimizer.finalize_variable_values`` (an optimizer
    with ``use_ema`` puts its averages into the weights): inside the block that call does
    nothing (an attribute of the instance hides the class's method); the class's own after."""
    optimizer.finalize_variable_values = lambda variables: None
    try:
        yield
    finally:
        del optimizer.finalize_variable_values


def set_initial_epoch(model: keras.Model, epoch: int | None) -> None:
    """The epoch ``fit`` starts at regardless of its ``initial_epoch`` argument: Keras'
    ``BackupAndRestore`` sets it; hvdtrain restores instead and clears it."""
    model._initial_epoch = epoch


def initial_epoch_of(model: keras.Model) -> int:
    """The epoch ``BackupAndRestore`` told ``fit`` to start at (0: none)."""
    return int(getattr(model, "_initial_epoch", None) or 0)


def keras_version() -> tuple[int, int]:
    major, minor = keras.__version__.split(".")[:2]
    return int(major), int(minor)


# tf.data's dataset classes that batch their input (names of tf.data's private classes).
_BATCHING_DATASETS = ("_BatchDataset", "_PaddedBatchDataset", "_ParallelBatchDataset",
                      "_DenseToRaggedDataset", "_DenseToSparseBatchDataset",
                      "_MapAndBatchDataset", "_RebatchDataset", "_RaggedBatchDataset")


def dataset_is_batched(dataset: Any) -> bool:
    """Whether a ``tf.data`` pipeline batches its elements: a batching op between it and its
    source, with no ``unbatch`` after it (tf.data keeps each op's input in ``_input_dataset``;
    a zip or concatenation is followed through its first input)."""
    while dataset is not None:
        name = type(dataset).__name__
        if name == "_UnbatchDataset":
            return False
        if name in _BATCHING_DATASETS:
            return True
        inputs = getattr(dataset, "_datasets", None)
        dataset = getattr(dataset, "_input_dataset", None) or (
            tf_nest_first(inputs) if inputs else None)
    return False


def tf_nest_first(structure: Any) -> Any:
    import tensorflow as tf

    return tf.nest.flatten(structure)[0]


# tf.data's dataset classes whose two seeds both 0 mean "seed from nothing" in every process.
_SEEDED_DATASETS = {"_ShuffleDataset": "an unseeded shuffle",
                    "_RandomDataset": "an unseeded Dataset.random or sample_from_datasets"}
# Classes whose functions build datasets of their own (their nodes are not Python objects).
_NESTING_DATASETS = ("_FlatMapDataset", "_InterleaveDataset", "_ParallelInterleaveDataset")
# The same ops in a serialized pipeline, with the input positions of their two seeds.
_SEEDED_OPS = {"ShuffleDataset": (2, 3), "ShuffleDatasetV3": (2, 3),
               "ShuffleAndRepeatDataset": (2, 3), "ShuffleAndRepeatDatasetV2": (2, 3),
               "RandomDataset": (0, 1), "RandomDatasetV2": (0, 1)}


def unseeded_randomness(dataset: Any) -> str | None:
    """What in a ``tf.data`` pipeline orders its elements differently in every process, or None:
    a shuffle or random dataset made without any seed (tf.data keeps them in ``_seed`` and
    ``_seed2``), or a parallel map with ``deterministic=False`` (``_deterministic``), found by
    following every input (``_inputs()``); where a function of the pipeline builds datasets of
    its own (``flat_map``, ``interleave``) or interleaves in parallel, the serialized pipeline
    is read too (``_unseeded_in_graph``)."""
    pending, nesting = [dataset], False
    while pending:
        node = pending.pop()
        name = type(node).__name__
        seeds = [getattr(node, attribute, None) for attribute in ("_seed", "_seed2")]
        if name in _SEEDED_DATASETS and all(s is not None and int(s) == 0 for s in seeds):
            return _SEEDED_DATASETS[name]
        if getattr(node, "_deterministic", None) == "false":
            return "a parallel map with deterministic=False"
        nesting = nesting or name in _NESTING_DATASETS
        try:
            pending += list(node._inputs())
        except (AttributeError, NotImplementedError):
            continue
    return _unseeded_in_graph(dataset) if nesting else None


def _unseeded_in_graph(dataset: Any) -> str | None:
    """The same, read from the pipeline's serialized graph (``_as_serialized_graph``) and the
    functions in it: a parallel op with ``deterministic`` "false", or an op of ``_SEEDED_OPS``
    whose seeds are both the constant 0. None also when the pipeline cannot be serialized."""
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2

    try:
        serialized = dataset._as_serialized_graph(
            external_state_policy=tf.data.experimental.ExternalStatePolicy.WARN)
        graph = graph_pb2.GraphDef.FromString(serialized.numpy())
    except (tf.errors.OpError, ValueError, TypeError):
        return None
    for nodes in [graph.node, *(function.node_def for function in graph.library.function)]:
        by_name = {node.name: node for node in nodes}
        for node in nodes:
            if "deterministic" in node.attr and node.attr["deterministic"].s == b"false":
                return f"{node.op} with deterministic=False"
            if node.op not in _SEEDED_OPS:
                continue
            values = []
            for position in _SEEDED_OPS[node.op]:
                source = by_name.get(node.input[position].split(":")[0])
                if source is None or source.op != "Const":
                    break
                values.append(int(tf.make_ndarray(source.attr["value"].tensor)))
            if values == [0, 0]:
                return "an unseeded shuffle inside a flat_map or interleave"
    return None


def tf_random_state() -> tuple[Any, Any]:
    """TensorFlow's eager global seed and the generator it draws operation seeds from
    (TensorFlow keeps both on its context; ``tf.random.set_seed`` replaces them)."""
    from tensorflow.python.eager import context

    ctx = context.context()
    rng = getattr(ctx, "_rng", None)
    return ctx._seed, None if ctx._seed is None or rng is None else rng.getstate()


def set_tf_random_state(state: tuple[Any, Any]) -> None:
    """Put back what ``tf_random_state`` returned."""
    from tensorflow.python.eager import context

    seed, rng_state = state
    ctx = context.context()
    if seed is None:
        ctx._seed = None
        return
    ctx._set_global_seed(seed)
    if rng_state is not None:
        ctx._rng.setstate(rng_state)


def keras_random_state() -> tuple[Any, Any, Any]:
    """Keras' global seed, its global seed generator and that generator's state (Keras keeps
    them in its global state; ``keras.utils.set_random_seed`` replaces them)."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR
    from keras.src.utils.rng_utils import GLOBAL_RANDOM_SEED

    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    state = None if generator is None else generator.state.numpy()
    return global_state.get_global_attribute(GLOBAL_RANDOM_SEED), generator, state


def set_keras_random_state(state: tuple[Any, Any, Any]) -> None:
    """Put back what ``keras_random_state`` returned."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR
    from keras.src.utils.rng_utils import GLOBAL_RANDOM_SEED

    seed, generator, generator_state = state
    global_state.set_global_attribute(GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, generator)
    if generator is not None:
        generator.state.assign(generator_state)


def op_determinism_enabled() -> bool:
    """Whether TensorFlow's op determinism is on (TensorFlow exports only the switch to turn
    it on, not the question or the switch back)."""
    from tensorflow.python.framework import config

    return bool(config.is_op_determinism_enabled())


def set_op_determinism(enabled: bool) -> None:
    from tensorflow.python.framework import config

    (config.enable_op_determinism if enabled else config.disable_op_determinism)()


def build_symbolically(model: keras.Model, x: Any, y: Any, sample_weight: Any) -> None:
    """Keras' own build before ``fit`` (its ``_symbolic_build``): the model, its compiled loss
    and metrics built from the shapes of a batch, with symbolic tensors only, so no real row
    reaches the model's ``call`` and no metric counts one. The optimizer is left to the caller
    (whole, or in pieces under ZeRO), once every weight exists."""
    from keras.src import backend

    x, y, sample_weight = _symbolic((x, y, sample_weight))
    predictions = backend.compute_output_spec(model, x, training=False)
    if model._compile_metrics is not None and not model._compile_metrics.built:
        backend.compute_output_spec(model.compute_metrics, x, y, predictions,
                                    sample_weight=sample_weight)
    if model._compile_loss is not None and not model._compile_loss.built:
        backend.compute_output_spec(model._compute_loss, x, y, predictions,
                                    sample_weight=sample_weight, training=False)


def loss_takes_unknown_rows(model: keras.Model, y: Any, y_pred: Any) -> bool:
    """Whether the model's loss can be traced on targets and predictions whose row count is
    unknown (a global batch gathered from the ranks): a loss that squeezes or reshapes by the
    batch size cannot. Found by a symbolic call of ``compute_loss``."""
    import tensorflow as tf
    from keras.src import backend

    def unknown_rows(values: Any) -> Any:
        return tf.nest.map_structure(lambda v: backend.KerasTensor(
            (None, *v.shape[1:]), backend.standardize_dtype(v.dtype)), values)

    try:
        backend.compute_output_spec(lambda t, p: model.compute_loss(y=t, y_pred=p,
                                                                    training=False),
                                    unknown_rows(y), unknown_rows(y_pred))
    except Exception:  # noqa: BLE001 - whatever the user's loss raises on such shapes
        return False
    return True


def symbolic_outputs(model: keras.Model, x: Any) -> tuple[Any, bool]:
    """(the model's outputs on ``x`` as Keras' symbolic pass gives them, shapes and dtypes;
    whether one carries a Keras mask, ``_keras_mask``, which Keras' losses read), from one
    symbolic call."""
    import tensorflow as tf
    from keras.src import backend
    from keras.src.backend import get_keras_mask

    found: list[bool] = []

    def call(inputs: Any) -> Any:
        outputs = model(inputs, training=False)
        found.extend(get_keras_mask(output) is not None for output in tf.nest.flatten(outputs))
        return outputs

    specs = backend.compute_output_spec(call, _symbolic(x))
    return specs, any(found)


def _symbolic(values: Any) -> Any:
    import tensorflow as tf
    from keras.src import backend

    return tf.nest.map_structure(lambda v: None if v is None else backend.KerasTensor(
        v.shape, backend.standardize_dtype(v.dtype)), values)


def keras_mask(value: Any) -> Any:
    """The Keras mask an output carries (None: none)."""
    from keras.src.backend import get_keras_mask

    return get_keras_mask(value)


def output_marks(values: Any) -> list[tuple[Any, Any]]:
    """The Keras mask and logits each output carries (None where none): a tensor returned
    from a compiled (XLA) function loses them, ``marked`` puts them back."""
    import tensorflow as tf
    from keras.src.backend import get_keras_mask

    return [(get_keras_mask(value), keras_logits(value)) for value in tf.nest.flatten(values)]


def marked(values: Any, marks: list[tuple[Any, Any]]) -> Any:
    """``values`` carrying the masks and logits ``output_marks`` read (Keras' metrics and
    losses read them)."""
    import tensorflow as tf
    from keras.src.backend import set_keras_mask

    for value, (mask, logits) in zip(tf.nest.flatten(values), marks):
        if mask is not None:
            set_keras_mask(value, mask)
        if logits is not None:
            with_logits(value, logits)
    return values


def keras_logits(value: Any) -> Any:
    """The logits a softmax or sigmoid output of Keras carries (``_keras_logits``): Keras'
    crossentropy computes from them, which rounds otherwise than from the probabilities."""
    return getattr(value, "_keras_logits", None)


def with_logits(value: Any, logits: Any) -> Any:
    """``value`` carrying ``logits`` as a softmax or sigmoid output of Keras does."""
    value._keras_logits = logits
    return value


def output_loss_trackers(model: keras.Model) -> list[keras.metrics.Metric]:
    """The ``Mean`` per output that Keras' compiled loss feeds each output's loss of a batch
    (the ``<output>_loss`` columns of a model with several losses), each with the ``total``
    it sums; empty for one loss (``model._compile_loss.metrics``)."""
    compiled = getattr(model, "_compile_loss", None)
    return [metric for metric in (compiled.metrics if compiled is not None else [])
            if hasattr(metric, "total")]


def loss_tracker(model: keras.Model) -> keras.metrics.Metric:
    """The ``Mean`` that Keras' ``train_step`` and ``test_step`` feed each batch's loss
    (weighted by its rows), reported as ``loss`` (``model._loss_tracker``)."""
    return model._loss_tracker


@contextlib.contextmanager
def train_step_installed(model: keras.Model, train_step: Callable[[Any], Any]) -> Iterator[None]:
    """``train_step`` as the model's step, XLA off, Keras' cached traced functions dropped (so
    ``fit`` traces the new step); the model as it was afterwards. Keras reads ``train_step``
    and ``jit_compile`` from the model when it builds ``train_function``."""
    jit = model.jit_compile
    model.jit_compile = False
    model.train_step = train_step
    model.train_function = model.test_function = None
    try:
        yield
    finally:
        del model.train_step
        model.train_function = model.test_function = None
        model.jit_compile = jit


def set_class(instance: Any, cls: type) -> None:
    """Make ``instance`` (an optimizer) an instance of ``cls``, a subclass of its own class or
    its own class again: the same object with the same variables and state, whose methods are
    ``cls``'s. How an optimizer becomes distributed in place, and back."""
    instance.__class__ = cls


def resize_variable(variable: Any, value: Any) -> None:
    """Give a Keras variable a value of another shape, in place: the same object (so every
    list that holds it, an optimizer's slot lists included, sees the change) over a new
    TensorFlow variable on the same device. How ZeRO cuts an optimizer's state into this
    rank's pieces and puts it back whole."""
    import tensorflow as tf

    with tf.init_scope(), tf.device(variable.value.device):
        value = tf.convert_to_tensor(value, variable.dtype)
        variable._shape = tuple(value.shape)
        variable._ndim = len(variable._shape)
        variable._initialize(value)


def copy_as(instance: Any, cls: type) -> Any:
    """A new object of ``cls`` (a subclass of ``instance``'s class) with ``instance``'s
    attributes: a ``tf.GradientTape`` that keeps what the user's tape recorded."""
    copy = object.__new__(cls)
    copy.__dict__.update(instance.__dict__)
    return copy


def config_at_a_constant_rate(optimizer: keras.optimizers.Optimizer) -> dict[str, Any]:
    """``optimizer.get_config()`` with a constant learning rate standing in for a schedule: a
    schedule without ``get_config``, as Keras' examples write them, cannot be serialised, and
    a copy made to probe how the optimizer updates does not need it."""
    rate = optimizer._learning_rate
    scheduled = isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) or (
        callable(rate) and not isinstance(rate, keras.Variable))
    if not scheduled:
        return optimizer.get_config()
    object.__setattr__(optimizer, "_learning_rate", 1e-3)
    try:
        return optimizer.get_config()
    finally:
        object.__setattr__(optimizer, "_learning_rate", rate)


def remember_rates(optimizer: keras.optimizers.Optimizer, base: float, last: float) -> None:
    """Note on the optimizer the base rate a run scaled and the rate it last set, so a next run
    of the same model (a notebook) starts from the base again (``remembered_rates``)."""
    optimizer._hvdtrain_rates = (base, last)


def remembered_rates(optimizer: keras.optimizers.Optimizer) -> tuple[float, float] | None:
    """(base rate, rate last set) from an earlier run of this optimizer, or None."""
    return getattr(optimizer, "_hvdtrain_rates", None)


def pythonified_logs(logs: dict | None) -> dict:
    """An epoch's logs as Keras' ``CallbackList`` hands them to each callback's
    ``on_epoch_end``: a new flat dict, values made Python floats where they convert."""
    from keras.src.utils import python_utils

    return python_utils.pythonify_logs(logs)


@contextlib.contextmanager
def sync_moments_replaced(moments: Callable[[Any, Any, bool], tuple[Any, Any]]
                          ) -> Iterator[None]:
    """``moments(x, axes, keepdims) -> (mean, variance)`` as the statistics of every
    ``ops.moments(..., synchronized=True)`` (``BatchNormalization(synchronized=True)``) for the
    block; Keras' own afterwards. Keras' TensorFlow backend computes them in
    ``_compute_moments_sync``, which sums across the replicas of a ``tf.distribute`` strategy
    and, without one, across nothing; its ``moments`` looks the function up at every call, by
    then on float32 inputs (float16 and bfloat16 are cast first)."""
    from keras.src.backend.tensorflow import nn

    keras_own = nn._compute_moments_sync
    nn._compute_moments_sync = moments
    try:
        yield
    finally:
        nn._compute_moments_sync = keras_own


@contextlib.contextmanager
def keras_messages_silenced(silenced: bool = True) -> Iterator[None]:
    """Keras' console messages dropped while inside (where ``silenced``): every callback of
    Keras that prints (``EarlyStopping``, ``ModelCheckpoint``, ``ReduceLROnPlateau``... with
    ``verbose=1``) and its progress bar print through ``io_utils.print_msg``, looked up on the
    module at each call. How ranks other than 0 stay quiet without touching the user's
    callbacks; Keras' own function again afterwards."""
    from keras.src.utils import io_utils

    if not silenced:
        yield
        return
    keras_print = io_utils.print_msg
    io_utils.print_msg = lambda message, line_break=True: None
    try:
        yield
    finally:
        io_utils.print_msg = keras_print


@contextlib.contextmanager
def automatic_names_kept() -> Iterator[None]:
    """Keras' counters of automatic names (``dense``, ``dense_1``...) as they were before the
    block. Layers built inside still get unique names; the ones built after it are named as if
    the block never ran. How rank 0 rebuilds the trained model (its float32 copy for saving)
    without naming the next model in this process differently from the other ranks' (a
    variable's path names its collectives)."""
    from keras.src.backend.common import global_state

    counters = global_state.get_global_attribute("object_name_uids")
    kept = None if counters is None else counters.copy()
    try:
        yield
    finally:
        global_state.set_global_attribute("object_name_uids", kept)


def own_trainable_variables(layer: keras.layers.Layer) -> list[Any]:
    """The trainable variables ``layer`` itself created (not its sublayers'): what ZeRO stage
    3 gathers inside that layer's call."""
    return list(layer._trainable_variables)


def stored_value(variable: Any) -> Any:
    """What a Keras variable stores (its TensorFlow variable), without the cast a
    mixed-precision layer's ``value`` makes."""
    return variable._value


@contextlib.contextmanager
def holding_values(variables: Sequence[Any], values: Sequence[Any],
                   shapes: Sequence[tuple[int, ...]]) -> Iterator[None]:
    """Each Keras variable reads as the tensor in ``values`` (of shape in ``shapes``) while the
    block runs, then as before: how a ZeRO stage-3 layer computes with its gathered whole
    weights while the variable stores only its piece. Keras' ``value`` (and so every op on the
    variable, with the mixed-precision cast) reads ``_value``; ``shape`` reads ``_shape``."""
    saved = [(v._value, v._shape, v._ndim) for v in variables]
    try:
        for variable, value, shape in zip(variables, values, shapes):
            variable._value, variable._shape, variable._ndim = value, tuple(shape), len(shape)
        yield
    finally:
        for variable, (value, shape, ndim) in zip(variables, saved):
            variable._value, variable._shape, variable._ndim = value, shape, ndim


def saving_walked(model: keras.Model) -> None:
    """Keras' own walk over what ``model.save`` and ``save_weights`` save (``saving_lib``'s
    ``_save_state``: layers, optimizers, metrics, in its order), each saveable's
    ``save_own_variables`` given a store that keeps nothing: how ZeRO stage 3 learns, on
    every rank alike, the order in which rank 0's save will ask for its pieces."""
    from keras.src.saving import saving_lib

    class Discarded(dict):
        def __setitem__(self, key: str, value: Any) -> None:
            pass

    class DiscardingStore(saving_lib.NpzIOStore):   # the class Keras' walk accepts
        def __init__(self) -> None:   # no file
            pass

        def __bool__(self) -> bool:
            return True

        def make(self, path: str, metadata: Any = None) -> Discarded:
            return Discarded()

    saving_lib._save_state(model, weights_store=DiscardingStore(), assets_store=None,
                           inner_path="", visited_saveables=set())


@contextlib.contextmanager
def method_replaced(instance: Any, name: str, method: Callable[..., Any]) -> Iterator[None]:
    """``instance.<name>`` is ``method`` while the block runs (set on the object itself,
    past Keras' attribute tracking), its class's method after."""
    object.__setattr__(instance, name, method)
    try:
        yield
    finally:
        object.__delattr__(instance, name)


@contextlib.contextmanager
def class_swapped(instance: Any, cls: type) -> Iterator[None]:
    """``instance`` is of ``cls`` (a subclass of its class) while the block runs."""
    original = type(instance)
    instance.__class__ = cls
    try:
        yield
    finally:
        instance.__class__ = original


def call_replaced(layer: keras.layers.Layer, call: Callable[..., Any]) -> ContextManager[None]:
    """``layer.call`` is ``call`` while the block runs: Keras' ``__call__`` looks the method
    up at each call (so its remat, masking and autocast still wrap it)."""
    return method_replaced(layer, "call", call)


def reindexed(optimizer: keras.optimizers.Optimizer) -> None:
    """Keras indexes a built optimizer's state by its variables' TensorFlow variables (the
    ``_var_key`` of each): after ZeRO stage 3 gives a variable a new one (cut into its piece,
    or whole again), the index is made again from the variables it was built for."""
    optimizer._trainable_variables_indices = {
        optimizer._var_key(variable): index
        for index, variable in enumerate(optimizer._trainable_variables)}


@contextlib.contextmanager
def constraints_set_aside(variables: Sequence[Any]) -> Iterator[None]:
    """The variables' constraints unset while the block runs (Keras' ``apply`` projects each
    variable after updating it; ZeRO stage 3's hold pieces, which a constraint would project
    as if whole), set again after."""
    saved = [v._constraint for v in variables]
    try:
        for variable in variables:
            variable._constraint = None
        yield
    finally:
        for variable, constraint in zip(variables, saved):
            variable._constraint = constraint


def call_state_kept() -> Callable[[], ContextManager[None]]:
    """The Keras state a layer's call runs in (its mixed-precision autocast and the call
    context nested layers read ``training`` from), as a context manager that enters it again:
    a call recomputed for its gradient runs outside ``Layer.__call__``."""
    from keras.src.backend.common import global_state
    from keras.src.backend.common.variables import AutocastScope, get_autocast_scope

    autocast = get_autocast_scope()
    call_context = global_state.get_global_attribute("current_call_ctx")

    @contextlib.contextmanager
    def entered() -> Iterator[None]:
        before = global_state.get_global_attribute("current_call_ctx")
        global_state.set_global_attribute("current_call_ctx", call_context)
        try:
            with (AutocastScope(autocast.dtype) if autocast is not None
                  else contextlib.nullcontext()):
                yield
        finally:
            global_state.set_global_attribute("current_call_ctx", before)

    return entered


@contextlib.contextmanager
def losses_taken(layer: keras.layers.Layer) -> Iterator[list[Any]]:
    """The losses ``layer`` and its sublayers add (``add_loss``) while the block runs, taken
    out of Keras' lists into the yielded list as the block ends: ZeRO stage 3 returns them
    from a recomputed call, so their gradients reach the weights, and adds them again."""
    layers = [layer, *layer._flatten_layers(include_self=False)]
    before = [len(each._losses) for each in layers]
    taken: list[Any] = []
    try:
        yield taken
    finally:
        for each, count in zip(layers, before):
            taken.extend(each._losses[count:])
            del each._losses[count:]


def seed_states(layer: keras.layers.Layer) -> list[Any]:
    """The state variables of the seed generators ``layer`` and its sublayers draw from (a
    ``Dropout``'s): a call recomputed for its gradient must draw what the first call drew."""
    return [generator.state for each in [layer, *layer._flatten_layers(include_self=False)]
            for generator in each._seed_generators]


def remat_mode_of(scope: keras.RematScope) -> Any:
    """The mode a ``keras.RematScope`` gives the layers made inside it (Keras' ``RematMode``,
    which each layer keeps from its construction)."""
    from keras.src.backend.common.remat import get_current_remat_mode

    with scope:
        return get_current_remat_mode()


@contextlib.contextmanager
def remat_mode_held(layer: keras.layers.Layer, mode: Any) -> Iterator[None]:
    """``layer`` holds the rematerialisation ``mode`` while the block runs (what it would hold
    had it been made inside the ``RematScope``), so its ``rematerialized_call`` chooses."""
    saved = layer._remat_mode
    layer._remat_mode = mode
    try:
        yield
    finally:
        layer._remat_mode = saved
