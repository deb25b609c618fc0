"""A PNG of the training curves, one panel per metric, from a run's ``metrics.jsonl``.

Every metric the run reported gets a panel (training and validation values together), whatever
the model was compiled with, then the learning rate and the throughput.
"""

from __future__ import annotations

import json
from pathlib import Path

RUN_PANELS = (("lr", "learning rate", "rate"),
              ("examples_per_second", "examples / second", "all ranks"))
NOT_METRICS = {"epoch", "world_size", *(name for name, _, _ in RUN_PANELS)}


def panels(columns: list[str]) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, [(column, legend label)]) for each panel, metrics first (loss leading)."""
    metrics = []
    for column in columns:
        base = column[4:] if column.startswith("val_") else column
        if column not in NOT_METRICS and base not in metrics:
            metrics.append(base)
    metrics.sort(key=lambda name: (name != "loss", columns.index(name) if name in columns
                                   else columns.index("val_" + name)))
    found = [(name, [(column, label) for column, label in
                     ((name, "training"), ("val_" + name, "validation")) if column in columns])
             for name in metrics]
    found += [(title, [(column, label)]) for column, title, label in RUN_PANELS
              if column in columns]
    return found


def plot_curves(metrics_file: Path, output: Path) -> Path:
    """Draw every metric present in ``metrics_file`` against the epoch; write ``output``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    shown = panels(list(rows[0])) if rows else []
    count = max(1, len(shown))
    figure, axes = plt.subplots(1, count, figsize=(4.5 * count, 3.6), squeeze=False)
    epochs = [row["epoch"] for row in rows]
    for axis, (title, series) in zip(axes[0], shown):
        for column, label in series:
            axis.plot(epochs, [row.get(column) for row in rows], marker="o", markersize=3,
                      label=label)
        axis.set_title(title)
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return output
