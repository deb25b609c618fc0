"""Run configuration: typed sections and their defaults, validated once.

The dataclasses below are the single source of truth: the CLI flags (``--batch-size``), the YAML
schema (``train: {batch_size: 32}``), the help text, and the validation errors all come from the
fields and their metadata. Field names are unique across sections so a flag names one field.
How options reach a ``Config`` (defaults < YAML file < command-line flags) and the options
table (``hvdtrain/README.md``) are in ``hvdtrain.options``.

Over 450 lines: two thirds of it are the option fields, whose help texts are the flags' help
and the options table; one module keeps them the one place a default is written, beside the
checks of their values.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from hvdtrain.builtin_names import DATASETS, GRADIENT_COMPRESSIONS, MODELS
from hvdtrain.errors import UserError
from hvdtrain.log import LEVELS
from hvdtrain.plugins import PLUGIN


class ConfigError(UserError):
    """A user mistake in the configuration; its message is one line naming the fix."""


def option(default: Any, help: str, *, choices: tuple[str, ...] = (),
           minimum: float | None = None, maximum: float | None = None,
           exclusive_minimum: bool = False, plugin: bool = False,
           bare: str | None = None) -> Any:
    """A config field with the metadata the CLI, the docs and the validation are made from.
    ``plugin``: besides ``choices``, a user's ``package.module:function`` is accepted.
    ``bare``: for a choice field, the value of the flag given without one (``--resume`` means
    ``--resume required``); YAML's true and false then mean ``bare`` and the default."""
    meta = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum,
            "exclusive_minimum": exclusive_minimum, "plugin": plugin, "bare": bare,
            "default": default}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# The model or dataset of a run whose model or data was handed to ``hvdtrain.fit`` as an object.
PYTHON_OBJECT = "python"
# The rate of the optimizer hvdtrain builds (sgd for an uncompiled model) when none is given.
DEFAULT_LEARNING_RATE = 0.05
# The gradient bucket size (MiB): see hvdtrain/bench/README.md, "Gradient buckets".
BUCKET_MIB = 4.0


def bucket_bytes(mib: float) -> int:
    """A ``--bucket-mib`` value in bytes (0: one group)."""
    return round(mib * 2**20)


# --powersgd-rank's default: see hvdtrain/bench/README.md, "PowerSGD".
POWERSGD_RANK = 2


# Keras 3's optimizers by the names keras.optimizers.get accepts.
KERAS_OPTIMIZERS = ("sgd", "adam", "adamw", "rmsprop", "adagrad", "adadelta", "adamax",
                    "adafactor", "nadam", "ftrl", "lion", "lamb")


@dataclass
class DataConfig:
    dataset: str = option("digits", "data source: a built-in, or package.module:fn returning "
                                    "arrays, a tf.data.Dataset or keras PyDataset, "
                                    "hvdtrain.Arrays or hvdtrain.Pipeline ('python': data "
                                    "handed to hvdtrain.fit)",
                          choices=DATASETS, plugin=True)
    data_path: str | None = option(None, "npz: a .npz file with x and y (optionally x_val, "
                                         "y_val); tfrecord, csv: a glob of training files")
    val_data_path: str | None = option(None, "tfrecord, csv: a glob of validation files")
    data_dir: str | None = option(None, "mnist, fashion_mnist, cifar10: a directory holding the "
                                        "standard files, for nodes without internet")
    feature_key: str = option("image", "tfrecord: name of the feature")
    feature_shape: list[int] = option([], "tfrecord: shape of one example (from the converter's "
                                          "metadata when empty)", minimum=1)
    feature_encoding: str = option("raw", "tfrecord: how the feature is stored: raw (uint8 "
                                          "bytes), float (float list), png or jpeg",
                                   choices=("raw", "float", "png", "jpeg"))
    label_key: str = option("label", "tfrecord: name of the label (target) feature")
    label_dtype: str = option("int64", "tfrecord: type of the label feature: int64 (class ids) "
                                       "or float32 (regression or multi-label targets)",
                              choices=("int64", "float32"))
    label_shape: list[int] = option([], "tfrecord: shape of one label (empty: a scalar)",
                                    minimum=1)
    label_column: str = option("label", "csv: name of the label column (integers: class ids; "
                                        "any other number: a regression target)")
    num_classes: int | None = option(None, "classes, for tfrecord or csv without converter "
                                           "metadata (default: from the metadata or the labels)",
                                     minimum=2)
    shuffle_buffer: int = option(4096, "tfrecord, csv: records shuffled together (seeded, "
                                       "changes each epoch)", minimum=1)
    cache: bool = option(False, "tfrecord, csv: cache parsed records in memory after epoch 1")
    validation_split: float = option(0.2, "fraction held out for validation when the source "
                                          "has no split of its own", minimum=0.0, maximum=0.9)
    shuffle: bool = option(True, "shuffle the training examples every epoch (in-memory and "
                                 "file data; a user's dataset object shuffles itself)")
    remainder: str = option("auto", "last partial global batch each epoch: pad (every example "
                                    "once: spread over the ranks, a rank with none of it "
                                    "repeating real examples at weight zero), drop (skip it), "
                                    "or auto (pad; drop for a model's own train_step on a "
                                    "dataset whose ranks count their own batches, or under "
                                    "--zero-stage or Adasum)",
                            choices=("auto", "pad", "drop"))
    synthetic_examples: int = option(2048, "examples in the synthetic dataset", minimum=1)
    synthetic_shape: list[int] = option([32], "shape of one synthetic example", minimum=1)
    synthetic_classes: int = option(10, "classes in the synthetic dataset", minimum=2)


# Keras' rematerialisation modes (keras.RematScope), and none.
REMAT_MODES = ("none", "full", "activations", "larger_than", "list_of_layers")


@dataclass
class ModelConfig:
    model: str = option("mlp", "built-in model or a user's package.module:build_fn "
                               "(which may return a compiled model: its loss and metrics are "
                               "used; 'python': a model handed to hvdtrain.fit)",
                        choices=MODELS, plugin=True)
    hidden_units: list[int] = option([256, 128], "hidden layer widths of the mlp", minimum=1)
    weight_decay: float = option(0.0, "L2 penalty on kernel weights", minimum=0.0)
    resnet_blocks: int = option(3, "residual blocks per stage of the resnet (3: ResNet-20)",
                                minimum=1)
    remat: str = option("none", "Keras' rematerialisation for the run: recompute in the "
                                "backward pass, instead of keeping, what 'full': every layer, "
                                "'activations': each activation function, 'larger_than': each "
                                "layer whose output has over --remat-threshold elements, "
                                "'list_of_layers': each layer --remat-layers names, computes",
                        choices=REMAT_MODES)
    remat_threshold: int = option(1024, "--remat larger_than: the output size (elements per "
                                        "example batch, as Keras counts) above which a layer "
                                        "recomputes", minimum=1)
    remat_layers: list[str] = option([], "--remat list_of_layers: the layers' names")


@dataclass
class OptimConfig:
    optimizer: str = option("auto", "auto (the optimizer the model was compiled with, else "
                                    "sgd), a Keras optimizer by name, or package.module:fn "
                                    "taking the base learning rate",
                            choices=("auto", *KERAS_OPTIMIZERS), plugin=True)
    learning_rate: float | None = option(None, "learning rate for one rank at --batch-size; "
                                               "scaled by world size (default: the compiled "
                                               f"optimizer's own, else {DEFAULT_LEARNING_RATE})",
                                         minimum=0.0, exclusive_minimum=True)
    momentum: float = option(0.9, "momentum of sgd and rmsprop built by hvdtrain (0 for none)",
                             minimum=0.0, maximum=0.999)
    lr_scaling: str = option("linear", "learning-rate scaling with world size",
                             choices=("linear", "sqrt", "none"))
    warmup_epochs: float = option(2.0, "epochs of linear warmup from the unscaled rate to the "
                                       "scaled one (Goyal et al., 2017)", minimum=0.0)
    lr_schedule: str = option("constant", "rate after warmup: constant, cosine (to 0 at the "
                                          "last epoch), step (x factor every --lr-decay-epochs) "
                                          "or plateau (x factor when val_loss stalls)",
                              choices=("constant", "cosine", "step", "plateau"))
    lr_decay_epochs: float = option(10.0, "epochs between step decays", minimum=0.0,
                                    exclusive_minimum=True)
    lr_decay_factor: float = option(0.1, "multiplier of a step or plateau decay", minimum=0.0,
                                    maximum=1.0, exclusive_minimum=True)
    plateau_patience: int = option(3, "epochs without val_loss improvement before a plateau "
                                      "decay", minimum=1)
    reduction: str = option("mean", "how gradients combine across ranks: mean (ring-allreduce "
                                    "of the global-batch mean) or adasum",
                            choices=("mean", "adasum"))
    compression: str = option("none", "gradients on the wire: none (float32), fp16 (float16: "
                                      "half the bytes, 11-bit mantissa, overflows past 65504), "
                                      "bf16 (bfloat16: half the bytes, float32's range, 8-bit "
                                      "mantissa) or powersgd (a low-rank approximation with "
                                      "error feedback, --powersgd-rank); all approximate",
                              choices=GRADIENT_COMPRESSIONS)
    powersgd_rank: int = option(POWERSGD_RANK, "--compression powersgd: the rank of each "
                                               "compressed gradient's approximation (higher: "
                                               "closer to the exact mean, more bytes)",
                                minimum=1)
    bucket_mib: float = option(BUCKET_MIB, "gradients travel in buckets of about this many MiB, "
                                           "the last layers' first, each sent as soon as the "
                                           "backward pass has computed it (0: one allreduce "
                                           "after the whole backward pass)", minimum=0.0)
    bucket_order: str = option("ready", "when each bucket's allreduce is submitted: ready (as "
                                        "soon as its own gradients exist) or issued (once the "
                                        "bucket before it has completed, so every rank submits "
                                        "them in one order; the TensorFlow backend always "
                                        "submits so)",
                               choices=("ready", "issued"))
    bucket_choice: str = option("measured", "measured: the first steps time --bucket-mib buckets "
                                            "against one allreduce after the backward pass "
                                            "and keep the faster (the same sums, with "
                                            "3+ ranks up to rounding); fixed: --bucket-mib "
                                            "throughout",
                                choices=("measured", "fixed"))
    accumulation_steps: int = option(1, "local steps whose gradients are accumulated before one "
                                        "allreduce and update", minimum=1)
    zero_stage: int = option(0, "ZeRO: 1 keeps on each rank the optimizer state for 1/ranks of "
                                "every variable (gradients reduce-scattered, updated pieces "
                                "all-gathered); 2 also keeps only 1/ranks of the gradients "
                                "summed across --accumulation-steps; 3 also keeps only "
                                "1/ranks of every weight, each layer gathering its whole "
                                "weights inside its call; 0: every rank holds all",
                             minimum=0, maximum=3)

    @property
    def bucket_bytes(self) -> int:
        return bucket_bytes(self.bucket_mib)


@dataclass
class TrainConfig:
    epochs: int = option(20, "epochs to train (the index of the last epoch, as in Keras)",
                         minimum=1)
    initial_epoch: int = option(0, "the epoch to start at (Keras' initial_epoch; a resumed run "
                                   "starts where its checkpoint is)", minimum=0)
    steps_per_epoch: int | None = option(None, "steps per epoch, read as Keras reads it: the data "
                                               "is one stream across epochs and an epoch ends "
                                               "early where a pass ends (default: one pass; "
                                               "required for a dataset that repeats forever)",
                                         minimum=1)
    validation_freq: int = option(1, "validate after every N-th epoch (Keras' "
                                     "validation_freq)", minimum=1)
    batch_size: int = option(32, "examples per rank per step (global batch = this x ranks)",
                             minimum=1)
    loop: str = option("fit", "training path: Keras fit or a custom tf.function loop",
                       choices=("fit", "custom"))
    seed: int = option(42, "seed for weights, shuffling and splits", minimum=0)
    precision: str = option("float32", "compute precision; weights stay float32",
                            choices=("float32", "mixed_float16", "mixed_bfloat16"))
    sync_batch_norm: bool = option(False, "normalise every BatchNormalization layer by the "
                                          "global batch's statistics, summed across ranks "
                                          "each step (as synchronized=True in a layer does); "
                                          "otherwise a layer without it uses its rank's rows")
    tensorboard: bool = option(True, "write TensorBoard event files (rank 0)")
    run_dir: str | None = option(None, "run directory (default: runs/<model>-<dataset>-<time>)")
    resume: str = option("never", "continue from the newest checkpoint in --run-dir: never (a "
                                  "new run), required (--resume alone: fail without a "
                                  "checkpoint) or auto (continue if there is one, else start; "
                                  "for requeued jobs)", choices=("never", "required", "auto"),
                         bare="required")
    accept_changes: bool = option(False, "with --resume: continue a run whose data, "
                                         "optimizer or settings (learning rate, schedule, "
                                         "update batch: ranks x batch size x accumulation "
                                         "steps, ...) differ from its checkpoint's; its "
                                         "model must still match")
    checkpoint_every_steps: int = option(0, "also checkpoint every N steps within an epoch (0: "
                                            "at epoch ends only); a stop loses at most N steps",
                                         minimum=0)
    keep_checkpoints: int = option(3, "checkpoints kept on disk (newest first)", minimum=1)
    deterministic: bool = option(False, "enable TensorFlow op determinism (slower)")
    threads: int | None = option(None, "CPU threads per rank (default: TF_NUM_INTRAOP_THREADS "
                                       "where set, else cores / local ranks)",
                                 minimum=1)
    backend: str = option("auto", "the collectives: horovod, tensorflow (TensorFlow's own "
                                  "collective ops, no Horovod; launch with mpirun or srun) or "
                                  "auto (Horovod where it is installed and loads; the "
                                  "environment's HVDTRAIN_BACKEND when set)",
                          choices=("auto", "horovod", "tensorflow"))
    elastic: bool = option(False, "elastic training: ranks may leave and join (launch with "
                                  "horovodrun --min-np/--max-np/--host-discovery-script)")
    commit_every: int = option(10, "elastic: steps between state commits (the most work a "
                                   "lost rank can cost)", minimum=1)
    stall_timeout: float | None = option(None, "seconds without a finished training step "
                                               "after which a rank ends the job (exit 76) "
                                               "instead of hanging in a collective when a node "
                                               "or the network is lost (default: the larger of "
                                               "30 and 20 x the slowest step so far; 0: off)",
                                         minimum=0.0)
    callbacks: list[str] = option([], "package.module:fn returning a list of Keras callbacks, "
                                      "run on every rank after hvdtrain's metrics, validation "
                                      "and rate, before rank 0's checkpoint and files",
                                  plugin=True)
    autotune: bool = option(False, "instead of training, time a few updates of this model on "
                                   "these ranks at other gradient bucket sizes and Horovod cycle "
                                   "times, and report the fastest as flags (nothing is saved but "
                                   "autotune.json)")
    progress: bool = option(True, "show a progress bar on rank 0")
    log_level: str = option("INFO", "level of hvdtrain's lines (the Python logger "
                                    "'hvdtrain'): INFO shows rank 0's, WARNING only problems "
                                    "(every rank's), DEBUG every rank's lines; the progress bar "
                                    "and one-line errors do not depend on it",
                            choices=LEVELS)
    debug: bool = option(False, "show full tracebacks for errors")


@dataclass
class TrackingConfig:
    tracking: str = option("none", "experiment tracking: mlflow (rank 0 sends the job to one "
                                   "MLflow run; pip install 'hvdtrain[mlflow]'), auto (mlflow "
                                   "where a server is named; not --elastic) or none",
                           choices=("none", "mlflow", "auto"))
    tracking_uri: str | None = option(None, "the MLflow tracking server, http://HOST:PORT "
                                            "(default: MLflow's MLFLOW_TRACKING_URI; one of "
                                            "them is needed)")
    experiment: str | None = option(None, "MLflow experiment of the run (default: MLflow's "
                                          "MLFLOW_EXPERIMENT_NAME, else its Default)")
    track_every_steps: int = option(0, "also send the global-batch loss every N training steps "
                                       "(metric step_loss; 0: epochs only)", minimum=0)


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "tracking": TrackingConfig,
}


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def field_index() -> dict[str, tuple[str, dataclasses.Field]]:
    """Every field name -> (section, field). Names are unique across sections."""
    index: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.name in index:
                raise AssertionError(f"config field {f.name!r} appears in two sections")
            index[f.name] = (section, f)
    return index


def field_type(section: str, name: str) -> Any:
    """The annotation of field ``name`` of ``section``, resolved."""
    return typing.get_type_hints(SECTIONS[section])[name]


def base_type(tp: Any) -> tuple[type, bool, bool]:
    """(element type, optional?, list?) for the annotations used in this module."""
    args = typing.get_args(tp)
    optional = type(None) in args
    if optional:
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], optional, True
    return tp, optional, False


def did_you_mean(name: str, candidates: list[str]) -> str:
    """"; did you mean 'X'?" for the candidate closest to a mistyped ``name``, else ""."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _coerce(name: str, value: Any, tp: Any, bare: str | None = None,
            default: Any = None) -> Any:
    """Check a YAML value's type (ints are accepted where floats are expected; a choice with a
    bare value takes true/false for that value and the default)."""
    base, optional, is_list = base_type(tp)
    if bare is not None and isinstance(value, bool):
        return bare if value else default
    if value is None:
        if optional:
            return None
        raise ConfigError(f"'{name}' cannot be empty; give a {base.__name__}")
    if is_list:
        items = value if isinstance(value, list) else None
        if items is None:
            raise ConfigError(f"'{name}' must be a list of {base.__name__}, got {value!r}")
        return [_coerce(name, item, base) for item in items]
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    is_bool_as_int = base is int and isinstance(value, bool)
    if not isinstance(value, base) or is_bool_as_int:
        raise ConfigError(f"'{name}' must be a {base.__name__}, got {value!r}")
    return value


def _check_bounds(name: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    values = value if isinstance(value, list) else [value]
    for item in values:
        if item is None:
            continue
        if meta["plugin"] and (item == PYTHON_OBJECT or PLUGIN.fullmatch(str(item))):
            continue
        if meta["choices"] and item not in meta["choices"]:
            alternative = " or package.module:function" if meta["plugin"] else ""
            raise ConfigError(f"'{name}' must be one of {', '.join(meta['choices'])}"
                              f"{alternative}, got {item!r}"
                              f"{did_you_mean(str(item), list(meta['choices']))}")
        if meta["plugin"] and not meta["choices"]:
            raise ConfigError(f"'{name}' must be package.module:function, got {item!r}")
        # Every float option is a rate, a fraction, a factor or seconds: NaN and infinity
        # compare false with any bound, so they would pass the bounds below and fail later.
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"'{name}' must be a finite number, got {item!r}")
        low, high = meta["minimum"], meta["maximum"]
        if low is not None and (item < low or (meta["exclusive_minimum"] and item == low)):
            relation = "greater than" if meta["exclusive_minimum"] else "at least"
            raise ConfigError(f"'{name}' must be {relation} {low:g}, got {item!r}")
        if high is not None and item > high:
            raise ConfigError(f"'{name}' must be at most {high:g}, got {item!r}")


def validate(config: Config) -> Config:
    """Check every field's type and bounds, then every rule that depends on the values alone
    (rules that need the world size, the data or the file system are checked where those are
    known); raise ConfigError naming the first bad one."""
    for name, (section, f) in field_index().items():
        value = getattr(getattr(config, section), name)
        _check_bounds(name, _coerce(name, value, field_type(section, name), f.metadata["bare"],
                                    f.metadata["default"]), f.metadata)
    _check_data_paths(config.data)
    every, accumulation = config.train.checkpoint_every_steps, config.optim.accumulation_steps
    if every % accumulation:
        raise ConfigError(f"--checkpoint-every-steps {every} must be a multiple of "
                          f"--accumulation-steps {accumulation}: checkpoints fall between updates")
    steps = config.train.steps_per_epoch
    if steps and steps % accumulation:
        raise ConfigError(f"--steps-per-epoch {steps} must be a multiple of --accumulation-steps "
                          f"{accumulation}: an epoch would end between updates")
    if config.train.elastic:
        _check_elastic(config)
    if config.optim.zero_stage:
        _check_zero(config)
    if config.train.backend == "tensorflow":
        _check_tensorflow_backend(config)
    if config.optim.compression == "bf16" and config.optim.reduction == "adasum":
        raise ConfigError("--compression bf16 cannot travel with --reduction adasum (Horovod's "
                          "Adasum takes no bfloat16); use --compression fp16 or none")
    if config.optim.compression == "powersgd":
        _check_powersgd(config)
    return config


def _check_powersgd(config: Config) -> None:
    """Where PowerSGD's state (each rank's error buffers, the shared Q's of whole gradients)
    has no meaning: sharded gradients, Adasum, a changing world, skipped loss-scaled steps."""
    if config.optim.zero_stage:
        raise ConfigError("--compression powersgd compresses whole gradients, which ZeRO "
                          "reduce-scatters in pieces; use --zero-stage 0 or another "
                          "--compression")
    if config.optim.reduction == "adasum":
        raise ConfigError("--compression powersgd approximates the ranks' sum, not Adasum's "
                          "combination; use --reduction mean or another --compression")
    if config.train.elastic:
        raise ConfigError("--compression powersgd keeps per-rank error buffers that a world "
                          "change would lose; drop --elastic or use another --compression")
    if config.train.precision == "mixed_float16":
        raise ConfigError("--compression powersgd with --precision mixed_float16: a loss-scaled "
                          "step that overflows would leave non-finite values in the error "
                          "buffers; use --precision mixed_bfloat16 or float32")


def _check_zero(config: Config) -> None:
    """What sharded optimizer state cannot do exactly (yet)."""
    if config.optim.reduction == "adasum":
        raise ConfigError("--zero-stage cannot shard Adasum (it combines whole gradients "
                          "pairwise, not pieces); use --reduction mean or --zero-stage 0")
    if config.train.elastic:
        raise ConfigError("--zero-stage with --elastic is not supported yet (a world change "
                          "would have to re-cut the optimizer state); use --zero-stage 0")
    if config.train.autotune:
        raise ConfigError("--autotune times the unsharded step; drop --zero-stage while tuning "
                          "and pass the flags it finds with it")


def _check_tensorflow_backend(config: Config) -> None:
    """What TensorFlow's collectives cannot do: Horovod's elastic resizing and Adasum."""
    if config.train.elastic:
        raise ConfigError("--elastic needs the Horovod backend (TensorFlow's collectives cannot "
                          "resize a job); use --backend horovod")
    if config.optim.reduction == "adasum":
        raise ConfigError("--reduction adasum needs the Horovod backend; use --backend horovod "
                          "or --reduction mean")


def _check_data_paths(data: DataConfig) -> None:
    """The paths a built-in file source needs (whether they exist is the source's to say)."""
    if data.dataset == "npz" and not data.data_path:
        raise ConfigError("--dataset npz needs --data-path FILE.npz")
    if data.dataset in ("tfrecord", "csv"):
        for flag, pattern in (("--data-path", data.data_path),
                              ("--val-data-path", data.val_data_path)):
            if not pattern:
                raise ConfigError(f"{flag} is not set; give a glob of files, e.g. "
                                  "'data/train-*'")


def _check_elastic(config: Config) -> None:
    """What --elastic cannot combine with: ranks that join later find the run by its
    directory, re-shard an epoch at an offset (in-memory data, one micro-step per update),
    and take only the committed state (no plateau history)."""
    if config.train.autotune:
        raise ConfigError("--autotune times fixed settings on a fixed set of ranks; run it "
                          "without --elastic, then give the elastic run the flags it prints")
    if config.train.checkpoint_every_steps:
        raise ConfigError("--checkpoint-every-steps does not apply to --elastic, which commits "
                          "its state every --commit-every steps")
    if config.train.steps_per_epoch:
        raise ConfigError("--steps-per-epoch does not apply to --elastic, whose epochs are whole "
                          "passes over the data (re-sharded when the world changes); drop it")
    if not config.train.run_dir:
        raise ConfigError("--elastic needs --run-dir: ranks that join later must find the run")
    if config.data.dataset in ("tfrecord", "csv") or config.optim.accumulation_steps != 1:
        raise ConfigError("--elastic supports in-memory datasets without --accumulation-steps")
    if config.optim.lr_schedule == "plateau":
        raise ConfigError("--elastic does not support --lr-schedule plateau (its state would "
                          "not reach joining ranks); use constant, cosine or step")


def build_config(overrides: dict[str, Any]) -> Config:
    """Defaults with flat overrides applied, then validated."""
    config = Config()
    index = field_index()
    for name, value in overrides.items():
        section, f = index[name]
        value = _coerce(name, value, field_type(section, name), f.metadata["bare"],
                        f.metadata["default"])
        setattr(getattr(config, section), name, value)
    return validate(config)
