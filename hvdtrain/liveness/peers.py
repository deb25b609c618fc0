"""The probes of peers that tell a slow rank from a dead one: each rank serves a heartbeat port
(``Heartbeat``) and learns the others' (``Peer``); a peer that answers waits like this rank, one
whose host refuses the connection has ended (``is_gone``), one that does not answer at all may be
gone, frozen or cut off (``unanswered``). The liveness monitor (``watch``) asks them.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

PROBE_TIMEOUT_S = 3.0


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
