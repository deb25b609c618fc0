"""``hvdtrain evaluate RUN_DIR`` and ``hvdtrain predict RUN_DIR --input FILE``.

Both load the run's final ``model.keras`` in Keras safe mode (no code stored in the file runs)
and its ``config.yaml``. A model the user compiled comes back with its loss and metrics, which
``evaluate`` reports; an uncompiled one gets hvdtrain's default objective. ``evaluate`` is exact
and distributed: launched on N ranks it shards the evaluation set and sums the metrics' state
across ranks, like validation in training. ``predict`` is a quick single-process check on a few
inputs: class ids for a classifier, values for anything else, one block per output.
"""

from __future__ import annotations

from typing import Any

import argparse
import json
import zipfile
from pathlib import Path

import numpy as np

from hvdtrain.config import ConfigError, build_config
from hvdtrain.errors import UserError
from hvdtrain.options import load_yaml


def load_run(run_dir: Path):
    """(config, model) of a finished run."""
    import keras

    if not (run_dir / "model.keras").is_file():
        raise UserError(f"{run_dir} has no model.keras; give the directory of a finished run")
    try:
        config = build_config(load_yaml(run_dir / "config.yaml"))
    except ConfigError as error:
        raise UserError(f"{run_dir}/config.yaml is unusable ({error})") from error
    try:
        model = keras.saving.load_model(run_dir / "model.keras", safe_mode=True)
    except Exception as error:  # noqa: BLE001 - any load failure is a bad or foreign file
        raise UserError(f"{run_dir}/model.keras cannot be loaded safely ({error})") from error
    return config, model


def _arrays_from(path: Path) -> dict[str, np.ndarray]:
    try:
        if path.suffix == ".npy":
            return {"x": np.load(path, allow_pickle=False)}
        with np.load(path, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise UserError(f"{path} is not a readable .npz or .npy file ({error})") from error


def _check_output_dir(output: Path | None) -> None:
    """Fail before the work, not after it, when a result could not be written."""
    if output is not None and not output.parent.is_dir():
        raise UserError(f"--output {output}: directory {output.parent} does not exist; "
                        "create it or choose another path")


def evaluate(args: argparse.Namespace) -> int:
    from hvdtrain.checkpoints.store import atomic_write_text
    from hvdtrain.data.pipeline import ShardSpec, real_rows_only
    from hvdtrain.data.arrays import targets_array
    from hvdtrain.data.contract import ArraySplit
    from hvdtrain.data.load import load_source
    from hvdtrain.models import check_input_shape
    from hvdtrain.training.step.objective import build_for_training
    from hvdtrain.training.process_state import seed_alike
    from hvdtrain.training.step.core import Evaluation
    from hvdtrain.collectives import init_collectives, place_devices

    _check_output_dir(args.output)
    collectives = init_collectives(prepare=place_devices)
    world = collectives.world
    config, model = load_run(args.run_dir)
    if args.data_path:
        arrays = _arrays_from(args.data_path)
        if "x" not in arrays or "y" not in arrays:
            raise UserError(f"{args.data_path} needs arrays 'x' and 'y' to evaluate on")
        split = ArraySplit(arrays["x"].astype(np.float32), targets_array(arrays["y"]))
        check_input_shape(model, str(args.run_dir), split.input_shape)
        where = str(args.data_path)
    else:
        seed_alike(config.train.seed)       # a data function builds alike on every rank
        split = load_source(config.data, config.train.seed).val
        where = f"the {config.data.dataset} validation split"
    # A user's dataset (its size unknown) is evaluated as each rank's own share, unpadded: an
    # evaluation holds no collective per step, and every example is read once.
    spec = ShardSpec(split.num_examples or 0, world, config.train.batch_size, "pad", False,
                     equal_steps=split.normalised)
    check = getattr(split, "check_order", None)
    if check is not None:
        check("validation", collectives.allgather_object)
    build_for_training(model, next(iter(split.dataset(spec))), str(args.run_dir))
    evaluation = Evaluation(model, collectives, xla=bool(model.jit_compile))
    metrics = evaluation.run(real_rows_only(split.dataset(spec), spec), prefix="")
    if world.is_chief:
        shown = "  ".join(f"{name} {value:.4f}" for name, value in metrics.items())
        print(f"{shown}  on {split.num_examples} examples of {where} ({world.size} rank(s))",
              flush=True)
        if args.output:
            report = {"examples": split.num_examples, "ranks": world.size, "data": where,
                      **metrics}
            atomic_write_text(args.output, json.dumps(report, indent=2) + "\n")
            print(f"wrote the metrics to {args.output}", flush=True)
    return 0


def predict(args: argparse.Namespace) -> int:
    from hvdtrain.models import check_input_shape

    _check_output_dir(args.output)
    _, model = load_run(args.run_dir)
    x = _arrays_from(args.input).get("x")
    if x is None:
        raise UserError(f"{args.input} has no array 'x' to predict on")
    check_input_shape(model, str(args.run_dir), tuple(x.shape[1:]))
    names = list(getattr(model, "output_names", None) or ["output_0"])
    predicted = model.predict(x.astype(np.float32), verbose=0)
    outputs = ([predicted[name] for name in names] if isinstance(predicted, dict)
               else list(predicted) if isinstance(predicted, (list, tuple)) else [predicted])
    for name, loss, values in zip(names, output_losses(model, names), outputs):
        if len(outputs) > 1:
            print(f"output {name}:")
        classes = is_class_output(loss, values)
        for index in range(min(len(x), args.show)):
            if classes:
                best = int(values[index].argmax())
                print(f"{index}: class {best} (p={values[index, best]:.3f})")
            else:
                print(f"{index}: {np.array2string(np.asarray(values[index]), precision=4)}")
    if args.output:
        if len(outputs) == 1:
            np.save(args.output, outputs[0])
        else:
            np.savez(args.output, **dict(zip(names, outputs)))
        print(f"wrote the outputs for {len(x)} examples to {args.output}")
    return 0


# Compiled losses whose output is a distribution over classes (its argmax is the class).
DISTRIBUTION_LOSSES = ("categorical_crossentropy", "sparse_categorical_crossentropy",
                       "categorical_focal_crossentropy", "kl_divergence")


def output_losses(model: Any, names: list[str]) -> list[Any]:
    """The loss each output was compiled with (None: none or not compiled)."""
    from hvdtrain.keras_internals import compile_arguments

    loss = compile_arguments(model).get("loss")
    if isinstance(loss, dict):
        return [loss.get(name) for name in names]
    if isinstance(loss, (list, tuple)):
        return list(loss) + [None] * (len(names) - len(loss))
    return [loss] * len(names)


def is_class_output(loss: Any, values: np.ndarray) -> bool:
    """True for an output trained as a distribution over classes (its argmax is the class)."""
    import keras

    if loss is None or values.ndim != 2 or values.shape[1] < 2:
        return False
    resolved = keras.losses.get(loss) if isinstance(loss, str) else loss
    function = getattr(resolved, "fn", resolved)
    config = resolved.get_config() if hasattr(resolved, "get_config") else {}
    return (getattr(function, "__name__", None) in DISTRIBUTION_LOSSES
            or config.get("name") in DISTRIBUTION_LOSSES)


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="directory of a finished run")
    parser.add_argument("--data-path", type=Path,
                        help=".npz with x and y to evaluate on (default: the run's validation "
                             "split)")
    parser.add_argument("--output", type=Path,
                        help="also write the metrics as JSON to this file (rank 0; the stdout "
                             "of several ranks can interleave under horovodrun)")


def add_predict_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, help="directory of a finished run")
    parser.add_argument("--input", type=Path, required=True, help=".npz with x, or a .npy")
    parser.add_argument("--show", type=int, default=10, help="predictions to print")
    parser.add_argument("--output", type=Path,
                        help="save all outputs: a .npy (one output) or .npz (one array per "
                             "output)")
