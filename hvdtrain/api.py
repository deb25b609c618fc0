"""The Python API: ``hvdtrain.fit(model, x, y, ...)``, Keras' ``model.fit`` run data-parallel.

It takes what ``model.fit`` takes and does what one process would, on every rank of a job
started by horovodrun, mpirun or srun, or alone in one process, with hvdtrain's options as
keywords by their YAML names (``run_dir=...``, ``lr_scaling="none"``); ``hvdtrain.init`` joins
the job first where a script needs the rank before ``fit``. It builds the same run as the
command line, so both behave alike; the README's "Your model and data" is its guide.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from hvdtrain.config import PYTHON_OBJECT, ConfigError, build_config
from hvdtrain.options import flatten_options


def _model_factory(model: Any, precision: str) -> Callable[[Any, Any], Any] | None:
    """A factory for the run, or None when ``model`` names a model option."""
    import keras

    if isinstance(model, str):
        return None
    if isinstance(model, keras.Model):
        if precision != "float32":
            raise ConfigError(f"precision={precision!r} builds the model under that policy; "
                              "pass a function that builds the model instead of a model")
        return lambda input_shape, num_classes: model
    if callable(model):
        takes_shape = len(inspect.signature(model).parameters) >= 2
        return lambda input_shape, num_classes: (model(input_shape, num_classes) if takes_shape
                                                 else model())
    raise ConfigError(f"model must be a keras.Model, a function that builds one or a model "
                      f"name, not {type(model).__name__}")


def init(backend: str = "auto", threads: int | None = None) -> Any:
    """Join the job's collectives now, before the script builds a model or any tensor: the
    TensorFlow backend (``backend="tensorflow"``, or auto without Horovod) turns TensorFlow's
    runtime into a cluster, which must happen before anything else uses it. Returns this
    rank's ``World`` (rank, size, local rank...). ``hvdtrain.fit`` calls it itself, so a script
    that builds its model inside a function passed to ``fit`` need not."""
    from hvdtrain.config import build_config
    from hvdtrain.collectives import init_collectives, place_devices

    chosen = build_config({"backend": backend}).train.backend   # checked like the option
    return init_collectives(chosen, lambda world: place_devices(world, threads)).world


def fit(model: Any, x: Any = "digits", y: Any = None, *, batch_size: int | None = None,
        epochs: int | None = None, verbose: int | str = "auto",
        callbacks: Sequence[Any] = (), validation_split: float | None = None,
        validation_data: Any = None, shuffle: bool | None = None,
        class_weight: dict | None = None, sample_weight: Any = None,
        initial_epoch: int | None = None, steps_per_epoch: int | None = None,
        validation_steps: int | None = None, validation_batch_size: int | None = None,
        validation_freq: int | list[int] = 1, **options: Any):
    """Train ``model`` data-parallel as ``model.fit`` would in one process; return a
    ``RunResult`` (run directory, exact global metrics, Keras ``History`` with the keys one
    process's would have, weight fingerprints of every rank, the trained model, the run's own
    per-epoch columns) on every rank. See the module doc."""
    from hvdtrain.data.user import KerasData, user_bundle
    from hvdtrain.training.loops.run_callbacks import KerasConsole
    from hvdtrain.training.run import Run

    overrides = flatten_options(options, "hvdtrain.fit")
    given = {"batch_size": batch_size, "epochs": epochs, "initial_epoch": initial_epoch,
             "steps_per_epoch": steps_per_epoch, "shuffle": shuffle,
             "validation_split": validation_split}
    overrides.update({name: value for name, value in given.items() if value is not None})
    if verbose == "auto":     # Keras' 1; progress=False, hvdtrain's option, means 0
        verbose = 1 if overrides.get("progress", True) else 0
    if verbose not in (0, 1, 2):
        raise ConfigError(f"verbose={verbose!r}: Keras' verbose is 'auto', 0, 1 or 2")
    overrides.setdefault("progress", verbose != 0)
    if validation_batch_size is not None and validation_batch_size != (batch_size or 0):
        raise ConfigError("validation_batch_size: hvdtrain validates in batches of batch_size "
                          "per rank (evaluation is exact whatever the batch); drop it")
    overrides["model"] = model if isinstance(model, str) else PYTHON_OBJECT
    overrides["dataset"] = x if isinstance(x, str) else PYTHON_OBJECT
    data = KerasData(x, y, sample_weight, class_weight, validation_data, validation_split,
                     validation_steps)

    def data_factory(data_config: Any, seed: int) -> Any:
        return user_bundle(data, data_config, seed)

    if isinstance(validation_freq, int):
        overrides["validation_freq"] = validation_freq
    config = build_config(overrides)
    factory = _model_factory(model, config.train.precision)
    label = None if isinstance(model, str) else getattr(model, "__name__", type(model).__name__)
    return Run(config, factory, None if isinstance(x, str) else data_factory,
               [*callbacks, KerasConsole(verbose)], label, validation_freq).execute()
