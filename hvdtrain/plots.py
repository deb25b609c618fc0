"""A PNG of the training curves, one panel per metric, from a run's ``metrics.jsonl``."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    ("loss", "cross-entropy loss", ("loss", "val_loss")),
    ("accuracy", "accuracy", ("accuracy", "val_accuracy")),
    ("learning rate", "learning rate", ("lr",)),
    ("throughput", "examples / second", ("examples_per_second",)),
)
LABELS = {"loss": "training", "val_loss": "validation", "accuracy": "training",
          "val_accuracy": "validation", "lr": "rate", "examples_per_second": "all ranks"}


def plot_curves(metrics_file: Path, output: Path) -> Path:
    """Draw every metric present in ``metrics_file`` against the epoch; write ``output``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    panels = [p for p in PANELS if any(key in rows[0] for key in p[2])] if rows else []
    figure, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.5 * max(1, len(panels)), 3.6),
                                squeeze=False)
    epochs = [row["epoch"] for row in rows]
    for axis, (title, ylabel, keys) in zip(axes[0], panels):
        for key in keys:
            if key in rows[0]:
                axis.plot(epochs, [row[key] for row in rows], marker="o", markersize=3,
                          label=LABELS[key])
        axis.set_title(title)
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel(ylabel)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return output
