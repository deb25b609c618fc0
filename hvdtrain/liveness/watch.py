"""One liveness monitor per rank: is training still moving, was this rank asked to stop, and
when must the process end at once because waiting can never end?

It has one clock, one monitor thread and one way out (both injectable, so tests move time by
hand). The loop reports steps and long phases; signals and a lost launcher only record a stop
request, which the ranks agree on in the step's allreduce (exit 75 after rank 0's
checkpoint); a second request ends the process at once. The monitor ends the process itself on
a stall (exit 76: no step for ``--stall-timeout``, naming the ranks whose heartbeat port does not
answer) or on a stop that cannot be reached (a peer's process ended before the stop's
checkpoint began), and ends a stuck Open
MPI daemon (``launchers.end_open_mpi_daemon``). ``uninstall`` puts every handler back.
"""

from __future__ import annotations

import contextlib
import enum
import os
import select
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, TextIO

from hvdtrain.collectives import World
from hvdtrain.errors import STALLED_EXIT_CODE
from hvdtrain.launchers import end_open_mpi_daemon, hold_open_mpi_abort, launched_by_a_launcher
from hvdtrain.liveness.peers import Heartbeat, Peer, is_gone, peers_where, unanswered
from hvdtrain.startup import real_stderr

if TYPE_CHECKING:
    from hvdtrain.config import Config

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# Requests closer together than this are one event delivered twice, not a second request.
SAME_EVENT_S = 3.0
# A scheduler's advance warning, then its end of the job: one stop, not two (see ``request``).
WARNING, END = "SIGUSR1", "SIGTERM"
# The stall limit without a stop request (see the module doc).
FLOOR_S = 30.0
STEP_FACTOR = 20.0
FIRST_PHASE_S = 120.0
PHASE_FACTOR = 3.0
# After a stop request: a step this many times the slowest (at least the floor) is stuck ...
STUCK_FACTOR = 10
STUCK_MIN_S = 10.0
# ... and this many times (at least the floor) is worth asking whether a peer is gone.
PEER_CHECK_FACTOR = 3
PEER_CHECK_MIN_S = 2.0
BETWEEN_STEPS_PEER_CHECK_S = 5.0
POLL_S = 0.5


class AfterRun(enum.Enum):
    """What the stop signals do once the run is over."""

    RESTORE = "restore"   # the handlers from before the run (a notebook, a test, a script)
    IGNORE = "ignore"     # ignored: the process only exits now (the CLI's console script)


def automatic_limit(slowest_step_s: float) -> float:
    """The default stall limit: generous against jitter yet far below an allocation's time."""
    return max(FLOOR_S, STEP_FACTOR * slowest_step_s)


def liveness_for(config: Config, process_exits: bool = False) -> Liveness:
    """The monitor a run of ``config`` gets: stalls limited by ``--stall-timeout``, the stop
    signals, the launcher when one started this process; ``process_exits``: the process ends
    with the run (the console script), so the stop signals stay ignored after it. An elastic
    run's monitor installs no handler (Horovod's elastic loop handles a lost rank)."""
    if config.train.elastic:
        return Liveness(0, install_signals=False)
    return Liveness(config.train.stall_timeout, watch_launcher=launched_by_a_launcher(),
                    after_run=AfterRun.IGNORE if process_exits else AfterRun.RESTORE)


class Liveness:
    """This rank's liveness monitor (see the module doc)."""

    def __init__(self, stall_timeout: float | None = None, *, install_signals: bool = True,
                 watch_launcher: bool = False, after_run: AfterRun = AfterRun.RESTORE,
                 clock: Callable[[], float] = time.monotonic,
                 exit: Callable[[int], Any] = os._exit, stream: TextIO | None = None,
                 poll_s: float = POLL_S) -> None:
        """``stall_timeout``: a fixed stall limit in seconds, None for the automatic one, 0 for
        none; ``install_signals``: route the stop signals here (not for an elastic run,
        whose lost ranks Horovod's elastic loop handles); ``watch_launcher``: a launcher
        started this process (stop when it ends);
        ``clock``, ``exit``, ``stream``, ``poll_s``: for tests."""
        self.fixed_limit = stall_timeout
        self.install_signals = install_signals
        self.watch_launcher = watch_launcher
        self.after_run = after_run
        self.who = "this rank"
        self._stall_watch = False
        self._clock, self._exit, self._stream, self._poll_s = clock, exit, stream, poll_s
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._saved: dict[int, Any] = {}
        self._saved_wakeup_fd: int | None = None
        self._launcher: int | None = None
        self._launcher_lost = False
        self._heartbeat: Heartbeat | None = None
        self.peers: list[Peer] = []
        # Stop requests.
        self.stop_reason: str | None = None
        self._stop_code = 0
        self._stop_at = 0.0
        self._end_came = False
        self.stop_checkpoint_began = False
        # The step and phase clock.
        self._step_began: float | None = None
        self._last_step_end: float | None = None
        self._after_phase = False
        self._phases = 0
        self._phase_began = 0.0
        self._deadline: float | None = None     # the stall deadline; None: not armed
        self._armed_limit = 0.0
        self.steps = 0
        self.slowest_step_s = 0.0
        self.longest_phase_s = 0.0
        self.waiting_for = "the first training step"

    # --- installed for the run -----------------------------------------------------------

    def install(self) -> None:
        """Route the stop signals here (from the main thread only; elsewhere they keep their
        handlers), watch the launcher if asked, and start the monitor thread. Idempotent."""
        if self._thread is not None:
            return
        self._closed.clear()
        if self.install_signals and threading.current_thread() is threading.main_thread():
            read_fd, write_fd = os.pipe()
            os.set_blocking(read_fd, False)
            os.set_blocking(write_fd, False)
            self._pipe = (read_fd, write_fd)
            for number in STOP_SIGNALS:
                # The Python-level handler does nothing: the C-level one writes the number into
                # the wakeup pipe at once, which the monitor thread reads.
                self._saved[number] = signal.signal(number, lambda *_: None)
            self._saved_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if self.watch_launcher:
            hold_open_mpi_abort()
            self._launcher = os.getppid()
        self._thread = threading.Thread(target=self._monitor, name="hvdtrain-liveness",
                                        daemon=True)
        self._thread.start()

    def uninstall(self) -> None:
        """Stop the thread and the heartbeat, and put the signals back (``after_run``). The
        thread is told first: a look it is taking must not blame a peer for this rank's own
        closed port."""
        self._closed.set()
        self.training_ended()
        if self._heartbeat is not None:
            self._heartbeat.close()
            self._heartbeat = None
        if self._pipe is not None:
            os.write(self._pipe[1], b"\0")   # wakes the thread's select (0 is no signal)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if self._pipe is not None:
            signal.set_wakeup_fd(self._saved_wakeup_fd if self._saved_wakeup_fd is not None
                                 else -1)
            for number, handler in self._saved.items():
                restored = signal.SIG_IGN if self.after_run is AfterRun.IGNORE else handler
                signal.signal(number, restored if restored is not None else signal.SIG_DFL)
            for fd in self._pipe:
                os.close(fd)
            self._pipe, self._saved = None, {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[Liveness]:
        """``install`` for the block, ``uninstall`` however it ends."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    def attach(self, world: World) -> None:
        """The world is known: name this rank in its lines and watch for stalls when another
        rank can hang it (more than one rank, ``--stall-timeout`` not 0)."""
        self.who = f"rank {world.rank} of {world.size} on {world.host}"
        self._stall_watch = world.size > 1 and self.fixed_limit != 0

    @property
    def watches_stalls(self) -> bool:
        return self._stall_watch

    def connect_peers(self, exchange: Callable[[tuple[str, int]], list[tuple[str, int]]],
                      world: World) -> None:
        """Serve this rank's heartbeat port and learn the others' (``exchange``: an allgather
        of (host, port)), for the stall line and the stop path's probes."""
        self._heartbeat = Heartbeat()
        addresses = exchange((world.host, self._heartbeat.port))
        self.peers = [Peer(rank, host, port) for rank, (host, port) in enumerate(addresses)
                      if rank != world.rank]

    def launcher_gone(self) -> bool:
        """True when the launcher that started this process has ended (its parent changed)."""
        return self._launcher is not None and os.getppid() != self._launcher

    # --- the step and phase clock ------------------------------------------------------------

    def limit(self) -> float:
        """Seconds without a step after which this rank gives up."""
        if self.fixed_limit is not None:
            return self.fixed_limit
        return automatic_limit(self.slowest_step_s)

    def phase_limit(self) -> float:
        """Seconds a phase may take."""
        if self.longest_phase_s == 0.0:
            return max(self.limit(), FIRST_PHASE_S)
        return max(self.limit(), PHASE_FACTOR * self.longest_phase_s)

    def _arm(self, now: float, limit: float) -> None:
        if self._stall_watch:
            self._deadline, self._armed_limit = now + limit, limit

    def step_begins(self) -> None:
        self._step_began = self._clock()

    def step_ends(self) -> None:
        """A step finished: time it (from the previous step's end: not the first, nor the one
        after a phase, which waited for rank 0's writes) and give the next one the limit."""
        now = self._clock()
        with self._lock:
            if self._last_step_end is not None and not self._after_phase:
                self.slowest_step_s = max(self.slowest_step_s, now - self._last_step_end)
            self.steps += 1
            self._last_step_end, self._after_phase, self._step_began = now, False, None
            self.waiting_for = f"training step {self.steps + 1} (its gradient allreduce)"
            if self._phases == 0:
                self._arm(now, self.limit())

    def next_step_traces(self) -> None:
        """The next step traces its function again (``--bucket-choice measured``): it is not
        timed (no slowest step from a trace) and gets a first phase's limit, without counting
        as a phase (the epoch ends' limits stay as they were)."""
        with self._lock:
            self._after_phase = True
            self.waiting_for = f"training step {self.steps + 1} (its function traced again)"
            if self._phases == 0 and self._last_step_end is not None:
                self._arm(self._clock(), max(self.limit(), FIRST_PHASE_S))

    def phase_begins(self, what: str) -> None:
        """A long legitimate phase starts (nestable): it gets the phase limit."""
        now = self._clock()
        with self._lock:
            self._phases += 1
            self.waiting_for = what
            if self._phases == 1:
                self._phase_began = now
                if self._last_step_end is not None:
                    self._arm(now, self.phase_limit())

    def phase_ends(self) -> None:
        """The phase is over: the next step may also wait for rank 0's writes."""
        now = self._clock()
        with self._lock:
            self._phases = max(0, self._phases - 1)
            if self._phases:
                return
            self.longest_phase_s = max(self.longest_phase_s, now - self._phase_began)
            if self._last_step_end is None:
                return
            self._after_phase = True
            self.waiting_for = (f"training step {self.steps + 1} (its gradient allreduce, after "
                                "rank 0's end-of-epoch writes)")
            self._arm(now, 2 * self.limit())

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        self.phase_begins(what)
        try:
            yield
        finally:
            self.phase_ends()

    def training_ended(self) -> None:
        """No more steps: disarm, and stop asking the peers (their ports may close for good
        reasons now). This rank's own heartbeat serves until ``uninstall``, once the run's last
        collective is behind it: a peer still finishing its epoch's end must not take this
        rank for gone while it waits in the final validation."""
        with self._lock:
            self._deadline = None
            self._step_began = None
        self.peers = []

    # --- stop requests -----------------------------------------------------------------------

    def request(self, reason: str, exit_code: int) -> None:
        """Record the first request; end the process at once on a second, later one.

        The exception: after the time-limit warning (SIGUSR1, which the batch scripts relay),
        the scheduler's SIGTERM is the same stop arriving on schedule, not an impatient second
        request. A loaded Slurm controller may send the two seconds apart; exiting then would
        lose the checkpoint the warning asked for, while Slurm's own SIGKILL (KillWait after
        its SIGTERM) still bounds the wait. A request after that one ends the process."""
        with self._lock:
            now = self._clock()
            if self.stop_reason is None:
                self.stop_reason, self._stop_code, self._stop_at = reason, exit_code, now
                return
            if now - self._stop_at < SAME_EVENT_S:
                return
            if (self.stop_reason, reason) == (WARNING, END) and not self._end_came:
                self._end_came, self._stop_at = True, now
                return
        self._leave(f"hvdtrain: second stop request ({reason}) after {self.stop_reason}: "
                    "exiting now, without a checkpoint", exit_code)

    def stop_checkpoint_begins(self) -> None:
        """Every rank is about to enter the stop checkpoint's last collective: from here each
        rank only finishes and leaves, in its own time, so a peer whose process has ended left
        as agreed (under load ranks that judged it a stop that cannot be reached exited 138,
        both ways round). The stall limit, where stalls are watched, still bounds the rest."""
        with self._lock:
            self.stop_checkpoint_began = True

    def gone_peers(self) -> list[str]:
        """``rank R on HOST`` for every other rank whose process has ended (``is_gone``)."""
        return peers_where(is_gone, list(self.peers))

    def _running_past(self, now: float, factor: float, floor_s: float) -> float | None:
        """Seconds the current step has run, when past ``factor`` times the slowest step and
        ``floor_s`` (only once two steps are timed); else None."""
        began = self._step_began
        if began is None or self.steps < 2:
            return None
        running = now - began
        return running if running > max(floor_s, factor * self.slowest_step_s) else None

    def _why_stop_is_stuck(self, now: float) -> str | None:
        """After a stop request: why the stop can never be reached, or None while it may."""
        if self.stop_checkpoint_began:
            return None
        # Not the step after an epoch's end or a trace: it waits for rank 0's writes or traces.
        if not self._after_phase and (
                running := self._running_past(now, STUCK_FACTOR, STUCK_MIN_S)) is not None:
            return (f"this rank's step has not ended for {running:.0f} s: another rank is gone "
                    "or stuck")
        if (running := self._running_past(now, PEER_CHECK_FACTOR, PEER_CHECK_MIN_S)) is not None:
            if gone := self.gone_peers():
                return (f"this rank's step has waited {running:.0f} s for {', '.join(gone)}, "
                        "whose process has ended")
        waited = now - self._stop_at
        if self._step_began is None and waited > BETWEEN_STEPS_PEER_CHECK_S:
            if gone := self.gone_peers():
                return (f"this rank has waited {waited:.0f} s between steps (validation, "
                        f"checkpoint or setup) for {', '.join(gone)}, whose process has ended")
        return None

    # --- the monitor ---------------------------------------------------------------------

    def _monitor(self) -> None:
        read_fd = self._pipe[0] if self._pipe is not None else None
        while not self._closed.is_set():
            if read_fd is not None:
                select.select([read_fd], [], [], self._poll_s)
            else:
                self._closed.wait(self._poll_s)
            if self._closed.is_set():
                return
            self._read_signals(read_fd)
            self.check()

    def _read_signals(self, read_fd: int | None) -> None:
        if read_fd is None:
            return
        try:
            numbers = os.read(read_fd, 64)
        except BlockingIOError:
            return
        for number in numbers:
            if number in STOP_SIGNALS:
                self.request(signal.Signals(number).name, 128 + number)

    def check(self) -> None:
        """One look (the thread's, every ``poll_s``): the launcher, the stall deadline, and a
        requested stop that can never be reached. Ends the process when it must."""
        if not self._launcher_lost and self.launcher_gone():
            self._launcher_lost = True
            # stdout and stderr led to the launcher; writing there could fail mid-checkpoint.
            quiet, leading_there = os.open(os.devnull, os.O_WRONLY), {1, 2, real_stderr()}
            for descriptor in leading_there:
                os.dup2(quiet, descriptor)
            if quiet not in leading_there:
                os.close(quiet)
            self.request("its launcher ending", 128 + signal.SIGTERM)
        now = self._clock()
        with self._lock:
            stalled_s = (None if self._deadline is None or now <= self._deadline
                         else now - (self._last_step_end or now))
        if stalled_s is not None:
            self._stalled(stalled_s)
            return
        if self.stop_reason is not None:
            why = self._why_stop_is_stuck(now)
            # The probes take time: the checkpoint or the run's end may have begun meanwhile.
            if why is not None and not self.stop_checkpoint_began and not self._closed.is_set():
                self._leave(f"hvdtrain: stop requested ({self.stop_reason}) but {why}; exiting "
                            "now, without a checkpoint", self._stop_code)

    def peer_unreachable(self, error: BaseException) -> None:
        """A collective failed because another rank stopped answering (TensorFlow's
        heartbeats: ``collectives.peer_unreachable``), which a lost node causes: leave as from
        a stall (the line, Open MPI's daemon ended, exit 76). An ordinary error exit would
        have the launcher end the job with messages to the lost node, which wait for TCP for
        minutes. Nothing when this rank watches no stalls (one rank, ``--stall-timeout 0``)."""
        if not self._stall_watch:
            return
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        self._end_as_stalled(f"lost another rank ({first[:200]})", "its node may be gone",
                             "its node may be gone")

    def _stalled(self, silent_s: float) -> None:
        self._end_as_stalled(f"stalled: no training step finished for {silent_s:.0f} s (limit "
                             f"{self._armed_limit:.0f} s, --stall-timeout) while waiting for "
                             f"{self.waiting_for}", "every other rank still answers",
                             "another rank, its node or the network stopped answering")

    def _end_as_stalled(self, what: str, answering: str, no_peers: str) -> None:
        """Leave as a stalled rank: one line (``what`` happened; the ranks whose heartbeat
        does not answer, else ``answering``, or ``no_peers`` where none are known), Open
        MPI's waiting daemon ended, exit 76."""
        silent = unanswered(self.peers)
        culprit = (f"no answer from {', '.join(silent)}" if silent else
                   answering if self.peers else no_peers)
        self._leave(f"hvdtrain: error: {self.who} {what}; {culprit}; ending this rank "
                    f"(exit {STALLED_EXIT_CODE})", STALLED_EXIT_CODE, end_daemon=True)

    def _leave(self, line: str, code: int, end_daemon: bool = False) -> None:
        """The one way out: the line, then (for a real exit after a stall) Open MPI's waiting
        daemon, then the process."""
        self._deadline = None
        if self._stream is not None:
            self._stream.write(line + "\n")
            self._stream.flush()
        else:   # not through sys.stderr, whose lock the blocked main thread may hold
            with contextlib.suppress(OSError):   # the launcher, and so stderr's reader, gone
                os.write(real_stderr(), (line + "\n").encode())
        if end_daemon and self._exit is os._exit:
            end_open_mpi_daemon(os.getppid())
        self._exit(code)
