"""A per-rank watchdog on training progress: a collective that never returns must not hang a job.

When a node vanishes (its link goes down, its host freezes), the ranks still alive wait inside an
allreduce that never completes: MPI sees no error, and Horovod's stall check runs on the same
background thread that is stuck, so it never fires either. Without a bound the job burns its
whole allocation. Here a daemon thread watches for steps: the training loop calls ``beat()``
after every step; when no beat comes for the limit, the thread prints one line naming this rank,
its host and what it was waiting for, and ends the process with exit code 76
(``hvdtrain.errors.STALLED_EXIT_CODE``). The launcher then sees a failed rank and ends the job
(mpirun and srun stop the other ranks; every other stalled rank's own watchdog ends it too).

The limit (``--stall-timeout``, seconds): automatic by default, the larger of ``FLOOR_S`` and
``STEP_FACTOR`` times the slowest step seen so far (so a large model or a slow network raises it
by itself); a number fixes it; 0 turns the watchdog off.

Long legitimate phases must not count as a stall:

* the first step (tracing, building, the first collective's negotiation): the watchdog arms
  only at the first beat;
* validation, checkpoint writes and anything else between epochs: wrap them in
  ``with watchdog.suspended("what"):`` (or ``pause``/``resume``);
* the first step after a pause also waits for rank 0's own writes (checkpoint, metrics) that
  only rank 0 does, so it gets twice the limit.

Interface (kept small on purpose; other code arms its own waits with it):
``start()``, ``beat()``, ``suspended(what)`` (a context manager), ``pause(what)``/``resume()``,
``stop()``, and ``limit()``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator, TextIO

from hvdtrain.errors import STALLED_EXIT_CODE
from hvdtrain.world import World

FLOOR_S = 30.0
STEP_FACTOR = 20.0


def automatic_limit(slowest_step_s: float) -> float:
    """The default limit: generous against jitter yet far below an allocation's wall time."""
    return max(FLOOR_S, STEP_FACTOR * slowest_step_s)


def watchdog_for(world: World, stall_timeout: float | None) -> StepWatchdog | None:
    """This rank's watchdog; None when turned off (0) or when no other rank can hang it."""
    if stall_timeout == 0 or world.size == 1:
        return None
    return StepWatchdog(f"rank {world.rank} of {world.size} on {world.host}", stall_timeout)


class StepWatchdog:
    """Ends this process when the training loop stops making progress (see the module doc)."""

    def __init__(self, who: str, timeout: float | None = None, *,
                 exit: Callable[[int], object] = os._exit, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 0.5) -> None:
        """``who``: this rank in words (``rank 3 of 4 on node2``); ``timeout``: a fixed limit
        in seconds, or None for the automatic one; ``exit``, ``stream``, ``clock``: for tests."""
        self.who = who
        self.fixed_limit = timeout
        self._exit = exit
        self._stream = stream
        self._clock = clock
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None     # None: disarmed
        self._last_beat: float | None = None
        self._after_pause = False
        self._pauses = 0
        self.steps = 0
        self.slowest_step_s = 0.0
        self.waiting_for = "the first training step"

    def limit(self) -> float:
        """Seconds without a step after which this rank gives up."""
        if self.fixed_limit is not None:
            return self.fixed_limit
        return automatic_limit(self.slowest_step_s)

    def start(self) -> None:
        """Start watching (armed only from the first ``beat``)."""
        self._thread = threading.Thread(target=self._watch, name="hvdtrain-watchdog",
                                        daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """A step finished: measure it and give the next one the limit."""
        now = self._clock()
        with self._lock:
            if self._last_beat is not None and not self._after_pause:
                self.slowest_step_s = max(self.slowest_step_s, now - self._last_beat)
            self.steps += 1
            self._last_beat, self._after_pause = now, False
            self.waiting_for = f"training step {self.steps + 1} (its gradient allreduce)"
            if self._pauses == 0:
                self._deadline = now + self.limit()

    def pause(self, what: str) -> None:
        """Disarm while a long legitimate phase runs (nestable)."""
        with self._lock:
            self._pauses += 1
            self._deadline = None
            self.waiting_for = what

    def resume(self) -> None:
        """Re-arm after ``pause``: the next step may also wait for rank 0's writes."""
        now = self._clock()
        with self._lock:
            self._pauses = max(0, self._pauses - 1)
            if self._pauses or self._last_beat is None:
                return
            self._after_pause = True
            self.waiting_for = (f"training step {self.steps + 1} (its gradient allreduce, after "
                                "rank 0's end-of-epoch writes)")
            self._deadline = now + 2 * self.limit()

    @contextlib.contextmanager
    def suspended(self, what: str) -> Iterator[None]:
        """``with watchdog.suspended("checkpoint write"):`` the phase cannot trip it."""
        self.pause(what)
        try:
            yield
        finally:
            self.resume()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll_s):
            if self.check():
                return

    def check(self) -> bool:
        """Fire if the deadline has passed (the thread calls this every ``poll_s``)."""
        now = self._clock()
        with self._lock:
            if self._deadline is None or now <= self._deadline:
                return False
            silent_s = now - (self._last_beat or now)
        self._fire(silent_s)
        return True

    def _fire(self, silent_s: float) -> None:
        stream = self._stream or sys.stderr
        stream.write(f"hvdtrain: error: {self.who} stalled: no training step finished for "
                     f"{silent_s:.0f} s (limit {self.limit():.0f} s, --stall-timeout) while "
                     f"waiting for {self.waiting_for}; another rank, its node or the network "
                     f"stopped answering; ending this rank (exit {STALLED_EXIT_CODE})\n")
        stream.flush()
        self._exit(STALLED_EXIT_CODE)
