"""The overlap tool (``python -m hvdtrain.bench.overlap``) on a real 2-rank benchmark of each
backend: a Horovod timeline, or TensorFlow profiles of both ranks, with an allreduce call in
every step, its report and plot. Its numbers from hand-written records:
tests/unit/bench/test_overlap_timeline.py and tests/unit/bench/test_overlap_profile.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import BIN, REPO, RUN_TIMEOUT, rank_env


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["horovod", "tensorflow"])
def test_a_real_two_rank_benchmark_has_a_call_in_every_step(tmp_path, backend):
    out = tmp_path / "overlap"
    result = subprocess.run(
        [str(BIN / "python"), "-m", "hvdtrain.bench.overlap", "--backend", backend,
         "--output-dir", str(out), "--",
         "--model", "mlp", "--batch-size", "8", "--warmup-steps", "1", "--steps", "2"],
        cwd=REPO, env=rank_env(), text=True, capture_output=True, timeout=RUN_TIMEOUT,
        stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "overlap.json").read_text())
    # A timeline holds the warm-up steps too; a profile the --steps after the timed ones.
    assert report["steps"] == len(report["calls_per_step"]) >= (
        2 if backend == "tensorflow" else 3)
    assert min(report["calls_per_step"]) >= 1 and report["calls"]
    for call in report["calls"]:
        if backend == "horovod":
            assert (0 <= call["submitted_ms"] <= call["negotiated_ms"]
                    <= call["reduction_start_ms"] <= call["reduction_end_ms"])
            assert call["bytes"] > 0
        else:   # launches, then the reduction from the last rank's start; no byte counts
            assert (0 <= call["submitted_ms"] <= call["negotiated_ms"]
                    <= call["reduction_start_ms"] <= call["reduction_end_ms"])
            assert call["bytes"] is None
    assert report["overlap_ms"] >= 0 and report["overlaps"] == (report["overlap_ms"] > 0)
    assert (out / "overlap.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "benchmark.json").read_text())["world_size"] == 2
    assert "allreduce call(s)" in result.stdout
    if backend == "tensorflow":     # the profile's backward pass and compute, every rank's
        assert json.loads((out / "profile" / "world.json").read_text()) == {"ranks": 2}
        assert report["launched_after_backward_ms"] is not None
        assert len(report["compute_busy_ms"]) == 2 and min(report["compute_busy_ms"]) > 0
