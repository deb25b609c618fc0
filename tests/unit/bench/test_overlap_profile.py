"""The overlap tool on TensorFlow profiles (the TensorFlow backend's collectives): its numbers
from hand-written XPlane files of two ranks, exactly (every time a multiple of 250 us). A real
2-rank profile: tests/distributed/training/test_overlap_ranks.py."""

from __future__ import annotations

import json

import pytest

from hvdtrain.bench.overlap import main

BASE_NS = 1_000_000        # every line's timestamp; events are offsets from it
STEP_US = 10_000


def write_profile(folder, rank: int, steps: int = 3, collectives: bool = True):
    """One rank's XPlane, laid out as TensorFlow's profiler writes it: a compute thread with
    the ops (forward, backward under ``gradient_tape/``, update) and each collective's launch
    (``CollectiveOpV2Kernel::Run``, the op's name in a ``name`` stat), a ``collective_ops``
    thread with each collective's run (``<op>:<type>``) beside the executor's own events.
    Rank 1's backward pass ends 250 us later, and it launches and finishes later; its lines
    start 500 us earlier on the clock, with every offset 500 us larger (the same moments)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.planes.add(name="Task Environment")
    plane = space.planes.add(name="/host:CPU")
    plane.stat_metadata[1].name = "name"
    ids: dict[str, int] = {}

    shift = 500 * rank

    def add(line, name: str, begin_us: int, end_us: int, op: str | None = None) -> None:
        if name not in ids:
            ids[name] = len(ids) + 1
            plane.event_metadata[ids[name]].name = name
        event = line.events.add(metadata_id=ids[name], offset_ps=(begin_us + shift) * 10**6,
                                duration_ps=(end_us - begin_us) * 10**6)
        if op:
            event.stats.add(metadata_id=1, str_value=op)

    base_ns = BASE_NS - shift * 1000
    compute = plane.lines.add(name="tf_Compute/17", timestamp_ns=base_ns)
    runs = plane.lines.add(name="collective_ops/3", timestamp_ns=base_ns)
    plane.lines.add(name="python", timestamp_ns=base_ns)
    late = 250 * rank
    for step in range(steps):
        b = STEP_US * step
        add(compute, "model/dense/MatMul:_MklMatMul", b, b + 2000)
        add(compute, "gradient_tape/model/dense/MatMul:_MklMatMul", b + 2000, b + 5000 + late)
        add(compute, "ExecutorState::Process", b, b + 7500)
        add(compute, "cond/then/AssignSub:AssignSubVariableOp", b + 7000, b + 7500)
        if collectives:
            add(compute, "CollectiveOpV2Kernel::Run", b + 4000 + late, b + 4010 + late,
                "CollectiveReduceV2")
            add(compute, "CollectiveOpV2Kernel::Run", b + 5000 + 2 * late, b + 5010 + 2 * late,
                "CollectiveReduceV2_1")
            add(runs, "CollectiveExecutor::RunClosure", b + 4000 + late, b + 4001 + late)
            add(runs, "CollectiveReduceV2:CollectiveReduceV2", b + 4000 + late, b + 5000)
            add(runs, "CollectiveReduceV2_1:CollectiveReduceV2", b + 5000 + 2 * late,
                b + 6500 + late)
    path = folder / f"rank{rank}" / "plugins" / "profile" / "2026_11_26" / "node.xplane.pb"
    path.parent.mkdir(parents=True)
    path.write_bytes(space.SerializeToString())


def test_a_tensorflow_profile_gives_each_steps_collectives_backward_pass_and_compute(
        tmp_path, capsys):
    profile, out = tmp_path / "profile", tmp_path / "out"
    for rank in (0, 1):
        write_profile(profile, rank)
    assert main(["--profile", str(profile), "--output-dir", str(out)]) == 0
    report = json.loads((out / "overlap.json").read_text())
    assert (report["steps"], report["step"], report["calls_per_step"]) == (3, 2, [2, 2, 2])
    assert report["time_origin_us"] == BASE_NS / 1e3 + 2 * STEP_US + 4000
    # Launches: the first rank's is the submission, the last rank's the "negotiation"; the
    # reduction runs from the last rank's start (the first waits in it) to the last one's end.
    assert report["calls"] == [
        {"name": "CollectiveReduceV2", "tensors": 1, "bytes": None, "submitted_ms": 0.0,
         "negotiated_ms": 0.25, "reduction_start_ms": 0.25, "reduction_end_ms": 1.0},
        {"name": "CollectiveReduceV2_1", "tensors": 1, "bytes": None, "submitted_ms": 1.0,
         "negotiated_ms": 1.5, "reduction_start_ms": 1.5, "reduction_end_ms": 2.75}]
    # The last gradient is the later rank's last backward op, not the last launch.
    assert report["last_gradient_ready_ms"] == 1.25
    assert report["last_gradient_from"] == "the backward pass's end"
    assert (report["overlap_ms"], report["overlaps"]) == (0.75, True)
    assert report["launched_after_backward_ms"] == -1.25
    assert report["phases"] == {"step_ms": 10.0, "idle_ms": 7.25, "reducing_ms": 2.5,
                                "waiting_ms": 0.75}
    # From one first launch to the next: the rest of this step's backward pass and its
    # update, the next step's forward pass and its backward pass up to that launch.
    assert report["compute_busy_ms"] == [5.5, 5.75]
    assert (out / "overlap.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "the last gradient was ready at 1.250 ms (the backward pass's end)" in printed
    assert "0.750 ms while some rank was still in its backward pass" in printed
    assert "launched -1.2 ms after the backward pass ended" in printed
    assert "5.5, 5.8 ms of a step" in printed


def test_a_profile_without_tensorflow_collectives_is_refused_with_one_line(tmp_path, capsys):
    for rank in (0, 1):
        write_profile(tmp_path / "horovod", rank, collectives=False)
    (tmp_path / "empty").mkdir()
    write_profile(tmp_path / "no-rank-0", 1)
    # The highest rank's folder missing too: only the world size the benchmark wrote shows it.
    write_profile(tmp_path / "no-last-rank", 0)
    (tmp_path / "no-last-rank" / "world.json").write_text(json.dumps({"ranks": 2}))
    write_profile(tmp_path / "bad-world", 0)
    (tmp_path / "bad-world" / "world.json").write_text("{}")
    for folder, words in (("horovod", "HOROVOD_TIMELINE"), ("empty", "--profile-dir"),
                          ("no-rank-0", "no TensorFlow profile of rank 0"),
                          ("no-last-rank", "no TensorFlow profile of rank 1"),
                          ("bad-world", "world.json holds no world size")):
        with pytest.raises(SystemExit) as ended:
            main(["--profile", str(tmp_path / folder), "--output-dir", str(tmp_path / "out")])
        assert ended.value.code == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert words in error and str(tmp_path / folder) in error


def test_each_ranks_backward_pass_is_read_within_its_own_steps():
    """A rank that runs ahead starts its next backward pass before a slower rank's reduction
    ends: that op belongs to its next step, which a window shared by all ranks got wrong."""
    from hvdtrain.bench.profile import RankTrace, backward_ends
    from hvdtrain.bench.step_records import TensorStep

    # A run whose launch named no op was never matched to a step: it sets no window.
    ahead = RankTrace(runs={"c": [(0.0, 10.0), (30.0, 40.0)], "unnamed": [(0.0, 50.0)]},
                      backward=[5.0, 18.0, 25.0])
    behind = RankTrace(runs={"c": [(0.0, 20.0), (30.0, 45.0)]}, backward=[8.0, 15.0, 28.0])
    steps = [[TensorStep("c", 0.0, 0.0, 0.0, 20.0, None)],
             [TensorStep("c", 30.0, 30.0, 30.0, 45.0, None)]]
    assert backward_ends([ahead, behind], steps) == [15.0, 28.0]
    assert backward_ends([RankTrace(runs={"c": [(0.0, 1.0)]})], steps[:1]) == [None]
