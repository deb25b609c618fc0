"""The per-rank liveness monitor, single process with a hand-moved clock and a recorded exit
(the multi-node and stop tests prove it ends real jobs): the stall limit, phases, stop
requests and their tightened limit, and a run leaving no signal handler behind."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time

from conftest import rank_env

from hvdtrain.collectives import World, peer_unreachable
from hvdtrain.errors import STALLED_EXIT_CODE
from hvdtrain.liveness.peers import Heartbeat, Peer, is_gone, unanswered
from hvdtrain.liveness.watch import (FIRST_PHASE_S, FLOOR_S, PHASE_FACTOR, SAME_EVENT_S,
                                     STEP_FACTOR, STUCK_MIN_S, Liveness)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run_program(program: str) -> subprocess.CompletedProcess:
    """``program`` in a fresh Python process (real signals, its own handlers)."""
    return subprocess.run([sys.executable, "-c", program], env=rank_env(), text=True,
                          capture_output=True, timeout=50, stdin=subprocess.DEVNULL)


def advance(live: Liveness, clock: Clock, seconds: float) -> None:
    """Move the clock and let the monitor look once."""
    clock.now += seconds
    live.check()


def monitor(timeout: float | None = None, size: int = 4
            ) -> tuple[Liveness, Clock, list[int], io.StringIO]:
    clock, exits, stream = Clock(), [], io.StringIO()
    live = Liveness(timeout, exit=exits.append, stream=stream, clock=clock)
    live.attach(World(3 % size, size, host="node2"))
    return live, clock, exits, stream


def steps(live: Liveness, clock: Clock, count: int, seconds: float = 1.0) -> None:
    for _ in range(count):
        live.step_begins()
        clock.now += seconds
        live.step_ends()


def test_fires_once_after_the_limit_with_one_line_naming_the_rank():
    live, clock, exits, stream = monitor(timeout=10)
    live.step_ends()
    advance(live, clock, 9.9)
    assert exits == []
    advance(live, clock, 0.2)
    assert exits == [STALLED_EXIT_CODE] == [76]
    line, = stream.getvalue().splitlines()
    assert line.startswith("hvdtrain: error: rank 3 of 4 on node2 stalled: no training step "
                           "finished for 10 s (limit 10 s, --stall-timeout) while waiting for "
                           "training step 2 (its gradient allreduce)")


def test_not_armed_before_the_first_step():
    live, clock, exits, _ = monitor(timeout=10)
    clock.now += 3600                      # tracing and building the first step takes long
    live.check()
    assert exits == []


def test_automatic_limit_follows_the_slowest_step():
    live, clock, exits, _ = monitor()
    live.step_ends()
    assert live.limit() == FLOOR_S
    clock.now += 4.0                       # one slow step
    live.step_ends()
    clock.now += 1.0
    live.step_ends()
    assert live.slowest_step_s == 4.0 and live.limit() == STEP_FACTOR * 4.0
    advance(live, clock, STEP_FACTOR * 4.0 - 1)
    assert exits == []
    advance(live, clock, 2)
    assert exits == [STALLED_EXIT_CODE]


def test_a_phase_gets_its_own_limit_and_the_next_step_twice_the_limit():
    live, clock, exits, stream = monitor(timeout=10)
    live.step_ends()
    with live.phase("the end of epoch 1"):
        clock.now += FIRST_PHASE_S - 1     # the first phase traces validation: generous
        live.check()
        assert exits == [] and live.waiting_for == "the end of epoch 1"
    assert live.longest_phase_s == FIRST_PHASE_S - 1
    advance(live, clock, 19)
    assert exits == []                     # rank 0's writes may delay the next step
    live.step_ends()                       # that step does not count towards the limit
    assert live.slowest_step_s == 0.0
    advance(live, clock, 10.5)
    assert exits == [STALLED_EXIT_CODE]


def test_a_node_lost_during_a_phase_still_ends_the_rank():
    live, clock, exits, stream = monitor(timeout=10)
    live.step_ends()
    with live.phase("the end of epoch 1"):
        clock.now += 2.0
    live.step_ends()
    live.phase_begins("the end of epoch 2")   # a collective in validation never returns
    assert live.phase_limit() == max(10, PHASE_FACTOR * 2.0)
    advance(live, clock, 10.5)
    assert exits == [STALLED_EXIT_CODE]
    assert "while waiting for the end of epoch 2" in stream.getvalue()


def test_phases_nest():
    live, clock, exits, _ = monitor(timeout=10)
    live.step_ends()
    live.phase_begins("validation")
    live.phase_begins("checkpoint")
    live.phase_ends()
    advance(live, clock, 100)
    assert exits == []
    live.phase_ends()
    advance(live, clock, 21)
    assert exits == [STALLED_EXIT_CODE]


def test_one_rank_or_a_zero_limit_watches_no_stall():
    for timeout, size in ((None, 1), (0, 2)):
        live, clock, exits, _ = monitor(timeout, size)
        assert not live.watches_stalls
        live.step_ends()
        advance(live, clock, 10 * FIRST_PHASE_S)
        assert exits == []
    live, _, _, _ = monitor(None, 2)
    assert live.watches_stalls and live.who == "rank 1 of 2 on node2" and live.fixed_limit is None


def test_the_line_names_the_ranks_whose_heartbeat_does_not_answer():
    alive, gone = Heartbeat(), Heartbeat()
    gone.close()                            # a process that is no more: connection refused
    live, clock, exits, stream = monitor(timeout=10)
    live.peers = [Peer(1, "127.0.0.1", alive.port), Peer(2, "127.0.0.1", gone.port)]
    live.step_ends()
    advance(live, clock, 11)
    assert exits == [STALLED_EXIT_CODE]
    assert "; no answer from rank 2 on 127.0.0.1; ending this rank" in stream.getvalue()
    assert unanswered(live.peers[:1]) == []
    alive.close()


def test_a_peer_that_stopped_answering_ends_this_rank_as_a_stall_does():
    """TensorFlow's collectives fail with "stopped sending heartbeats" when another rank's node
    is lost (a cut within an epoch's end can pass their 30 s before the phase limit): the rank
    leaves as from a stall, one line and exit 76 (so its launcher is ended, not left waiting
    for the lost node); a rank that watches no stalls leaves it to the ordinary error path."""
    error = RuntimeError("The following tasks are unhealthy (stopped sending heartbeats):\n"
                         "/job:worker/replica:0/task:1")
    assert peer_unreachable(error) and not peer_unreachable(
        RuntimeError("Horovod has been shut down"))
    live, _, exits, stream = monitor(timeout=10)
    live.peer_unreachable(error)
    assert exits == [STALLED_EXIT_CODE]
    assert stream.getvalue() == (
        "hvdtrain: error: rank 3 of 4 on node2 lost another rank (The following tasks are "
        "unhealthy (stopped sending heartbeats):); its node may be gone; ending this rank "
        "(exit 76)\n")
    quiet, _, quiet_exits, _ = monitor(0, 2)
    quiet.peer_unreachable(error)
    assert quiet_exits == []


def test_a_stop_request_tightens_the_limit_on_a_stuck_step():
    """Without a request a step may run the stall limit (here 1000 s); once a stop is
    requested, one that runs ten times the slowest step (at least STUCK_MIN_S) is stuck."""
    live, clock, exits, stream = monitor(timeout=1000)
    steps(live, clock, 3)
    live.step_begins()
    advance(live, clock, STUCK_MIN_S + 1)
    assert exits == []
    live.request("SIGTERM", 128 + signal.SIGTERM)
    live.check()
    assert exits == [128 + signal.SIGTERM]
    assert stream.getvalue() == ("hvdtrain: stop requested (SIGTERM) but this rank's step has "
                                 "not ended for 11 s: another rank is gone or stuck; exiting "
                                 "now, without a checkpoint\n")


def test_the_step_after_an_epochs_end_is_not_judged_stuck_after_a_stop_request():
    """That step waits for rank 0's end-of-epoch writes (or traces again at a new ``fit``
    call): a long one is not a stuck one; the stall limit (twice the limit there) bounds it."""
    live, clock, exits, stream = monitor(timeout=100)
    steps(live, clock, 3)
    with live.phase("the end of epoch 1"):
        clock.now += 1
    live.request("SIGUSR1", 128 + signal.SIGUSR1)
    live.step_begins()
    advance(live, clock, 5 * STUCK_MIN_S)
    assert exits == [] and stream.getvalue() == ""
    advance(live, clock, 200)
    assert exits == [STALLED_EXIT_CODE]


def test_a_stop_request_between_steps_asks_whether_a_peer_has_ended():
    ended = Heartbeat()
    ended.close()
    live, clock, exits, stream = monitor(timeout=1000)
    live.peers = [Peer(1, "127.0.0.1", ended.port)]
    steps(live, clock, 3)
    live.phase_begins("the end of epoch 1")     # validation: no step runs
    live.request("SIGUSR1", 128 + signal.SIGUSR1)
    advance(live, clock, 4)
    assert exits == []
    advance(live, clock, 2)
    assert exits == [128 + signal.SIGUSR1]
    assert "has waited 6 s between steps (validation, checkpoint or setup) for rank 1 on " \
           "127.0.0.1, whose process has ended" in stream.getvalue()


def test_a_peer_that_left_after_the_stop_checkpoint_began_is_not_a_stop_that_cannot_be_reached():
    """Once every rank enters the stop checkpoint's last collective, a faster rank may leave
    (75) while this one finishes: its ended process is expected, so this rank does not end
    itself for it (CI: ranks did, with 138 and no line). The stall limit still holds."""
    ended = Heartbeat()
    ended.close()
    live, clock, exits, stream = monitor(timeout=60)
    live.peers = [Peer(1, "127.0.0.1", ended.port)]
    steps(live, clock, 3)
    live.request("SIGUSR1", 128 + signal.SIGUSR1)
    live.stop_checkpoint_begins()
    advance(live, clock, 30)
    assert exits == [] and stream.getvalue() == ""
    advance(live, clock, 31)
    assert exits == [STALLED_EXIT_CODE], stream.getvalue()


def test_a_rank_whose_training_ended_still_answers_until_its_run_ends():
    """A rank that has ended its training (the last epoch's end, the final validation ahead)
    keeps serving its heartbeat, so a peer still in its epoch end with a stop request does not
    take it for gone; ``uninstall`` closes the port."""
    served: list[tuple[str, int]] = []

    def exchange(address: tuple[str, int]) -> list[tuple[str, int]]:
        served.append(address)
        return [address, ("127.0.0.1", 1)]

    world = World(0, 2, host="127.0.0.1")
    live = Liveness(60, install_signals=False)
    live.attach(world)
    live.install()
    live.connect_peers(exchange, world)
    itself = Peer(0, *served[0])
    live.training_ended()
    assert not is_gone(itself)
    live.uninstall()
    assert is_gone(itself)


def test_requests_close_together_are_one_and_a_later_one_ends_at_once():
    live, clock, exits, stream = monitor()
    live.request("SIGTERM", 143)
    clock.now += SAME_EVENT_S - 0.1
    live.request("SIGUSR1", 138)
    assert exits == [] and live.stop_reason == "SIGTERM"
    clock.now += 0.2
    live.request("SIGUSR1", 138)
    assert exits == [138]
    assert stream.getvalue() == ("hvdtrain: second stop request (SIGUSR1) after SIGTERM: "
                                 "exiting now, without a checkpoint\n")


def test_the_end_after_the_time_limit_warning_still_stops_at_a_step():
    """Slurm's SIGTERM seconds after its SIGUSR1 warning is the same stop (a loaded controller
    sent them seconds apart in CI): the rank keeps going to its checkpoint; one more ends it."""
    live, clock, exits, stream = monitor()
    live.request("SIGUSR1", 138)
    clock.now += 5
    live.request("SIGTERM", 143)
    assert exits == [] and live.stop_reason == "SIGUSR1"
    clock.now += 5
    live.request("SIGTERM", 143)
    assert exits == [143]
    assert stream.getvalue() == ("hvdtrain: second stop request (SIGTERM) after SIGUSR1: "
                                 "exiting now, without a checkpoint\n")


def test_the_thread_fires_on_its_own_and_uninstall_closes_the_heartbeat():
    exits, stream = [], io.StringIO()
    live = Liveness(0.2, exit=exits.append, stream=stream, poll_s=0.05)
    live.attach(World(0, 2, host="node1"))
    with live.installed():
        live.connect_peers(lambda mine: [mine, ("127.0.0.1", 1)], World(0, 2, host="node1"))
        port = live._heartbeat.port
        live.step_ends()
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    assert exits == [STALLED_EXIT_CODE] and "rank 0 of 2 on node1 stalled" in stream.getvalue()
    assert unanswered([Peer(1, "127.0.0.1", port)]) == ["rank 1 on 127.0.0.1"]


def test_a_run_in_process_leaves_the_signal_handlers_as_it_found_them():
    """Installed for a run and uninstalled after it: the handlers and wakeup fd from before
    are back (a notebook's, pytest's), and a SIGTERM during the run was only a request."""
    before = {number: signal.getsignal(number) for number in
              (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    live = Liveness()
    with live.installed():
        signal.raise_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while live.stop_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert live.stop_reason == "SIGUSR1"
    assert {number: signal.getsignal(number) for number in before} == before
    assert signal.set_wakeup_fd(-1) == -1
    assert live._thread is None


def test_after_a_run_that_ends_the_process_the_stop_signals_are_ignored():
    program = ("import os, signal, time\n"
               "from hvdtrain.liveness.watch import AfterRun, Liveness\n"
               "with Liveness(after_run=AfterRun.IGNORE).installed():\n"
               "    pass\n"
               "os.kill(os.getpid(), signal.SIGTERM)\n"
               "time.sleep(0.5)\n"
               "print('still here', flush=True)\n")
    result = run_program(program)
    assert result.returncode == 0 and result.stdout == "still here\n", result.stderr


def test_a_second_stop_request_ends_the_process_at_once():
    """Two signals together are one request; one more, later, ends the process at once even
    while its main thread is blocked (here: sleeping), and its line reaches stderr although
    the command line's filter of native notices holds file descriptor 2."""
    program = ("import os, signal, time\n"
               "from hvdtrain.liveness.watch import Liveness\n"
               "from hvdtrain.startup import hide_native_notices\n"
               "hide_native_notices()\n"
               "live = Liveness()\n"
               "live.install()\n"
               "os.kill(os.getpid(), signal.SIGTERM)\n"
               "os.kill(os.getpid(), signal.SIGUSR1)\n"
               "time.sleep(0.5)\n"
               "print('first:', live.stop_reason, flush=True)\n"
               "time.sleep(3.5)\n"
               "os.kill(os.getpid(), signal.SIGUSR1)\n"
               "time.sleep(60)\n")
    result = run_program(program)
    assert result.stdout == "first: SIGTERM\n", result.stdout + result.stderr
    assert result.returncode == 128 + signal.SIGUSR1
    assert result.stderr == ("hvdtrain: second stop request (SIGUSR1) after SIGTERM: exiting "
                             "now, without a checkpoint\n")


def test_a_stop_request_stuck_behind_an_ended_rank_leaves_within_seconds():
    """srun's --kill-on-bad-exit sends SIGTERM to the survivors of a dead rank, and they wait in
    a collective that can never finish: the stop path asks the heartbeat ports and leaves as
    soon as one refuses (a process that has ended), long before the 10 s stuck limit or
    Slurm's SIGKILL. A peer that still answers is not blamed."""
    program = ("import os, signal, time\n"
               "from hvdtrain.liveness.peers import Heartbeat, Peer\n"
               "from hvdtrain.liveness.watch import Liveness\n"
               "alive, ended = Heartbeat(), Heartbeat()\n"
               "ended.close()\n"
               "live = Liveness()\n"
               "live.peers = [Peer(1, '127.0.0.1', alive.port), Peer(2, '127.0.0.1', ended.port)]\n"
               "live.install()\n"
               "for _ in range(3):\n"
               "    live.step_begins(); time.sleep(0.05); live.step_ends()\n"
               "live.step_begins()\n"
               "os.kill(os.getpid(), signal.SIGTERM)\n"
               "print('stuck at', time.monotonic(), flush=True)\n"
               "time.sleep(60)\n")
    began = time.monotonic()
    result = run_program(program)
    stuck_at = float(result.stdout.split()[-1])
    assert result.returncode == 128 + signal.SIGTERM, result.stdout + result.stderr
    assert 2 <= time.monotonic() - stuck_at < 8 and stuck_at > began
    assert re.fullmatch(r"hvdtrain: stop requested \(SIGTERM\) but this rank's step has waited "
                        r"\d+ s for rank 2 on 127\.0\.0\.1, whose process has ended; exiting "
                        r"now, without a checkpoint\n", result.stderr), result.stderr


def test_a_step_traced_again_is_untimed_and_leaves_the_epoch_ends_limit():
    """--bucket-choice measured traces the step again: that step gets a first phase's time,
    is not the slowest step, and the first epoch end still gets the first phase's limit."""
    live, clock, exits, stream = monitor()
    steps(live, clock, 3)
    live.next_step_traces()
    live.step_begins()
    advance(live, clock, 60)          # a long trace: within the first phase's limit
    live.step_ends()
    assert exits == [] and live.slowest_step_s < 2
    assert live.phase_limit() == FIRST_PHASE_S
