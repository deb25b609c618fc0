"""The Python API: ``hvdtrain.fit(model, data, **options)`` for scripts and notebooks.

It runs the same ``Run`` as the command line, with the same options and defaults (every option
of ``hvdtrain --help``, by its YAML name: ``epochs=5``, ``batch_size=64``, ``run_dir=...``), on
every rank of a job started by horovodrun, mpirun or srun, or alone in one process.

    import hvdtrain
    result = hvdtrain.fit(build_model, hvdtrain.Arrays(x, y), epochs=5, optimizer="adam")
    result.metrics["val_loss"], result.run_dir

``model``: a ``keras.Model`` (each rank builds its own; rank 0's weights are broadcast), a
function ``(input_shape, num_classes) -> keras.Model`` or ``() -> keras.Model`` (needed for
mixed precision, which builds under the policy), or a model option string (``"mlp"``,
``"package.module:build_fn"``). A compiled model brings its loss and metrics.
``data``: ``hvdtrain.Arrays``, ``(x, y)``, ``hvdtrain.Pipeline``, or a dataset option string
(``"digits"``, ``"package.module:fn"``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

from hvdtrain.config import PYTHON_OBJECT, ConfigError, build_config, flatten_options


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


def fit(model: Any, data: Any = "digits", *,
        callbacks: Sequence[Any] = (), **options: Any):
    """Train ``model`` on ``data`` data-parallel; return a ``RunResult`` (run directory, exact
    global metrics, weight fingerprints of every rank, the trained model) on every rank."""
    from hvdtrain.data.user import user_bundle
    from hvdtrain.training.run import Run

    overrides = flatten_options(options, "hvdtrain.fit")
    overrides["model"] = model if isinstance(model, str) else PYTHON_OBJECT

    def data_factory(data_config: Any, seed: int) -> Any:
        return user_bundle(data, data_config, seed)

    overrides["dataset"] = data if isinstance(data, str) else PYTHON_OBJECT
    config = build_config(overrides)
    factory = _model_factory(model, config.train.precision)
    return Run(config, factory, None if isinstance(data, str) else data_factory,
               callbacks).execute()
