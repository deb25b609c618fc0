"""The step-progress watchdog, single process with a hand-moved clock (the multi-node tests
prove it ends a real job whose node vanished)."""

from __future__ import annotations

import io
import time

from hvdtrain.errors import STALLED_EXIT_CODE
from hvdtrain.training.watchdog import (FIRST_PHASE_S, FLOOR_S, PHASE_FACTOR, STEP_FACTOR,
                                        Heartbeat, Peer, StepWatchdog, stopped_after,
                                        unanswered, watchdog_for)
from hvdtrain.world import World


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdog(timeout: float | None = None) -> tuple[StepWatchdog, Clock, list[int], io.StringIO]:
    clock, exits, stream = Clock(), [], io.StringIO()
    dog = StepWatchdog("rank 3 of 4 on node2", timeout, exit=exits.append, stream=stream,
                       clock=clock)
    return dog, clock, exits, stream


def test_fires_once_after_the_limit_with_one_line_naming_the_rank():
    dog, clock, exits, stream = watchdog(timeout=10)
    dog.beat()
    clock.now += 9.9
    assert not dog.check() and exits == []
    clock.now += 0.2
    assert dog.check() and exits == [STALLED_EXIT_CODE] == [76]
    line, = stream.getvalue().splitlines()
    assert line.startswith("hvdtrain: error: rank 3 of 4 on node2 stalled: no training step "
                           "finished for 10 s (limit 10 s, --stall-timeout) while waiting for "
                           "training step 2 (its gradient allreduce)")


def test_not_armed_before_the_first_step():
    dog, clock, exits, _ = watchdog(timeout=10)
    clock.now += 3600                      # tracing and building the first step takes long
    assert not dog.check() and exits == []


def test_automatic_limit_follows_the_slowest_step():
    dog, clock, exits, _ = watchdog()
    dog.beat()
    assert dog.limit() == FLOOR_S
    clock.now += 4.0                       # one slow step
    dog.beat()
    clock.now += 1.0
    dog.beat()
    assert dog.slowest_step_s == 4.0 and dog.limit() == STEP_FACTOR * 4.0
    clock.now += STEP_FACTOR * 4.0 - 1
    assert not dog.check()
    clock.now += 2
    assert dog.check() and exits == [STALLED_EXIT_CODE]


def test_a_phase_gets_its_own_limit_and_the_next_step_twice_the_limit():
    dog, clock, exits, stream = watchdog(timeout=10)
    dog.beat()
    with dog.suspended("the end of epoch 1"):
        clock.now += FIRST_PHASE_S - 1     # the first phase traces validation: generous
        assert not dog.check()
        assert dog.waiting_for == "the end of epoch 1"
    assert dog.longest_phase_s == FIRST_PHASE_S - 1
    clock.now += 19
    assert not dog.check()                 # rank 0's writes may delay the next step
    dog.beat()                             # that step does not count towards the limit
    assert dog.slowest_step_s == 0.0
    clock.now += 10.5
    assert dog.check() and exits == [STALLED_EXIT_CODE]


def test_a_node_lost_during_a_phase_still_ends_the_rank():
    dog, clock, exits, stream = watchdog(timeout=10)
    dog.beat()
    with dog.suspended("the end of epoch 1"):
        clock.now += 2.0
    dog.beat()
    dog.pause("the end of epoch 2")        # a collective in validation never returns
    assert dog.phase_limit() == max(10, PHASE_FACTOR * 2.0)
    clock.now += 10.5
    assert dog.check() and exits == [STALLED_EXIT_CODE]
    assert "while waiting for the end of epoch 2" in stream.getvalue()


def test_pauses_nest():
    dog, clock, exits, _ = watchdog(timeout=10)
    dog.beat()
    dog.pause("validation")
    dog.pause("checkpoint")
    dog.resume()
    clock.now += 100
    assert not dog.check()
    dog.resume()
    clock.now += 21
    assert dog.check()


def test_the_thread_fires_on_its_own():
    exits, stream = [], io.StringIO()
    dog = StepWatchdog("rank 0 of 2 on node1", 0.2, exit=exits.append, stream=stream,
                       poll_s=0.05)
    dog.start()
    dog.beat()
    dog._thread.join(timeout=10)
    assert exits == [STALLED_EXIT_CODE] and "rank 0 of 2 on node1 stalled" in stream.getvalue()
    dog.stop()


def test_stopped_after_an_error_it_never_fires_and_closes_its_port():
    exits = []
    dog = StepWatchdog("rank 0 of 2 on node1", 0.1, exit=exits.append, poll_s=0.02)
    port = dog.serve_heartbeat()
    try:
        with stopped_after(dog):
            dog.start()
            dog.beat()
            raise KeyError("an error out of fit")
    except KeyError:
        pass
    time.sleep(0.3)
    assert exits == [] and unanswered([Peer(1, "127.0.0.1", port)]) == ["rank 1 on 127.0.0.1"]


def test_one_rank_or_zero_means_no_watchdog():
    assert watchdog_for(World(), None) is None
    assert watchdog_for(World(0, 2), 0) is None
    dog = watchdog_for(World(1, 2, host="node2"), None)
    assert dog.who == "rank 1 of 2 on node2" and dog.fixed_limit is None


def test_the_line_names_the_ranks_whose_heartbeat_does_not_answer():
    alive, gone = Heartbeat(), Heartbeat()
    gone.close()                            # a process that is no more: connection refused
    dog, clock, exits, stream = watchdog(timeout=10)
    dog.peers = [Peer(1, "127.0.0.1", alive.port), Peer(2, "127.0.0.1", gone.port)]
    dog.beat()
    clock.now += 11
    assert dog.check()
    assert "; no answer from rank 2 on 127.0.0.1; ending this rank" in stream.getvalue()
    assert unanswered(dog.peers[:1]) == []
    alive.close()
