"""What a job tells the tracker, the same from a live run and from a finished run directory
(``hvdtrain track``): its name, its resolved config as params (one per option, by its YAML name,
valued as ``config.yaml`` writes it), its world as tags, and rank 0's final files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hvdtrain import __version__

# Rank 0's final files sent at the end, those of them the run left (the model is one of two).
FINAL_FILES = ("curves.png", "summary.json", "model.keras", "model.weights.h5")


@dataclass(frozen=True)
class JobFacts:
    """A job as the tracker records it: the run's name, params and tags."""

    name: str
    params: dict[str, str]
    tags: dict[str, str]


def param_text(value: Any) -> str:
    """An option's value as a param: strings as they are, the rest as JSON (true, null, [4, 2])."""
    return value if isinstance(value, str) else json.dumps(value)


def job_facts(run_dir: Path, config: dict[str, dict[str, Any]], ranks: int, nodes: int,
              backend: str, device: str) -> JobFacts:
    """``config``: the resolved config by section (``Config.to_dict``, or ``config.yaml``); a
    world fact not known (0 or empty: a run directory whose job has not ended) is left out, so
    it never replaces a live job's tag."""
    params = {name: param_text(value) for section in config.values()
              for name, value in section.items()}
    world = {"hvdtrain.ranks": ranks, "hvdtrain.nodes": nodes, "hvdtrain.backend": backend,
             "hvdtrain.device": device}
    tags = {"hvdtrain.version": __version__, "hvdtrain.run_dir": str(run_dir.resolve()),
            **{name: str(value) for name, value in world.items() if value}}
    return JobFacts(run_dir.name, params, tags)


def final_files(run_dir: Path) -> list[Path]:
    return [run_dir / name for name in FINAL_FILES if (run_dir / name).is_file()]
