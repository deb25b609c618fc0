"""The convergence study's own logic, without training: its variants' flags, its reading of a
run's metrics and its summary of the seeds. Its real runs are the bench README's command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hvdtrain.bench import convergence


def test_variants_name_a_compression_or_powersgd_at_a_rank():
    assert convergence.variant_flags("bf16") == ["--compression", "bf16"]
    assert convergence.variant_flags("powersgd-r4") == ["--compression", "powersgd",
                                                        "--powersgd-rank", "4"]
    for wrong in ("fp32", "fp16-r2", "powersgd-rx"):
        with pytest.raises(argparse.ArgumentTypeError, match="choose from none, fp16"):
            convergence.variant_flags(wrong)


def run(directory: Path, losses: list[float], accuracies: list[float]) -> Path:
    directory.mkdir()
    (directory / "metrics.jsonl").write_text("".join(
        json.dumps({"epoch": epoch, "loss": loss, "accuracy": accuracy, "val_loss": loss,
                    "val_accuracy": accuracy, "lr": 0.1}) + "\n"
        for epoch, (loss, accuracy) in enumerate(zip(losses, accuracies), 1)))
    return directory


def test_the_summary_bands_the_seeds_and_compares_finals_with_float32(tmp_path):
    curves = {"none": {1: convergence.read_curves(run(tmp_path / "a", [1.0, 0.5], [0.5, 0.9])),
                       2: convergence.read_curves(run(tmp_path / "b", [0.8, 0.3], [0.6, 0.95]))},
              "powersgd": {1: convergence.read_curves(run(tmp_path / "c", [1.0, 0.6],
                                                          [0.4, 0.91]))}}
    summary = convergence.summarize(curves)
    assert summary["none"]["epochs"] == [1, 2]
    assert summary["none"]["bands"]["loss"] == {"mean": [0.9, 0.4], "min": [0.8, 0.3],
                                                "max": [1.0, 0.5]}
    final = summary["powersgd"]["final"]["val_accuracy"]
    assert final["per_seed"] == {1: 0.91}
    assert final["points_vs_float32"] == pytest.approx(100 * (0.91 - 0.925))
