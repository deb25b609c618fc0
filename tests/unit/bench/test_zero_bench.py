"""The ZeRO benchmark's own logic, without training: its stages, the deep model's size, the
bisection that finds the widest model within a memory limit, and the cgroup parent's reading
of a child's resident memory. Its real runs are the bench README's commands."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from hvdtrain.bench import zero
from hvdtrain.bench.plugin_models import residual_mlp, residual_mlp_parameters


def options(*argv: str) -> argparse.Namespace:
    return zero.build_parser().parse_args(list(argv))


def test_stages_name_a_zero_stage_and_remat():
    args = options("--stages", "0", "2", "3", "3r")
    assert [s.label for s in args.stages] == ["0", "2", "3", "3r"]
    assert args.stages[3].arguments() == ["--zero-stage", "3", "--remat", "full"]
    with pytest.raises(argparse.ArgumentTypeError, match="a ZeRO stage 0-3"):
        zero.stage("4")


def test_the_residual_model_is_as_wide_as_its_input_and_counted_without_building():
    assert residual_mlp((16,), 10).count_params() == residual_mlp_parameters(16, 10)
    args = options("--model", "residual", "--stages", "3r")
    train = zero.train_arguments(args, Path("run"), args.stages[0], 4, 1536)
    assert train[train.index("--model") + 1] == zero.RESIDUAL
    assert train[train.index("--synthetic-shape") + 1] == "1536"
    assert zero.parameters(args, 1536) == residual_mlp_parameters(1536, zero.CLASSES)


def test_the_mlp_keeps_its_size():
    assert zero.parameters(options(), 5000) == 55_185_010     # the README's 55.2M


def test_widest_bisects_the_widths(monkeypatch, tmp_path, capsys):
    runs = []

    def launch(args, run_dir, stage, ranks, width, limit_mib=None):
        runs.append(width)
        return (0 if width <= 5 else 137), ""

    monkeypatch.setattr(zero, "launch", launch)
    monkeypatch.setattr(zero, "whole_run_peaks", lambda run_dir: [100.0 * len(runs)])
    args = options("--out", str(tmp_path), "--memory-limit-mib", "2500",
                   "--widths", *map(str, range(8, 0, -1)))
    best, tried = zero.widest(args, zero.stage("3"), 4)
    assert (best, runs) == (5, [4, 6, 5])
    assert [seen["exit"] for seen in tried.values()] == [0, 0, 137]
    found = {"0": (4, {4: tried[4]}), "3": (best, tried)}
    row = zero.limit_table(args, found).splitlines()[3]
    ratio = zero.parameters(args, 5) / zero.parameters(args, 4)
    assert row.startswith(f"| 3 | 5 | 0.0M | {ratio:.2f}x | 300 |")
    assert "6: failed (137, peak 200 MiB)" in row


def test_a_childs_resident_memory_is_traced_until_it_ends():
    child = os.fork()
    if child == 0:
        os._exit(3)
    trace, status, usage = zero.resident_trace(child)
    assert os.waitstatus_to_exitcode(status) == 3 and usage.ru_maxrss > 0


def test_a_timelines_collectives_are_counted(tmp_path):
    rows = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"t{pid}"}}
            for pid in (1, 2)]
    spans = [(1, "NEGOTIATE_ALLGATHER", 0, 500), (1, "ALLGATHER", 500, 1500),
             (2, "ALLGATHER", 1000, 4000), (2, "REDUCESCATTER", 5000, 5250)]
    events = rows + [event for pid, name, begin, end in spans for event in
                     ({"ph": "B", "name": name, "ts": begin, "pid": pid},
                      {"ph": "E", "ts": end, "pid": pid})]
    (tmp_path / zero.TIMELINE).write_text(json.dumps(events)[:-1])   # a job's unclosed file
    assert zero.collectives(tmp_path) == {
        "ALLGATHER": {"calls": 2, "running_ms": 3.5, "median_ms": 2.0},
        "REDUCESCATTER": {"calls": 1, "running_ms": 0.25, "median_ms": 0.25}}
    assert zero.collectives(tmp_path / "none") == {}
