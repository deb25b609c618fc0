"""Many training runs for the price of one launch: ``train_together`` trains several cases one
after the other in the same ranks (``tests/ranks/train_cases.py``), and each test then reads its
own case's run directory, as ``conftest.train`` would have left it (``NAME.log`` holds every
rank's lines). A launch costs every rank a TensorFlow import, the collectives' start and the
first tracing: 10-20 s on 2 cores, most of a small run's time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from conftest import LAUNCHER, RANK_PYTHONPATH, RUN_TIMEOUT, launch

# Per case, on top of the launch's own RUN_TIMEOUT: a small run takes 5-30 s on 2 cores.
CASE_TIMEOUT = 120


class TrainedCases:
    """The run directories of one job's cases, each checked as it is asked for: a case that
    failed (or never ran, after one that crashed) fails only the tests that read it."""

    def __init__(self, tmp: Path, names: list[str], ranks: int, job_output: str) -> None:
        self.tmp, self.ranks, self.job_output = tmp, ranks, job_output
        self.names = names

    def __getitem__(self, name: str) -> Path:
        assert name in self.names, f"no case {name!r} in this job ({self.names})"
        stem = self.tmp / name
        codes = [(stem.parent / f"{name}.rank{rank}.code") for rank in range(self.ranks)]
        log = stem.with_suffix(".log").read_text()
        assert all(path.exists() for path in codes), (
            f"case {name} did not finish:\n{log}\n--- the job ---\n{self.job_output[-3000:]}")
        assert [path.read_text() for path in codes] == ["0"] * self.ranks, \
            f"training failed:\n{log}"
        return stem


def train_together(tmp: Path, cases: dict[str, list[str]], np: int = 2,
                   pythonpath: str = "") -> TrainedCases:
    """Train each ``name: hvdtrain train options`` into ``tmp/name`` in one job of ``np``
    ranks (one process when ``np`` is 1), in the order given; one backend per job."""
    tmp.mkdir(parents=True, exist_ok=True)
    job = [{"argv": ["train", "--run-dir", str(tmp / name), "--no-progress", *args],
            "stem": str(tmp / name)} for name, args in cases.items()]
    cases_file = tmp / f"cases-{next(iter(cases))}.json"
    cases_file.write_text(json.dumps(job))
    result = launch(LAUNCHER if np > 1 else "none", np, [str(cases_file)], module="train_cases",
                    cwd=tmp, timeout=RUN_TIMEOUT + CASE_TIMEOUT * len(cases),
                    PYTHONPATH=":".join(filter(None, [RANK_PYTHONPATH, pythonpath])))
    for name in cases:
        logs = [tmp / f"{name}.rank{rank}.log" for rank in range(np)]
        (tmp / f"{name}.log").write_text("".join(
            path.read_text() for path in logs if path.exists()))
    return TrainedCases(tmp, list(cases), np, result.stdout + result.stderr)


def trained_on_demand(directory_for: Callable[[str], Path],
                      cases: Callable[[str, Path], dict[str, list[str]]]
                      ) -> Callable[[str, str], Path]:
    """``run(group, name)``: the run directory of case ``name``, its whole group (``cases(group,
    directory)``: 2 ranks, or one process for the group "one") trained in one launch into
    ``directory_for(group)`` when a test first asks for one of its cases."""
    jobs: dict[str, TrainedCases] = {}

    def run(group: str, name: str) -> Path:
        if group not in jobs:
            directory = directory_for(group)
            directory.mkdir(parents=True, exist_ok=True)     # the cases may write data there
            jobs[group] = train_together(directory, cases(group, directory),
                                         np=1 if group == "one" else 2,
                                         pythonpath=str(directory))
        return jobs[group][name]

    return run
