"""A per-rank watchdog on training progress: a collective that never returns must not hang a job.

When a node vanishes (its link goes down, its host freezes), the ranks still alive wait inside an
allreduce that never completes: MPI sees no error, and Horovod's stall check runs on the same
background thread that is stuck, so it never fires either. Without a bound the job burns its
whole allocation. Here a daemon thread watches for steps: the training loop calls ``beat()``
after every step; when no beat comes for the limit, the thread prints one line naming this rank,
its host and what it was waiting for, and ends the process with exit code 76
(``hvdtrain.errors.STALLED_EXIT_CODE``). Every stalled rank's own watchdog ends it; srun then
ends the step (measured; Slurm keeps the job COMPLETING until the lost node is marked down);
Open MPI's daemons, which would wait for the lost node for about 15 minutes, are ended by
their ranks (``end_open_mpi_daemon``).

The limit (``--stall-timeout``, seconds): automatic by default, the larger of ``FLOOR_S`` and
``STEP_FACTOR`` times the slowest step seen so far (so a large model or a slow network raises it
by itself); a number fixes it; 0 turns the watchdog off.

Long legitimate phases must not count as a stall, yet a node lost during one must still end
the job (they hold collectives too):

* the first step (tracing, building, the first collective's negotiation): the watchdog arms
  only at the first beat;
* validation, checkpoint writes and anything else between epochs: wrap them in
  ``with watchdog.suspended("what"):`` (or ``pause``/``resume``). A phase gets its own limit:
  ``PHASE_FACTOR`` times the longest phase seen so far, at least the step limit, and
  ``FIRST_PHASE_S`` for the first one (which traces validation and writes the first
  checkpoint);
* the first step after a phase also waits for rank 0's own writes (checkpoint, metrics) that
  only rank 0 does, so it gets twice the limit.

The line names who stopped answering: every rank serves a ``Heartbeat`` port (answered by a
thread, so a rank blocked in a collective still answers); a stalled rank probes the others' and
names those that do not answer (a vanished node, a dead or frozen process).

Interface (kept small on purpose; other code arms its own waits with it):
``start()``, ``beat()``, ``suspended(what)`` (a context manager), ``pause(what)``/``resume()``,
``stop()``, ``limit()``, ``serve_heartbeat()``, ``peers`` (the ``Peer`` list probed when it
fires) and ``gone_peers()`` (the stop path's quick check for ranks whose process has ended);
``stopped_after(watchdog)`` stops it however a block ends.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, TextIO

from hvdtrain.errors import STALLED_EXIT_CODE
from hvdtrain.world import World, keepalive_window_s

FLOOR_S = 30.0
STEP_FACTOR = 20.0
FIRST_PHASE_S = 120.0
PHASE_FACTOR = 3.0
OUTPUT_GRACE_S = 1.5
PROBE_TIMEOUT_S = 3.0
# A rank under orted waits for the launcher's keep-alive to end the job when it takes at most
# this long (launcher_defaults: 46 s); Open MPI's own (480 s) is not waited for.
KEEPALIVE_WAIT_LIMIT_S = 60.0
HNP_PROBE_S = 1.0


def automatic_limit(slowest_step_s: float) -> float:
    """The default limit: generous against jitter yet far below an allocation's wall time."""
    return max(FLOOR_S, STEP_FACTOR * slowest_step_s)


@contextlib.contextmanager
def stopped_after(watchdog: StepWatchdog | None) -> Iterator[None]:
    """Stop the watchdog when the block ends, by an exception too (an error raised out of
    Keras ``fit`` skips the callbacks' ``on_train_end``): a process that goes on, a notebook,
    must not be ended later by a watchdog left armed."""
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.stop()


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
        self._phase_started = 0.0
        self._armed_limit = 0.0
        self.longest_phase_s = 0.0
        self.steps = 0
        self.slowest_step_s = 0.0
        self.waiting_for = "the first training step"
        self.peers: list[Peer] = []              # other ranks to probe when this one stalls
        self._heartbeat: Heartbeat | None = None

    def limit(self) -> float:
        """Seconds without a step after which this rank gives up."""
        if self.fixed_limit is not None:
            return self.fixed_limit
        return automatic_limit(self.slowest_step_s)

    def phase_limit(self) -> float:
        """Seconds a ``suspended`` phase may take."""
        if self.longest_phase_s == 0.0:
            return max(self.limit(), FIRST_PHASE_S)
        return max(self.limit(), PHASE_FACTOR * self.longest_phase_s)

    def _arm(self, now: float, limit: float) -> None:
        self._deadline, self._armed_limit = now + limit, limit

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
                self._arm(now, self.limit())

    def pause(self, what: str) -> None:
        """A long legitimate phase starts: give it the phase limit (nestable)."""
        now = self._clock()
        with self._lock:
            self._pauses += 1
            self.waiting_for = what
            if self._pauses == 1:
                self._phase_started = now
                if self._last_beat is not None:
                    self._arm(now, self.phase_limit())

    def resume(self) -> None:
        """Re-arm after ``pause``: the next step may also wait for rank 0's writes."""
        now = self._clock()
        with self._lock:
            self._pauses = max(0, self._pauses - 1)
            if self._pauses:
                return
            self.longest_phase_s = max(self.longest_phase_s, now - self._phase_started)
            if self._last_beat is None:
                return
            self._after_pause = True
            self.waiting_for = (f"training step {self.steps + 1} (its gradient allreduce, after "
                                "rank 0's end-of-epoch writes)")
            self._arm(now, 2 * self.limit())

    @contextlib.contextmanager
    def suspended(self, what: str) -> Iterator[None]:
        """``with watchdog.suspended("checkpoint write"):`` the phase gets the phase limit."""
        self.pause(what)
        try:
            yield
        finally:
            self.resume()

    def serve_heartbeat(self) -> int:
        """Answer other ranks' probes until ``stop``; returns the port."""
        self._heartbeat = Heartbeat()
        return self._heartbeat.port

    def gone_peers(self) -> list[str]:
        """``rank R on HOST`` for every other rank whose process has ended (see ``is_gone``);
        nothing once stopped, when the peers' ports may be closed for good reasons."""
        return [] if self._stopped.is_set() else peers_where(is_gone, list(self.peers))

    def stop(self) -> None:
        """Stop watching and serving (idempotent)."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._heartbeat is not None:
            self._heartbeat.close()

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
        silent = unanswered(self.peers)
        culprit = (f"no answer from {', '.join(silent)}" if silent else
                   "every other rank still answers" if self.peers else
                   "another rank, its node or the network stopped answering")
        stream.write(f"hvdtrain: error: {self.who} stalled: no training step finished for "
                     f"{silent_s:.0f} s (limit {self._armed_limit:.0f} s, --stall-timeout) while "
                     f"waiting for {self.waiting_for}; {culprit}; ending this rank "
                     f"(exit {STALLED_EXIT_CODE})\n")
        stream.flush()
        if self._exit is os._exit:
            end_open_mpi_daemon(os.getppid())
        self._exit(STALLED_EXIT_CODE)


@dataclass(frozen=True)
class Peer:
    """Another rank's heartbeat address."""

    rank: int
    host: str
    port: int


class Heartbeat:
    """A TCP port that answers every connection at once, from a daemon thread: a rank that
    stalled tells peers that wait like itself (they answer) from ones whose node vanished or
    whose process is gone or frozen (no answer)."""

    def __init__(self) -> None:
        self._socket = socket.create_server(("", 0), backlog=64)
        self.port = self._socket.getsockname()[1]
        threading.Thread(target=self._serve, name="hvdtrain-heartbeat", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            with connection:
                connection.sendall(b"alive\n")

    def close(self) -> None:
        try:   # wakes the thread's accept (closing alone would leave the port listening)
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()


def answers(peer: Peer, timeout_s: float) -> bool:
    try:
        with socket.create_connection((peer.host, peer.port), timeout=timeout_s) as connection:
            connection.settimeout(timeout_s)
            return connection.recv(6) == b"alive\n"
    except OSError:
        return False


def is_gone(peer: Peer) -> bool:
    """True only when the peer's host answers but nothing listens on its heartbeat port: its
    process has ended (a silent or slow host is not proof, so it is not gone)."""
    try:
        with socket.create_connection((peer.host, peer.port), timeout=PROBE_TIMEOUT_S):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def peers_where(test: Callable[[Peer], bool], peers: list[Peer]) -> list[str]:
    """``rank R on HOST`` for every peer that ``test`` (a probe) picks, probed in parallel so
    that silent hosts cost one probe timeout, not one each."""
    if not peers:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(peers))) as pool:
        picked = list(pool.map(test, peers))
    return [f"rank {peer.rank} on {peer.host}" for peer, yes in zip(peers, picked) if yes]


def unanswered(peers: list[Peer], timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """``rank R on HOST`` for every peer whose heartbeat does not answer."""
    return peers_where(lambda peer: not answers(peer, timeout_s), peers)


def end_open_mpi_daemon(parent: int) -> None:
    """End the Open MPI process that started this rank, if one did and it would wait for ever.

    Measured with a node cut off: mpirun (which starts the ranks of its own node) and orted
    (which mpirun starts on every other node over ssh, or srun under Slurm) both wait for the
    lost node's acknowledgement of the abort, until TCP gives up (about 15 minutes). mpirun
    answers a first SIGTERM with an "abort already in progress" and keeps waiting, so it gets
    SIGKILL, and so do the ssh and srun clients it started (they would wait for the lost node
    as long); its other nodes' orteds then lose their connection to it and end their ranks.

    Under orted the launcher is elsewhere, possibly outside the nodes, where no rank can end
    it. Ending orted makes mpirun start to end the job, and its messages to the lost node then
    wait for TCP's retransmissions; so when the launcher's keep-alive (``world.
    launcher_defaults``) will find the lost node soon and this rank's node still reaches the
    launcher, the rank leaves the ending to it (orted ends its ranks then) and ends orted only
    if that has not happened in time. A rank that cannot reach the launcher is on the lost side:
    its orted's own messages to mpirun are stuck, so it is ended at once. Slurm's and Gloo's
    launchers are left alone: they end a failed rank's job themselves.
    """
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        return
    if name not in ("orted", "mpirun", "orterun"):
        return
    time.sleep(OUTPUT_GRACE_S)   # the daemon forwards this rank's line first
    if name == "orted":
        window = keepalive_window_s()
        if window <= KEEPALIVE_WAIT_LIMIT_S and launcher_answers(os.environ):
            time.sleep(window + OUTPUT_GRACE_S)
            if os.getppid() != parent:   # orted is gone (and its pid may be another's now)
                return
        victims, signal_number = [parent], signal.SIGTERM
    else:
        victims = [parent] + children_named(parent, "ssh") + children_named(parent, "srun")
        signal_number = signal.SIGKILL
    for pid in victims:
        try:
            os.kill(pid, signal_number)
        except ProcessLookupError:
            pass


def launcher_answers(environ: Mapping[str, str]) -> bool:
    """True when this rank's mpirun (Open MPI's HNP, whose addresses Open MPI gives every rank
    in ``OMPI_MCA_orte_hnp_uri``) accepts a connection: this rank's node is still on the
    network. False when it does not answer, or its address is unknown."""
    uri = environ.get("OMPI_MCA_orte_hnp_uri", "")
    for addresses, port in re.findall(r"tcp://([^;\[]+):(\d+)", uri):
        for address in addresses.split(","):
            try:
                with socket.create_connection((address, int(port)), timeout=HNP_PROBE_S):
                    return True
            except OSError:
                continue
    return False


def children_named(parent: int, name: str) -> list[int]:
    """Pids of ``parent``'s children whose command is ``name`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        command, fields = text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1]
        if command == name and int(fields.split()[1]) == parent:
            found.append(int(stat.parent.name))
    return found
