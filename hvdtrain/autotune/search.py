"""``--autotune``: which settings to try, which one wins, and how the result reads.

The gradient bucket size (``--bucket-mib``) and Horovod's cycle time decide when a step's
gradients travel; their best values depend on the model, the compute and the network, so they
are measured on the user's own job. ``search`` is a coordinate search (every bucket size, then
every cycle time with the fastest: at most 9 trials), and a setting wins only when it is
``MARGIN`` faster, since single runs on shared cores move by about 5%. Horovod's fusion threshold
is not searched: Horovod 0.28.1 crashes restarting once both it and the cycle time are set.
Nothing here touches a rank, so the search can be tested with a fake clock (``trials``
measures).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Hashable

# The values each knob is tried at, in this order (Horovod's default cycle time is 1 ms;
# hvdtrain sets 0.1 ms on CPU nodes).
GRID: dict[str, tuple[float, ...]] = {
    "bucket_mib": (0.0, 1.0, 4.0, 16.0, 64.0),
    "cycle_ms": (0.1, 1.0, 5.0),
}
# The knobs in the order the search takes them (the fields of ``Setting``).
KNOBS = tuple(GRID)
# How much faster (a fraction of the best so far) a setting must be to replace it.
MARGIN = 0.05


@dataclass(frozen=True)
class Setting:
    """One combination of the knobs; None for a knob the run cannot vary (TensorFlow's
    collectives have no cycle time; Adasum sends each gradient on its own, in no bucket)."""

    bucket_mib: float | None
    cycle_ms: float | None

    def environment(self) -> dict[str, str]:
        """The Horovod variables of this setting (read when Horovod starts)."""
        return {} if self.cycle_ms is None else {"HOROVOD_CYCLE_TIME": f"{self.cycle_ms:g}"}

    def fragment(self) -> str:
        """The setting as a command line says it: ``--bucket-mib 4 with HOROVOD_CYCLE_TIME=0.1``
        (the knobs it varies)."""
        flags = "" if self.bucket_mib is None else f"--bucket-mib {self.bucket_mib:g}"
        variables = " ".join(f"{name}={value}" for name, value in self.environment().items())
        return " with ".join(part for part in (flags, variables) if part)


@dataclass(frozen=True)
class Trial:
    setting: Setting
    median_ms: float


@dataclass(frozen=True)
class Outcome:
    """Every trial in the order it ran, the settings the run was launched with (the first
    trial) and the best found."""

    trials: list[Trial]
    launched: Setting
    best: Setting

    def ms(self, setting: Setting) -> float:
        return next(trial.median_ms for trial in self.trials if trial.setting == setting)

    def final_line(self) -> str:
        """The one line a user copies the flags from."""
        return (f"autotune: best {self.best.fragment()} ({shown_ms(self.ms(self.best))} ms/step "
                f"vs {shown_ms(self.ms(self.launched))} ms/step as launched)")

    def to_json(self) -> dict[str, Any]:
        return {"trials": [{**dataclasses.asdict(t.setting), "median_ms": t.median_ms}
                           for t in self.trials],
                "launched": dataclasses.asdict(self.launched),
                "best": dataclasses.asdict(self.best), "margin": MARGIN,
                "line": self.final_line()}


def search(launched: Setting, measure: Callable[[Setting], float],
           on_trial: Callable[[Trial], None] = lambda trial: None,
           same: Callable[[Setting], Hashable] = lambda setting: setting) -> Outcome:
    """The coordinate search from ``launched`` (see the module doc): ``measure(setting)`` is
    the setting's median step in ms; ``on_trial`` sees each trial as it ends. Knobs that are
    None in ``launched`` are not searched. Settings that ``same`` maps to one key run the same
    way (bucket sizes that split this model's gradients alike): only the first is timed, and
    the others take its time and its place."""
    first: dict[Hashable, Trial] = {}

    def timed(setting: Setting) -> Trial:
        key = same(setting)
        if key not in first:
            first[key] = Trial(setting, measure(setting))
            on_trial(first[key])
        return first[key]

    best = launched
    timed(best)
    for knob in KNOBS:
        if getattr(launched, knob) is None:
            continue
        candidates = [dataclasses.replace(best, **{knob: value}) for value in GRID[knob]]
        fastest = min((timed(candidate) for candidate in candidates),
                      key=lambda trial: trial.median_ms)
        if fastest.median_ms < timed(best).median_ms * (1 - MARGIN):
            best = fastest.setting
    return Outcome(list(first.values()), launched, best)


def trial_count(launched: Setting) -> int:
    """The most trials a search from ``launched`` runs."""
    return 1 + sum(len(GRID[knob]) for knob in KNOBS if getattr(launched, knob) is not None)


def shown_ms(ms: float) -> str:
    """Milliseconds with three significant digits, whole numbers from 100 up."""
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


TABLE_HEADER = f"{'bucket MiB':>10}  {'cycle ms':>8}  {'ms/step':>8}"


def table_row(trial: Trial, launched: Setting) -> str:
    """One row of the table under ``TABLE_HEADER``; '-' for a knob not searched."""
    setting = trial.setting

    def cell(value: float | None, width: int) -> str:
        return f"{'-' if value is None else f'{value:g}':>{width}}"

    note = "  (as launched)" if setting == launched else ""
    return (f"{cell(setting.bucket_mib, 10)}  {cell(setting.cycle_ms, 8)}  "
            f"{shown_ms(trial.median_ms):>8}{note}")
