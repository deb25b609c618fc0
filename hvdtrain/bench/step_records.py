"""Collectives per training step, whatever recorded them: the shared terms of the overlap tool
(``overlap``), which reads Horovod's timeline, and of ``profile``, which reads TensorFlow's
profiler for the TensorFlow backend. Times are microseconds on the hosts' clocks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorStep:
    """One tensor's collective in one step, microseconds."""

    name: str
    submitted: float       # the first rank had queued (Horovod) or launched (TensorFlow) it
    negotiated: float      # every rank had
    start: float           # the reduction began
    end: float
    bytes: int | None


def by_occurrence(per_tensor: dict[str, list[TensorStep]]) -> list[list[TensorStep]]:
    """Steps from each tensor's occurrences in order: step k holds every tensor's k-th.
    Refuses a record whose tensors do not all occur equally often (collectives outside the
    training step, a job cut off mid-step): it has no such steps."""
    if not per_tensor:
        raise ValueError("the record holds no allreduce")
    by_count: dict[int, list[str]] = {}
    for name, occurrences in per_tensor.items():
        by_count.setdefault(len(occurrences), []).append(name)
    if len(by_count) > 1:
        raise ValueError(
            "its allreduced tensors occur unequally often, so steps cannot be told apart "
            "(allreduces outside the training step, such as a training run's metrics?): "
            + "; ".join(f"{len(tensors)} tensor(s) {count} times, e.g. {tensors[0]}"
                        for count, tensors in sorted(by_count.items())))
    [steps] = by_count
    return [[occurrences[k] for occurrences in per_tensor.values()] for k in range(steps)]


def first_submissions(steps: list[list[TensorStep]]) -> list[float]:
    """Each step's first submission: where the tools' steps begin."""
    return [min(tensor.submitted for tensor in tensors) for tensors in steps]


def last_ends(steps: list[list[TensorStep]]) -> list[float]:
    """Each step's last reduction end."""
    return [max(tensor.end for tensor in tensors) for tensors in steps]


def covered(spans: list[tuple[float, float]], begin: float, end: float) -> float:
    """How much of [begin, end) lies in at least one of ``spans`` (their union, cut to the
    window), in the spans' unit."""
    total, reached = 0.0, begin
    for start, stop in sorted(spans):
        start, stop = max(start, reached), min(stop, end)
        if stop > start:
            total += stop - start
            reached = stop
    return total
