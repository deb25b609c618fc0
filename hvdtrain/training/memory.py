"""What a rank holds for training, measured as the run ends (before a sharded optimizer's state
is gathered back whole): the optimizer state's bytes, the gradient bytes kept after the
exchange, and the process's peak resident memory. ``summary.json`` lists them per rank, so
ZeRO's savings are read from a run, not computed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import keras

from hvdtrain.collectives import variable_bytes


@dataclass(frozen=True)
class HeldMemory:
    """One rank's figures (bytes). ``gradient_bytes``: the reduced gradients (whole, or this
    rank's pieces under ZeRO) plus the sums kept across accumulated micro-steps; the local
    gradients the backward pass produces exist on every stage, one bucket at a time."""

    zero_stage: int
    optimizer_state_bytes: int
    gradient_bytes: int
    peak_resident_bytes: int | None


def peak_resident_bytes() -> int | None:
    """The process's peak resident set (Linux' VmHWM), or None where /proc does not tell."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def held_memory(zero_stage: int, optimizers: Sequence[keras.optimizers.Optimizer],
                gradient_bytes: int) -> HeldMemory:
    state = [v for optimizer in optimizers if optimizer.built for v in optimizer.variables]
    return HeldMemory(zero_stage, variable_bytes(state), gradient_bytes, peak_resident_bytes())
