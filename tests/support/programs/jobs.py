"""The test side of the harness: the launches of ``programs.ranks``, run once per pytest
session, at the same time, when a test file first asks (whichever), their records read back
for both sets' tests.

Two launches: ``ranks``, 2 ranks on the default backend running the ``hvdtrain`` mode (both
sets) and then, in the same processes, the ``dropin`` mode (the Keras-example set's programs
that run under the drop-in); ``one``, one process running the ``keras`` mode with twice the
per-rank batch (both sets' reference). A mode's records are its ``Job``. Each launch's wall
time is printed (``-s``) and its output kept in ``<launch>.log`` under its temporary directory.
Working on the checks alone, ``PROGRAMS_REUSE=DIR`` reads an earlier launch's files from
``DIR/<launch>/`` (a copy of its temporary directory) instead of running it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import LAUNCHER, RANK_PYTHONPATH, launch

# The launches: each runs its modes one after the other in the same processes.
LAUNCHES: dict[str, tuple[int, tuple[str, ...]]] = {
    "ranks": (2, ("hvdtrain", "dropin")), "one": (1, ("keras",))}
TIMEOUT = 900      # the 2-rank launch runs both sets: ~4 minutes on 2 busy cores


@dataclass
class Job:
    """One mode's records, and the launch that ran it."""

    mode: str
    out: Path                 # where its records, and its programs' directories, are
    records: list[dict]       # per rank: program name -> record
    output: str
    returncode: int | None
    seconds: float

    def record(self, name: str, rank: int = 0) -> dict:
        """A program's record on ``rank``; fails naming what happened when it is missing or the
        program raised."""
        records = self.records[rank] if rank < len(self.records) else {}
        if name not in records:
            pytest.fail(f"the {self.mode} job left no record of {name} on rank {rank} "
                        f"(exit {self.returncode}):\n{self.output[-3000:]}")
        record = records[name]
        if record["error"]:
            pytest.fail(f"{name} raised on rank {rank} under {self.mode}: {record['error']}")
        return record

    def directory(self, name: str) -> Path:
        """Where the program ``name`` wrote its files (``ctx.directory``; ``run-<n>``: the run
        directory of its n-th ``hvdtrain.fit``)."""
        return self.out / f"{self.mode}-{name}"


_JOBS: dict[str, Job] = {}


def shared_job(mode: str, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The ``mode`` job's records. The first time a test of this session asks for a mode, every
    launch runs, at the same time: the one-process reference (one core, 30 s) fills the time
    the 2-rank launch leaves a core idle (rank 0 alone writing each run's outputs, one rank
    waiting for the other at a collective), and every test file of both sets compares the two
    (what they compute does not depend on it: each process's thread pools follow the core
    count, not the load)."""
    if mode not in _JOBS:
        with ThreadPoolExecutor(len(LAUNCHES)) as pool:
            launched = [pool.submit(_launched, tmp_path_factory.mktemp(f"programs-{name}"),
                                    name, ranks, modes)
                        for name, (ranks, modes) in LAUNCHES.items()]
            for jobs in launched:
                _JOBS.update(jobs.result())
    return _JOBS[mode]


def _launched(out: Path, name: str, ranks: int, modes: tuple[str, ...]) -> dict[str, Job]:
    kept = os.environ.get("PROGRAMS_REUSE")     # working on the checks: earlier jobs' files
    if kept and (Path(kept) / name / f"{modes[0]}-0.json").exists():
        out, output, code, seconds = Path(kept) / name, f"(reused {kept})", 0, 0.0
    else:
        started = time.perf_counter()
        try:
            result = launch(LAUNCHER if ranks > 1 else "none", ranks, [str(out), ",".join(modes)],
                            cwd=out, module="programs.ranks", timeout=TIMEOUT,
                            PYTHONPATH=RANK_PYTHONPATH)
            output, code = result.stdout + result.stderr, result.returncode
        except subprocess.TimeoutExpired as error:
            output = "".join(part.decode() if isinstance(part, bytes) else part or ""
                             for part in (error.stdout, error.stderr))
            output += f"\n(killed after {TIMEOUT} s)"
            code = None
        seconds = time.perf_counter() - started
        (out / f"{name}.log").write_text(output)
        print(f"\nprograms: the {name} launch ({', '.join(modes)}): {seconds:.1f} s, exit {code}")
    return {mode: Job(mode, out, [json.loads(path.read_text()) if path.exists() else {}
                                  for path in (out / f"{mode}-{rank}.json"
                                               for rank in range(ranks))],
                      output, code, seconds)
            for mode in modes}


def weights(record: dict) -> dict[str, list[np.ndarray]]:
    """A program's final weights, by model."""
    found = {}
    for model, path in record["weights"].items():
        with np.load(path) as archive:
            found[model] = [archive[key] for key in archive.files]
    return found


def counts(record: dict, counter: str = "ids") -> dict[int, int]:
    """How often each example id was seen (ids never seen left out)."""
    seen = record["counts"][counter]
    return dict(zip(seen["ids"], seen["times"]))
