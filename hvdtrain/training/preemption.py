"""Stop requests: a signal (or the launcher going away) asks every rank to stop at one step.

A cluster stops jobs far more often than they crash: a time limit, preemption, ``scancel``, a pod
eviction, a ``timeout`` wrapper. Each of these sends a signal to some process of the job, often
to one rank only or only to the launcher. How hvdtrain turns that into a clean stop:

* **Only a flag.** SIGTERM, SIGINT and SIGUSR1 (Slurm's usual ``--signal`` choice) record the
  request and nothing else. A thread reads them from Python's wakeup pipe, so a request is seen
  even while the main thread waits inside a collective or a TensorFlow op.
* **One agreement.** Before each step a rank with a request casts a vote (``StepMath.stop_vote``)
  that travels in the step's existing grouped allreduce; a global sum above zero means every
  rank stops after that same step, so no rank is left waiting in a collective. Rank 0 then
  writes a checkpoint there and every rank exits with code 75 and one line saying how to go on.
  At an epoch end the ranks agree once more after validation, so a request that arrives while
  they validate is honoured before the next epoch; one that arrives during setup is carried by
  the first step.
* **A second request ends the process at once** (exit 128 + the signal number), without a
  checkpoint. Requests less than 3 s apart count as one: one event often reaches a rank twice
  (a terminal's Ctrl-C reaches the launcher, which forwards it, and the rank itself).
* **A rank that cannot reach the agreement leaves at once** too (exit 128 + the signal number,
  one line naming why): srun's ``--kill-on-bad-exit`` sends SIGTERM to the survivors of a dead
  rank, for instance, and Slurm kills them KillWait seconds later (30 s by default). After a
  request, a step that has run three times longer than the slowest step so far (and at least
  2 s) asks the other ranks' heartbeat ports (the watchdog's): one that refuses the connection
  belongs to a rank whose process has ended, so the step can never finish. A step that has run
  ten times longer than the slowest (and at least 10 s) is stuck whatever the reason. Between
  steps (validation, the checkpoint agreement, setup) a request that has waited 5 s asks the
  same ports: every part there that waits for the other ranks can never end once one is gone.
  Only the stop path is timed here; a rank stuck without a request is the step-progress watchdog's
  business.
* **The launcher going away** (its process killed, so the rank's parent changes) is a request
  too: the ranks stop, checkpoint and exit instead of training on unseen. Their output, which
  led to the dead launcher, goes to /dev/null from then on (rank 0's run log keeps it), and
  the process then ends without MPI's finalisation, which would wait for the dead launcher's
  daemon (``launcher_gone``; Open MPI's own exit on losing that daemon is held back:
  ``world.hold_open_mpi_abort``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

from hvdtrain.world import hold_open_mpi_abort

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# Requests closer together than this are one event delivered twice, not a second request.
SAME_EVENT_S = 3.0
PARENT_POLL_S = 1.0
# A step that runs this many times longer than the slowest step seen (and at least STUCK_MIN_S)
# after a stop request is stuck in a collective.
STUCK_FACTOR = 10
STUCK_MIN_S = 10.0
# ... and this many times longer (at least PEER_CHECK_MIN_S) is worth asking whether a peer is gone.
PEER_CHECK_FACTOR = 3
PEER_CHECK_MIN_S = 2.0
# Between steps (validation, checkpoint agreement, setup) nothing is timed, but every part that
# waits for the other ranks can never end once one of them is gone: a request that has waited
# this long there asks whether a peer's process has ended.
BETWEEN_STEPS_PEER_CHECK_S = 5.0


class StopRequests:
    """This process's stop request: why it was asked to stop, or None."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._first_at = 0.0
        self._lock = threading.Lock()
        self._installed = False
        self._step_began: float | None = None
        self._steps_timed = 0
        self._slowest_step = 0.0
        self._gone_peers: Callable[[], list[str]] = list
        self._launcher: int | None = None

    def install(self, watch_parent: bool) -> None:
        """Route the stop signals here (main thread only) and, when a launcher started this
        process, watch for that launcher going away. Once per process."""
        if self._installed:
            return
        self._installed = True
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        for number in STOP_SIGNALS:
            # The Python-level handler does nothing: the C-level one writes the signal's number
            # into the wakeup pipe at once, which the thread below reads.
            signal.signal(number, lambda *_: None)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._read_signals, args=(read_fd,), daemon=True,
                         name="hvdtrain-stop-signals").start()
        if watch_parent:
            hold_open_mpi_abort()
            self._launcher = os.getppid()
            threading.Thread(target=self._watch_parent, args=(self._launcher,), daemon=True,
                             name="hvdtrain-launcher-watch").start()

    def launcher_gone(self) -> bool:
        """True when the launcher that started this process has ended (its parent changed)."""
        return self._launcher is not None and os.getppid() != self._launcher

    def step_begins(self) -> None:
        self._step_began = time.monotonic()

    def step_ends(self) -> None:
        """Time the step (not the first: it traces and compiles) for the stuck-step limit."""
        if self._step_began is not None and self._steps_timed:
            self._slowest_step = max(self._slowest_step, time.monotonic() - self._step_began)
        self._steps_timed += 1
        self._step_began = None

    def watch_peers(self, gone_peers: Callable[[], list[str]]) -> None:
        """Where the stop path asks which other ranks' processes have ended (the watchdog's
        ``gone_peers``; by default nobody is known to be gone)."""
        self._gone_peers = gone_peers

    def _running_past(self, factor: float, floor_s: float) -> float | None:
        """Seconds the current step has run, when that is past ``factor`` times the slowest
        step and ``floor_s``; else None."""
        began = self._step_began
        if began is None or self._steps_timed < 2:
            return None
        running = time.monotonic() - began
        return running if running > max(floor_s, factor * self._slowest_step) else None

    def _why_stuck(self) -> str | None:
        """Why the current step can never end, or None while it may."""
        if (running := self._running_past(STUCK_FACTOR, STUCK_MIN_S)) is not None:
            return (f"this rank's step has not ended for {running:.0f} s: another rank is gone "
                    "or stuck")
        if (running := self._running_past(PEER_CHECK_FACTOR, PEER_CHECK_MIN_S)) is not None:
            if gone := self._gone_peers():
                return (f"this rank's step has waited {running:.0f} s for {', '.join(gone)}, "
                        "whose process has ended")
        waited = time.monotonic() - self._first_at
        if self._step_began is None and waited > BETWEEN_STEPS_PEER_CHECK_S:
            if gone := self._gone_peers():
                return (f"this rank has waited {waited:.0f} s between steps (validation, "
                        f"checkpoint or setup) for {', '.join(gone)}, whose process has ended")
        return None

    def ignore_from_now(self) -> None:
        """Training is over and saved: a stop request now has nothing left to stop. (Python
        restores the default action, which kills, while it shuts down; ignoring stays.)"""
        if self._installed:
            for number in STOP_SIGNALS:
                signal.signal(number, signal.SIG_IGN)

    def request(self, reason: str, exit_code: int) -> None:
        """Record the first request; end the process at once on a second, later one."""
        with self._lock:
            now = time.monotonic()
            if self.reason is None:
                self.reason, self._first_at = reason, now
                threading.Thread(target=self._leave_if_stuck, args=(exit_code,), daemon=True,
                                 name="hvdtrain-stop-deadline").start()
                return
            if now - self._first_at < SAME_EVENT_S:
                return
        os.write(2, f"hvdtrain: second stop request ({reason}) after {self.reason}: exiting "
                    "now, without a checkpoint\n".encode())
        os._exit(exit_code)

    def _leave_if_stuck(self, exit_code: int) -> None:
        while (why := self._why_stuck()) is None:
            time.sleep(0.5)
        os.write(2, f"hvdtrain: stop requested ({self.reason}) but {why}; exiting now, "
                    "without a checkpoint\n".encode())
        os._exit(exit_code)

    def _read_signals(self, fd: int) -> None:
        while True:
            for number in os.read(fd, 64):
                if number in STOP_SIGNALS:
                    self.request(signal.Signals(number).name, 128 + number)

    def _watch_parent(self, parent: int) -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        # stdout and stderr led to the launcher; writing there now could fail mid-checkpoint.
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        self.request("its launcher ending", 128 + signal.SIGTERM)


REQUESTS = StopRequests()
