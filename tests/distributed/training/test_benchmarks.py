"""The comparison harness at a tiny size, so it never rots. Benchmarks assert no times."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, rank_env

pytestmark = pytest.mark.distributed


def test_compare_harness_writes_every_field(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "hvdtrain.bench.compare", "--model", "mlp", "--batch-size", "8",
         "--steps", "3", "--repeats", "2", "--rounds", "1", "--comm-repeats", "2",
         "--output-dir", str(out), "--launcher", "mpirun"],
        cwd=REPO, env=rank_env(), text=True, capture_output=True, timeout=900,
        stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "compare.json").read_text())
    assert set(report["examples_per_second"]) == {"hvdtrain-custom", "hvdtrain-fit",
                                                  "hvdtrain-tensorflow", "minimal",
                                                  "multiworker", "single", "concurrent"}
    assert all(v > 0 for v in report["examples_per_second"].values())
    assert set(report["ratios"]) == {"custom_step_vs_minimal", "fit_step_vs_minimal",
                                     "custom_throughput_vs_multiworker",
                                     "fit_throughput_vs_multiworker",
                                     "tensorflow_backend_throughput_vs_multiworker",
                                     "tensorflow_backend_throughput_vs_horovod_backend",
                                     "scaling_efficiency", "custom_step_vs_concurrent_floor",
                                     "concurrent_floor_throughput_vs_multiworker"}
    assert [row["bytes"] for row in report["allreduce"]] == [
        4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
    for row in report["allreduce"]:
        assert {"mpi_seconds", "call_seconds", "horovod_seconds", "hvdtrain_seconds",
                "mpi_bus_gbps", "hvdtrain_bus_gbps", "ratio"} <= set(row)
        assert row["backend"] == "horovod"
    assert [row["backend"] for row in report["allreduce_tensorflow_backend"]] == [
        "tensorflow"] * len(report["allreduce"])
    for row in report["allreduce_tensorflow_backend"]:
        assert {"mpi_seconds", "call_seconds", "hvdtrain_seconds", "mpi_bus_gbps",
                "hvdtrain_bus_gbps", "ratio"} <= set(row) and "horovod_seconds" not in row
    assert [row["source"] for row in report["input_pipeline"]] == [
        "digits", "synthetic", "npz", "tfrecord"]
    startup = report["startup"]
    assert (0 < startup["setup_seconds"] < startup["process_start_to_first_step_seconds"]
            < startup["launch_to_first_step_seconds"] < 600)
    assert report["rounds"] == 1     # several rounds' medians: the next test
    assert report["machine"]["launcher"] == "mpirun"
    hvdtrain = json.loads((out / "hvdtrain-custom-1.json").read_text())
    assert {"step_seconds_median", "step_seconds_spread", "examples_per_second_total",
            "per_rank", "world_size"} <= set(hvdtrain) and hvdtrain["world_size"] == 2
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert "custom_step_vs_minimal" in result.stdout


def test_compare_reports_the_median_over_rounds_of_every_variant(tmp_path):
    """Each variant's step time and throughput are the median over the rounds' result files
    (named as the harness writes them, ``<variant>-<round>.json``), and every ratio is taken
    between those medians. (The harness's own run above takes one round: a round is every
    variant launched once more.)"""
    import argparse

    from hvdtrain.bench.compare import summarize

    names = ("hvdtrain-custom", "hvdtrain-fit", "hvdtrain-tensorflow", "minimal", "multiworker",
             "single", "concurrent")
    # A slow spell in round 1; the median (round 2's) is not the mean, first, last or least.
    steps = {name: [9.0, 0.2 + 0.1 * index, 0.1 + 0.1 * index]
             for index, name in enumerate(names)}
    for name, per_round in steps.items():
        for round_, step in enumerate(per_round, start=1):
            (tmp_path / f"{name}-{round_}.json").write_text(json.dumps(
                {"step_seconds_median": step, "examples_per_second_total": 16 / step}))
    for backend in ("horovod", "tensorflow"):
        (tmp_path / f"comm-{backend}.json").write_text("[]")
    args = argparse.Namespace(rounds=3, np=2, model="mlp", batch_size=8, launcher="horovodrun",
                              comm_repeats=1, interop_threads=3)
    report = summarize(tmp_path, args, [{"source": "digits", "examples_per_second": 1e4}], {})
    assert report["rounds"] == 3
    assert report["machine"]["threads"]["multi_rank"]["inter_op"] == 3
    median = {name: sorted(per_round)[1] for name, per_round in steps.items()}
    assert report["step_seconds_median"] == pytest.approx(median)
    assert report["examples_per_second"] == pytest.approx(
        {name: 16 / step for name, step in median.items()})
    ratios = report["ratios"]
    assert ratios["custom_step_vs_minimal"] == pytest.approx(
        median["hvdtrain-custom"] / median["minimal"])
    assert ratios["scaling_efficiency"] == pytest.approx(
        (16 / median["hvdtrain-custom"]) / (2 * 16 / median["single"]))
    assert ratios["custom_step_vs_concurrent_floor"] == pytest.approx(
        median["hvdtrain-custom"] / median["concurrent"])
    assert ratios["concurrent_floor_throughput_vs_multiworker"] == pytest.approx(
        median["multiworker"] / median["concurrent"])
    assert report["input_pipeline"][0]["ratio_to_training"] == pytest.approx(
        1e4 / (16 / median["hvdtrain-custom"] / 2))


def test_timeline_breakdown_reads_a_horovod_timeline(tmp_path):
    """Per size: hvdtrain's calls (a grouped allreduce's rows, ``..._1of1``) only, not the
    sweep's bare ``hvd.allreduce`` calls before them; the warm-up call is dropped, then
    medians of negotiation, MPI and period."""
    from hvdtrain.bench.comm import SIZES, timeline_breakdown

    events, clock = [{"name": "process_name", "ph": "M", "pid": 1, "args": {}},
                     {"name": "process_name", "ph": "M", "pid": 2,
                      "args": {"name": "HorovodAllreduce_Identity_0"}},
                     {"name": "process_name", "ph": "M", "pid": 3,
                      "args": {"name": "HorovodGroupedAllreduce_Identity_0_1of1"}}], 0
    for pid, scale in ((2, 7), (3, 1)):            # the bare series first, 7x slower
        for index, _ in enumerate(SIZES):
            for call in range(3):                  # the warm-up and --repeats 2
                negotiate = 999 if call == 0 else 10 * (index + 1) * scale
                reduced = clock + 1000 + 500 * (index + 1) * scale
                events += [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": clock, "pid": pid},
                           {"ph": "E", "ts": clock + negotiate, "pid": pid},
                           {"ph": "B", "name": "ALLREDUCE", "ts": clock + 1000, "pid": pid},
                           {"ph": "B", "name": "MPI_ALLREDUCE", "ts": clock + 1000, "pid": pid},
                           {"ph": "E", "ts": reduced, "pid": pid},
                           {"ph": "E", "ts": reduced, "pid": pid}]
                clock += 2000 * (index + 1) + 1000
    path = tmp_path / "tl.json"
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + ",")   # unterminated
    rows = timeline_breakdown(path, repeats=2)
    assert [row["bytes"] for row in rows] == SIZES
    for index, row in enumerate(rows):
        assert row["negotiate_ms"] == pytest.approx(0.01 * (index + 1))
        assert row["mpi_allreduce_ms"] == pytest.approx(0.5 * (index + 1))
        assert row["period_ms"] == pytest.approx(2.0 * (index + 1) + 1.0)
    with pytest.raises(ValueError, match="give the sweep's --repeats"):
        timeline_breakdown(path, repeats=3)


def test_scaling_rows_share_and_bus_bandwidth_from_the_compute_floor():
    """Communication share is what a step spends beyond one process's step; the bus bandwidth
    is the ring's 2 (n-1)/n x gradient bytes over that time (half the bytes with fp16)."""
    from hvdtrain.bench.scaling import parse_hosts, summarize, variant_names

    assert parse_hosts("node1:2,node2:2,node3") == ["node1", "node1", "node2", "node2", "node3"]
    assert variant_names([0, 8], [0, 16]) == [
        "single", "concurrent", "exchange", "hvdtrain", "hvdtrain-buckets-0MiB",
        "hvdtrain-buckets-16MiB", "hvdtrain-issued-order", "hvdtrain-tensorflow",
        "hvdtrain-fp16", "hvdtrain-bf16", "hvdtrain-powersgd", "hvdtrain-hierarchical",
        "hvdtrain-zero-1",
        "hvdtrain-zero-2", "hvdtrain-fusion-0MiB", "hvdtrain-fusion-8MiB", "minimal", "multiworker"]

    def result(step: float) -> dict:
        return {"step_seconds_median": step, "examples_per_second_total": 64 / step,
                "parameters": 25_000_000}

    rows = summarize({"big": {"single": [result(0.3), result(0.1), result(0.2)],
                              "hvdtrain": [result(1.2)], "hvdtrain-fp16": [result(0.7)],
                              "minimal": [result(0.1)]}}, ranks=4, link_gbit=1.0)
    by_name = {row["variant"]: row for row in rows}
    assert by_name["single"]["step_seconds"] == 0.2 and "communication_share" not in by_name[
        "single"]
    full = by_name["hvdtrain"]
    assert full["communication_share"] == pytest.approx(1.0 / 1.2)
    assert full["bus_gbytes_per_second"] == pytest.approx(1.5 * 100e6 / 1.0 / 1e9)
    assert full["fraction_of_link"] == pytest.approx(0.15 / 0.125)
    assert by_name["hvdtrain-fp16"]["bus_gbytes_per_second"] == pytest.approx(
        1.5 * 50e6 / 0.5 / 1e9)
    # Faster than the floor (noise): no share, no bandwidth, no division by zero.
    assert by_name["minimal"]["communication_share"] == 0.0
    assert by_name["minimal"]["bus_gbytes_per_second"] is None
    assert "step_over_bound" not in full            # no exchange measured


def test_scaling_rows_measure_the_step_against_the_exchange_alone():
    """The exchange variant's bus bandwidth is over its whole step (it computes nothing); every
    training variant's step is divided by max(floor, exchange alone)."""
    from hvdtrain.bench.scaling import summarize

    def result(step: float) -> dict:
        return {"step_seconds_median": step, "examples_per_second_total": 64 / step,
                "parameters": 25_000_000}

    exchanges = [result(0.8), result(0.9), result(1.0)]
    rows = summarize({"big": {"single": [result(0.2)], "exchange": exchanges,
                              "hvdtrain": [result(0.99)], "hvdtrain-fp16": [result(0.6)]},
                      "small": {"single": [result(0.5)], "exchange": [result(0.1)],
                                "hvdtrain": [result(0.55)]}}, ranks=2, link_gbit=1.0)
    by_name = {(row["model"], row["variant"]): row for row in rows}
    exchange = by_name["big", "exchange"]
    assert exchange["bus_gbytes_per_second"] == pytest.approx(100e6 / 0.9 / 1e9)
    assert exchange["fraction_of_link"] == pytest.approx(0.1 / 0.9 / 0.125)
    assert "communication_share" not in exchange and "step_over_bound" not in exchange
    assert by_name["big", "hvdtrain"]["step_over_bound"] == pytest.approx(0.99 / 0.9)
    assert by_name["big", "hvdtrain-fp16"]["step_over_bound"] == pytest.approx(0.6 / 0.9)
    assert by_name["small", "hvdtrain"]["step_over_bound"] == pytest.approx(0.55 / 0.5)
    # Measured, the concurrent floor (both ranks computing at once) replaces one process's.
    rows = summarize({"big": {"single": [result(0.2)], "concurrent": [result(0.35)],
                              "exchange": exchanges, "hvdtrain": [result(1.0)]},
                      "small": {"single": [result(0.3)], "concurrent": [result(0.5)],
                                "exchange": [result(0.1)], "hvdtrain": [result(0.55)]}},
                     ranks=2, link_gbit=1.0)
    by_name = {(row["model"], row["variant"]): row for row in rows}
    assert "communication_share" not in by_name["big", "concurrent"]
    assert by_name["big", "hvdtrain"]["communication_share"] == pytest.approx(0.65)
    assert by_name["big", "hvdtrain"]["step_over_bound"] == pytest.approx(1.0 / 0.9)
    assert by_name["small", "hvdtrain"]["step_over_bound"] == pytest.approx(0.55 / 0.5)


def test_host_cpu_busy_is_the_busy_share_of_the_cpu_time_between_two_readings():
    """/proc/stat's first line: user nice system idle iowait irq softirq (steal, another
    guest's time, and guest and guest_nice, already in user, are left out); idle and I/O wait
    are not busy."""
    from hvdtrain.bench.benchmark import busy_fraction, host_cpu_jiffies
    from hvdtrain.bench.scaling import summarize

    before = host_cpu_jiffies("cpu  100 0 50 800 50 0 0 40 7 7\ncpu0 1 2 3 4 5\n")
    after = host_cpu_jiffies("cpu  400 0 150 900 50 20 30 90 9 9\n")
    assert before == (150, 1000) and after == (600, 1550)
    assert busy_fraction(before, after) == pytest.approx(450 / 550)
    assert busy_fraction(None, after) is None and busy_fraction(after, after) is None
    assert host_cpu_jiffies("not a stat file") is None

    def result(step: float, busy: float | None) -> dict:
        return {"step_seconds_median": step, "examples_per_second_total": 64 / step,
                "parameters": 1000, "host_cpu_busy": busy}

    rows = summarize({"m": {"single": [result(0.2, 0.5), result(0.2, 0.7), result(0.2, None)],
                            "minimal": [{"step_seconds_median": 0.4, "parameters": 1000,
                                         "examples_per_second_total": 160}]}},
                     ranks=2, link_gbit=None)
    assert rows[0]["host_cpu_busy"] == pytest.approx(0.6) and "host_cpu_busy" not in rows[1]


def test_scaling_refuses_an_unknown_variant_with_one_line(capsys):
    from hvdtrain.bench.scaling import main

    assert main(["--hosts", "a:1,b:1", "--variants", "hvdtrain-fusion-3MiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hvdtrain: error: unknown variant hvdtrain-fusion-3MiB; choose from ")
    assert err.count("\n") == 1


def test_fp16_study_times_every_path_and_checks_each_sum(tmp_path):
    """2 ranks, a tiny size: every path is timed, and every reduction path (fp16 ones
    included) returned the exact float32 sum, or the study would have failed."""
    from conftest import launch
    from hvdtrain.bench.fp16 import PATHS

    output = tmp_path / "fp16.json"
    result = launch("mpirun", 2, ["--mib", "0.25", "--repeats", "2", "--output", str(output)],
                    module="hvdtrain.bench.fp16")
    assert result.returncode == 0, result.stdout + result.stderr
    [row] = json.loads(output.read_text())
    assert row["bytes"] == 1 << 18
    for name in PATHS:
        assert row[f"{name}_seconds"] > 0 and len(row[f"{name}_samples"]) == 2
