"""``--autotune``'s search with a fake clock: the order of trials, the choice of the best (only
a clear win replaces what was launched), knobs a run cannot vary, the table and the final line;
how an update is timed; what refuses to start. Single-process, no collectives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autotune_lines import FINAL_LINE
from hvdtrain.collectives import LocalCollectives, World
from hvdtrain.errors import UserError
from hvdtrain.autotune.search import (MARGIN, TABLE_HEADER, Outcome, Setting, Trial, search,
                                      table_row, trial_count)
from hvdtrain.autotune.trials import (HOROVOD_CYCLE_MS, TIMED_S, TIMED_UPDATES, Tuning, alike,
                                      autotune, cycle_fixed, launch_environment, launched_setting,
                                      timed_updates, update_times)

LAUNCHED = Setting(4.0, 0.1)


def clock(times: dict[Setting, float], default: float = 100.0):
    """A fake measurement: the ms of each setting (``default`` for the rest), and the list of
    settings in the order they were measured."""
    calls: list[Setting] = []

    def measure(setting: Setting) -> float:
        calls.append(setting)
        return times.get(setting, default)

    return measure, calls


def test_the_bucket_size_then_the_cycle_time_each_keeping_the_fastest_so_far():
    fast_bucket, fast_cycle = Setting(16.0, 0.1), Setting(16.0, 1.0)
    measure, calls = clock({fast_bucket: 80.0, fast_cycle: 70.0, Setting(16.0, 5.0): 75.0})
    shown: list[Trial] = []
    outcome = search(LAUNCHED, measure, shown.append)
    assert calls == [LAUNCHED,
                     *(Setting(mib, 0.1) for mib in (0.0, 1.0, 16.0, 64.0)),   # 4: launched
                     fast_cycle, Setting(16.0, 5.0)]                            # 0.1: timed
    assert [trial.setting for trial in outcome.trials] == calls == [t.setting for t in shown]
    assert outcome.best == fast_cycle and outcome.launched == LAUNCHED
    assert outcome.ms(fast_cycle) == 70.0


def test_a_setting_replaces_the_best_only_when_clearly_faster():
    just_faster = Setting(0.0, 0.1)
    measure, _ = clock({just_faster: 100.0 * (1 - MARGIN / 2)})
    assert search(LAUNCHED, measure).best == LAUNCHED
    measure, _ = clock({just_faster: 100.0 * (1 - 2 * MARGIN)})
    assert search(LAUNCHED, measure).best == just_faster


def test_a_launched_value_off_the_grid_is_timed_first_and_kept_unless_beaten():
    launched = Setting(2.5, 0.3)
    measure, calls = clock({launched: 50.0})
    outcome = search(launched, measure)
    assert calls[0] == launched and len(calls) == trial_count(launched) == 9
    assert outcome.best == launched
    assert len(set(calls)) == len(calls)          # nothing timed twice


def test_knobs_the_run_cannot_vary_are_not_searched():
    buckets_only = Setting(4.0, None)                 # TensorFlow's collectives
    measure, calls = clock({Setting(1.0, None): 10.0})
    outcome = search(buckets_only, measure)
    assert [s.bucket_mib for s in calls] == [4.0, 0.0, 1.0, 16.0, 64.0]
    assert outcome.final_line() == ("autotune: best --bucket-mib 1 (10 ms/step vs 100 ms/step "
                                    "as launched)")
    no_buckets = Setting(None, 0.1)                   # Adasum
    measure, calls = clock({Setting(None, 5.0): 50.0})
    outcome = search(no_buckets, measure)
    assert calls == [no_buckets, Setting(None, 1.0), Setting(None, 5.0)]
    assert outcome.final_line() == ("autotune: best HOROVOD_CYCLE_TIME=5 (50 ms/step vs 100 "
                                    "ms/step as launched)")


def test_the_final_line_gives_flags_and_variables_to_copy():
    best = Setting(16.0, 1.0)
    outcome = Outcome([Trial(LAUNCHED, 355.4), Trial(best, 312.2)], LAUNCHED, best)
    line = outcome.final_line()
    assert line == ("autotune: best --bucket-mib 16 with HOROVOD_CYCLE_TIME=1 (312 ms/step vs "
                    "355 ms/step as launched)")
    found = FINAL_LINE.fullmatch(line)
    assert found and float(found["bucket"]) == 16 and float(found["cycle"]) == 1
    assert best.environment() == {"HOROVOD_CYCLE_TIME": "1"}
    assert outcome.to_json()["best"] == {"bucket_mib": 16.0, "cycle_ms": 1.0}
    assert outcome.to_json()["line"] == line
    assert Outcome([Trial(LAUNCHED, 1.234)], LAUNCHED, LAUNCHED).final_line().endswith(
        "(1.23 ms/step vs 1.23 ms/step as launched)")


def test_the_table_has_a_row_per_trial_under_its_header():
    assert TABLE_HEADER.split() == ["bucket", "MiB", "cycle", "ms", "ms/step"]
    assert table_row(Trial(LAUNCHED, 12.345), LAUNCHED).split() == [
        "4", "0.1", "12.3", "(as", "launched)"]
    row = table_row(Trial(Setting(0.0, None), 1500.0), LAUNCHED)
    assert row.split() == ["0", "-", "1500"]
    assert len(row) == len(TABLE_HEADER)


def test_an_update_is_its_micro_steps_timed_to_the_end_of_its_collectives():
    events: list[str] = []
    ticks = iter(range(100))
    step = SimpleNamespace(votes=SimpleNamespace(stop_agreed=lambda: events.append("sync")))
    counts: list[int] = []

    def rank0_says(count: int) -> int:   # the broadcast of rank 0's count
        counts.append(count)
        return 3

    seconds = update_times(lambda: events.append("call"), step, micro_steps=2,
                           agree=rank0_says, warmup=1, clock=lambda: float(next(ticks)))
    assert events == ["call", "call", "sync"] * 4
    assert seconds == [1.0, 1.0, 1.0]
    assert counts == [timed_updates(1.0)]


def test_short_updates_are_timed_more_often_within_bounds():
    low, high = TIMED_UPDATES
    assert timed_updates(10.0) == low
    assert timed_updates(TIMED_S / 50) == 50
    assert timed_updates(0.0) == timed_updates(1e-5) == high


def test_bucket_sizes_that_split_the_gradients_alike_are_timed_once():
    def same(setting: Setting) -> tuple:            # a gradient smaller than 4 MiB
        return setting.bucket_mib in (0.0, 4.0, 16.0, 64.0), setting.cycle_ms

    measure, calls = clock({Setting(1.0, 0.1): 90.0, Setting(0.0, 0.1): 50.0})
    outcome = search(LAUNCHED, measure, same=same)
    # 0 MiB would be 50 ms, but it is not timed: it runs as the launched 4 MiB does.
    assert calls == [LAUNCHED, Setting(1.0, 0.1), Setting(1.0, 1.0), Setting(1.0, 5.0)]
    assert outcome.best == Setting(1.0, 0.1)
    assert [trial.setting for trial in outcome.trials] == calls
    plans = {mib: min(mib, 8.0) for mib in (0.0, 1.0, 4.0, 8.0, 16.0, 64.0)}
    assert alike(plans.get, (16.0, 0.0, 1.0, 4.0, 16.0, 64.0)) == [[16.0, 64.0]]


def test_the_cycle_time_is_searched_only_where_horovod_can_restart(monkeypatch):
    horovod, tensorflow = SimpleNamespace(backend="horovod"), SimpleNamespace(backend="tensorflow")
    assert cycle_fixed(tensorflow, {}) == "the tensorflow backend has no cycle time"
    assert cycle_fixed(horovod, {"HOROVOD_FUSION_THRESHOLD": None}) is None
    tuning = Tuning(horovod, lambda mib: None, None, 1, False, 4.0, None)
    assert launched_setting(tuning, True, {}) == Setting(4.0, HOROVOD_CYCLE_MS)
    assert launched_setting(tuning, True, {"HOROVOD_CYCLE_TIME": "0.1"}) == Setting(4.0, 0.1)
    assert launched_setting(tuning, False, {"HOROVOD_CYCLE_TIME": "0.1"}) == Setting(4.0, None)
    # Horovod 0.28.1 dies restarting once both its fusion threshold and cycle time are set.
    assert "HOROVOD_FUSION_THRESHOLD set" in cycle_fixed(
        horovod, {"HOROVOD_FUSION_THRESHOLD": "1048576"})
    # Every rank reads rank 0's values (a GPU node has no CPU cycle-time default).
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    rank_zero = {"HOROVOD_CYCLE_TIME": "0.1", "HOROVOD_FUSION_THRESHOLD": None,
                 "HOROVOD_AUTOTUNE": None}
    assert launch_environment(SimpleNamespace(
        broadcast_object=lambda mine, root_rank=0: rank_zero)) == rank_zero


def test_refused_on_one_rank_under_horovods_own_autotune_and_with_nothing_to_search(monkeypatch):
    def tuning(collectives, adasum=False) -> Tuning:
        return Tuning(collectives, lambda mib: None, None, 1, adasum, 4.0, None)

    with pytest.raises(UserError, match="launch it on the ranks you train on"):
        autotune(tuning(LocalCollectives()), print)
    two = SimpleNamespace(world=World(0, 2), backend="tensorflow",
                          broadcast_object=lambda obj, root_rank=0: obj)
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    with pytest.raises(UserError, match="unset HOROVOD_AUTOTUNE"):
        autotune(tuning(two), print)
    monkeypatch.delenv("HOROVOD_AUTOTUNE")
    with pytest.raises(UserError, match="nothing to search: --reduction adasum"):
        autotune(tuning(two, adasum=True), print)
