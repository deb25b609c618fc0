"""The overlap tool: its numbers from hand-written Horovod timelines, exactly (every time a
multiple of 250 us, so each millisecond figure is exact in binary). One real 2-rank run:
tests/distributed/training/test_overlap_ranks.py."""

from __future__ import annotations

import json

import pytest

from hvdtrain.bench.overlap import TensorStep, analyse, calls_of, main, tensor_bytes

# Per tensor of a step: (negotiation begin, its end, ALLREDUCE begin, its end, dtype, shape),
# in timeline microseconds, as Horovod writes them (see the module's docstring).
Step = dict[str, tuple[int, int, int, int, str, str]]


def write_timeline(path, steps: list[Step]):
    """A timeline in Horovod's layout: a row (pid) per tensor named by an ``M`` event, the
    rank-ready instants of a first negotiation, a nested ``MPI_ALLREDUCE``, the dtype and shape
    on the ``ALLREDUCE``'s end, a broadcast's row beside them, and no closing ``]`` (as the
    file of a job that has just ended)."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {}},
              {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "HorovodBroadcast_w"}},
              {"ph": "B", "name": "NEGOTIATE_BROADCAST", "ts": 1, "pid": 1},
              {"ph": "E", "ts": 2, "pid": 1},
              {"ph": "B", "name": "BROADCAST", "ts": 3, "pid": 1},
              {"ph": "E", "ts": 4, "pid": 1}]
    pids = {name: pid for pid, name in enumerate(dict.fromkeys(n for s in steps for n in s), 2)}
    events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
               for name, pid in pids.items()]
    for index, step in enumerate(steps):
        for name, (began, ended, start, end, dtype, shape) in step.items():
            pid = pids[name]
            events += [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": began, "pid": pid}]
            if index == 0:
                events += [{"ph": "X", "name": "0", "ts": began, "pid": pid, "dur": 0}]
            events += [{"ph": "E", "ts": ended, "pid": pid},
                       {"ph": "B", "name": "ALLREDUCE", "ts": start, "pid": pid},
                       {"ph": "B", "name": "MPI_ALLREDUCE", "ts": start + 1, "pid": pid},
                       {"ph": "E", "ts": end - 1, "pid": pid},
                       {"ph": "E", "ts": end, "pid": pid,
                        "args": {"dtype": dtype, "shape": shape}}]
    path.write_text("[\n" + ",\n".join(json.dumps(event) for event in events) + ",")
    return path


# Three buckets issued during the backward pass, in reverse layer order: "a" (two tensors)
# reduces while "b" and "c" are still being computed, and Horovod runs "b" beside "a".
BUCKETED: Step = {
    "HorovodGroupedAllreduce_a_1of2": (10000, 10500, 10750, 12000, "float32", "[256]"),
    "HorovodGroupedAllreduce_a_2of2": (10250, 10500, 10750, 12000, "float16", "[]"),
    "HorovodGroupedAllreduce_b_1of1": (11000, 11250, 11500, 13000, "float64", "[2, 3]"),
    "HorovodGroupedAllreduce_c_1of1": (12500, 12750, 14000, 15000, "int32", "[4]"),
}
# The same tensors in a step where nothing starts before the last one is submitted.
BUCKETED_LATE: Step = {
    "HorovodGroupedAllreduce_a_1of2": (1000, 1500, 2000, 2500, "float32", "[256]"),
    "HorovodGroupedAllreduce_a_2of2": (1000, 1500, 2000, 2500, "float16", "[]"),
    "HorovodGroupedAllreduce_b_1of1": (1250, 1500, 2000, 2500, "float64", "[2, 3]"),
    "HorovodGroupedAllreduce_c_1of1": (1500, 1750, 2000, 2750, "int32", "[4]"),
}
# Today's step: one grouped allreduce of every gradient after the whole backward pass.
ONE_GROUP: Step = {
    "HorovodGroupedAllreduce_g_1of3": (1000, 2000, 2250, 3000, "float32", "[3, 3, 1, 64]"),
    "HorovodGroupedAllreduce_g_2of3": (1250, 2000, 2250, 3250, "float32", "[64]"),
    "HorovodGroupedAllreduce_g_3of3": (1500, 2000, 2500, 3250, "float32", "[]"),
}


def test_buckets_reduced_during_the_backward_pass_overlap(tmp_path):
    report = analyse(write_timeline(tmp_path / "tl.json", [BUCKETED_LATE, BUCKETED]))
    assert (report["steps"], report["step"], report["calls_per_step"]) == (2, 1, [3, 3])
    assert report["time_origin_us"] == 10000
    assert report["calls"] == [
        {"name": "HorovodGroupedAllreduce_a", "tensors": 2, "bytes": 256 * 4 + 2,
         "submitted_ms": 0.0, "negotiated_ms": 0.5, "reduction_start_ms": 0.75,
         "reduction_end_ms": 2.0},
        {"name": "HorovodGroupedAllreduce_b", "tensors": 1, "bytes": 6 * 8,
         "submitted_ms": 1.0, "negotiated_ms": 1.25, "reduction_start_ms": 1.5,
         "reduction_end_ms": 3.0},
        {"name": "HorovodGroupedAllreduce_c", "tensors": 1, "bytes": 4 * 4,
         "submitted_ms": 2.5, "negotiated_ms": 2.75, "reduction_start_ms": 4.0,
         "reduction_end_ms": 5.0}]
    assert report["last_gradient_ready_ms"] == 2.5
    # a from 0.75 to 2.0 and b from 1.5 on, cut at 2.5: their union, 0.75 to 2.5.
    assert report["overlap_ms"] == 1.75
    assert report["overlaps"] is True
    assert report["last_reduction_end_ms"] == 5.0


def test_the_chosen_step_is_the_kth_occurrence_of_each_tensor(tmp_path):
    report = analyse(write_timeline(tmp_path / "tl.json", [BUCKETED_LATE, BUCKETED]), step=0)
    assert report["step"] == 0 and report["time_origin_us"] == 1000
    assert [call["submitted_ms"] for call in report["calls"]] == [0.0, 0.25, 0.5]
    assert report["last_gradient_ready_ms"] == 0.5
    assert (report["overlap_ms"], report["overlaps"]) == (0.0, False)
    assert report["last_reduction_end_ms"] == 1.75


def test_one_group_after_the_backward_pass_does_not_overlap(tmp_path):
    report = analyse(write_timeline(tmp_path / "tl.json", [ONE_GROUP, ONE_GROUP]))
    assert report["calls_per_step"] == [1, 1]
    assert report["calls"] == [
        {"name": "HorovodGroupedAllreduce_g", "tensors": 3, "bytes": (576 + 64 + 1) * 4,
         "submitted_ms": 0.0, "negotiated_ms": 1.0, "reduction_start_ms": 1.25,
         "reduction_end_ms": 2.25}]
    assert report["last_gradient_ready_ms"] == 0.5
    assert (report["overlap_ms"], report["overlaps"]) == (0.0, False)


def test_step_phases_split_each_step_into_time_with_and_without_reductions(tmp_path):
    later = {name: tuple(t + 20000 if isinstance(t, int) else t for t in times)
             for name, times in BUCKETED_LATE.items()}
    report = analyse(write_timeline(tmp_path / "tl.json", [BUCKETED_LATE, BUCKETED, later]))
    # Steps submit first at 1, 10 and 21 ms, reduce from 2 to 2.75, 10.75 to 15 and 22 to
    # 22.75 ms: periods 9 and 11, idle 10 - 2.75 and 21 - 15, reducing 4.25 and 0.75; each
    # call waits from its first submission to its negotiation's end: 0.5 + 0.25 + 0.25 ms in
    # both steps (the first step is not counted: its wait is the ranks' start).
    assert report["phases"] == {"step_ms": 10.0, "idle_ms": 6.625, "reducing_ms": 2.5,
                                "waiting_ms": 1.0}
    assert analyse(write_timeline(tmp_path / "one.json", [BUCKETED]))["phases"] == {}


def test_a_plain_allreduce_is_a_call_of_its_own():
    def tensor(name: str, submitted: float) -> TensorStep:
        return TensorStep(name, submitted, submitted, submitted + 250, submitted + 500, None)

    calls = calls_of([tensor("HorovodAllreduce_loss_0", 1250), tensor("G_2of2", 1000),
                      tensor("G_1of2", 1000), tensor("HorovodAllreduce_x_0", 1000)], 1000)
    assert [(call.name, call.tensors, call.submitted_ms, call.bytes) for call in calls] == [
        ("G", 2, 0.0, None), ("HorovodAllreduce_x_0", 1, 0.0, None),
        ("HorovodAllreduce_loss_0", 1, 0.25, None)]


def test_tensor_bytes_from_dtype_and_shape():
    assert tensor_bytes({"dtype": "bfloat16", "shape": "[2, 5]"}) == 20
    assert tensor_bytes({"dtype": "bool", "shape": "[3]"}) == 3
    assert tensor_bytes({"dtype": "float32", "shape": "[]"}) == 4
    assert tensor_bytes({}) is None


def test_refuses_timelines_whose_steps_cannot_be_told_apart(tmp_path):
    path = write_timeline(tmp_path / "tl.json", [BUCKETED, BUCKETED])
    cut = path.read_text().rsplit('{"ph": "B", "name": "ALLREDUCE"', 1)[0]
    (tmp_path / "cut.json").write_text(cut)
    with pytest.raises(ValueError, match="_c_1of1 was negotiated 2 times but reduced 1 times"):
        analyse(tmp_path / "cut.json")
    metric = {"HorovodAllreduce_metric_0": (20000, 20250, 20500, 20750, "float32", "[]")}
    write_timeline(tmp_path / "more.json", [BUCKETED, {**BUCKETED, **metric}])
    with pytest.raises(ValueError, match=r"steps cannot be told apart .*: 1 tensor\(s\) 1 "
                                         r"times, e.g. HorovodAllreduce_metric_0; 4 tensor\(s\) 2"):
        analyse(tmp_path / "more.json")
    with pytest.raises(ValueError, match="no step 2: the record holds 2"):
        analyse(path, step=2)
    (tmp_path / "none.json").write_text("[\n")
    with pytest.raises(ValueError, match="no allreduce"):
        analyse(tmp_path / "none.json")


def test_reading_a_timeline_writes_the_report_the_chart_and_a_summary(tmp_path, capsys):
    timeline = write_timeline(tmp_path / "tl.json", [BUCKETED])
    assert main(["--timeline", str(timeline), "--output-dir", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "overlap.json").read_text()) == analyse(timeline)
    assert (tmp_path / "out" / "overlap.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "3 allreduce call(s), 4 tensors" in out and "1.750 ms" in out
    assert "Over steps" not in out     # one step: no step before it to measure from
    main(["--timeline", str(write_timeline(tmp_path / "two.json", [BUCKETED_LATE, BUCKETED])),
          "--output-dir", str(tmp_path / "two")])
    assert ("Over steps 2-2 (medians): a step took 9.0 ms, 7.2 ms of it with no allreduce "
            "running") in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:
        main(["--timeline", str(timeline), "--", "--model", "mlp"])
    assert stopped.value.code == 2
