"""Elastic training, for real (``--elastic`` under horovodrun with a host discovery script):
a slot leaving and joining mid-epoch, and a rank terminated mid-epoch whose survivor re-forms
the world and continues from the last commit; every epoch is one full pass, the rate follows
the world size."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import (BIN, RANK_PYTHONPATH, processes_mentioning, rank_env, rank_pid, read_metrics,
                      read_summary, wait_for)
from hvdtrain.artifacts import json_rows

pytestmark = pytest.mark.distributed


def start_elastic(tmp_path: Path, discovery: str, *args: str,
                  **env: str) -> tuple[subprocess.Popen, Path]:
    """An elastic job of 1 to 2 ranks on the hosts that the shell lines ``discovery`` print
    (batch 8, no warmup, ``env`` added to the ranks' environment); returns it and its run
    directory."""
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\n{discovery}\n")
    discover.chmod(0o755)
    run_dir = tmp_path / "elastic"
    job = subprocess.Popen(
        [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
         "--host-discovery-script", str(discover), "--network-interface", "lo",
         str(BIN / "python"), "-m", "hvdtrain", "--elastic", "--run-dir", str(run_dir),
         "--batch-size", "8", "--warmup-epochs", "0", "--no-progress", *args],
        env=rank_env(**env), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, stdin=subprocess.DEVNULL)
    return job, run_dir


def test_elastic_run_survives_a_slot_leaving_and_joining(tmp_path):
    """Start on 2 slots, drop one mid-epoch, add it back: all epochs finish, the world-size
    changes are logged, the rate follows the world size, and every epoch is a full pass. The
    user's callback (which the elastic loop runs like any other) drops the slot at the second
    step of epoch 2 and slows that epoch, so the change always comes mid-epoch. The slot added
    back is seen at a commit (every 4 steps) a second or two later, mostly still in that slowed
    epoch; epochs 3 and 4 are the margin that keeps the job running until it is."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n")
    epochs = 4
    job, run_dir = start_elastic(tmp_path, f"cat {hosts}", "--epochs", str(epochs),
                                 "--commit-every", "4", "--callbacks", "workloads:leave_mid_epoch",
                                 PYTHONPATH=RANK_PYTHONPATH,
                                 HVDTRAIN_TEST_HOSTS=str(hosts))

    def logged() -> list[dict]:
        return json_rows(run_dir / "elastic.jsonl")

    def while_running(condition, timeout: float) -> None:
        wait_for(lambda: job.poll() is not None or condition(), timeout)
        assert job.poll() is None, f"the job ended early:\n{job.stdout.read()[-3000:]}"

    try:
        while_running(lambda: any(s["world_size"] == 1 for s in logged()), 120)
        hosts.write_text("localhost:2\n")
        while_running(lambda: logged()[-1]["world_size"] == 2, 120)
        output, _ = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    sizes = [s["world_size"] for s in logged()]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2
    assert any(s["epoch"] == 2 and s["world_size"] == 1 and s["offset"] > 0 for s in logged()), \
        f"the user's callback did not shrink the world mid-epoch 2: {logged()}"
    for epoch in range(1, epochs + 1):       # each epoch starts at 0 and only moves forward
        offsets = [s["offset"] for s in logged() if s["epoch"] == epoch]
        assert offsets[0] == 0 and offsets == sorted(offsets)
    for segment in logged():                  # linear scaling follows the world size
        assert segment["lr"] == pytest.approx(0.05 * segment["world_size"])
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == list(range(1, epochs + 1))
    for row in rows:
        assert row["lr"] == pytest.approx(0.05 * row["world_size"])
    assert read_summary(run_dir)["weights_identical"]


def test_elastic_run_continues_on_the_survivor_when_a_rank_is_terminated(tmp_path):
    """2 -> 1: rank 1 gets SIGTERM mid-epoch (under --elastic a signalled rank leaves at once);
    the survivor's step fails in its grouped allreduce, which Horovod's elastic loop alone would
    take for the end of training. It must re-form the world on its own, continue from the last
    commit and finish every epoch. Commits only at epoch ends: a commit also checks for host
    changes, which would otherwise often reach the survivor before its step fails. Two host
    names for one machine: Horovod blacklists the host of a failed rank, and a job whose every
    host is blacklisted stops."""
    epochs = 3
    job, run_dir = start_elastic(tmp_path, "echo localhost:1; echo 127.0.0.1:1", "--epochs",
                                 str(epochs), "--commit-every", "1000", "--dataset", "synthetic",
                                 "--synthetic-examples", "8000", "--synthetic-shape", "16",
                                 "--hidden-units", "16")

    def logged() -> list[dict]:
        return json_rows(run_dir / "elastic.jsonl")

    try:
        wait_for(lambda: job.poll() is not None or any(s["epoch"] == 2 for s in logged()), 240)
        assert job.poll() is None, job.stdout.read()[-3000:]
        time.sleep(1.0)                                  # into epoch 2
        os.kill(wait_for(lambda: rank_pid(str(run_dir), 1), 30), signal.SIGTERM)
        output, _ = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    # (A world change during start-up can add a segment of 2 ranks at epoch 1's start.)
    segments_seen = [(s["epoch"], s["world_size"]) for s in logged()]
    assert segments_seen[-3:] == [(2, 2), (2, 1), (3, 1)], logged()
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == list(range(1, epochs + 1))
    assert rows[-1]["world_size"] == 1
    assert read_summary(run_dir)["world_size"] == 1
    assert processes_mentioning(str(run_dir)) == {}
