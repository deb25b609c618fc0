"""A scripted stand-in for ``hvdtrain.collectives.Collectives``: one process plays rank R of N.

Every rank must call the same collectives in the same order, and the agreement logic around
them (rank 0 decides, every rank takes its answer; the ranks sum their votes; pad to the most
steps) is where a multi-rank bug hides. ``ScriptedCollectives`` lets a single-process test
play any one rank of that exchange: the test scripts, call by call, what the other ranks send
(``Broadcast``, ``Gather``, ``Sum``, ``Variables``), the fake answers this rank's calls from the
script, checks that they come in the scripted order, and records what this rank sent
(``sent``). Objects travel through pickle, as Horovod's object collectives do, so a value this
rank could not send, or a result it shares with the sender, fails here too.

A run of rank 0 can script a run of rank 1: ``sent`` holds what rank 0 broadcast and gathered.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import tensorflow as tf

from hvdtrain.collectives import GradientReduction, World


@dataclass(frozen=True)
class Broadcast:
    """One ``broadcast_object``: the root's object. On the root itself leave ``value`` out: the
    root gets its own object back."""

    value: Any = None


@dataclass(frozen=True)
class Gather:
    """One ``allgather_object``: the other ranks' objects, by rank."""

    others: dict[int, Any]


# The tensors one other rank adds to an allreduce, or a function of this rank's tensors that
# gives them (its gradients shaped like this rank's, say, and a vote of its own).
Contribution = Union[Sequence[Any], Callable[[list[Any]], Sequence[Any]]]


@dataclass(frozen=True)
class Sum:
    """One ``allreduce_sum`` or ``reduce_gradients``: each other rank's tensors, in the order
    this rank sends its own."""

    others: Sequence[Contribution]


@dataclass(frozen=True)
class Variables:
    """One ``broadcast_variables``: the root's values (None: leave the variables as they are,
    as on the root itself)."""

    values: Sequence[Any] | None = None


Entry = Union[Broadcast, Gather, Sum, Variables]


@dataclass(frozen=True)
class Sent:
    """What this rank handed to one collective: its name and this rank's value."""

    call: str
    value: Any


def _wire(obj: Any) -> Any:
    """``obj`` as another process receives it."""
    return pickle.loads(pickle.dumps(obj))


@dataclass
class ScriptedCollectives:
    """Rank ``rank`` of ``size``; its collectives answered from ``script``, in order."""

    rank: int
    size: int
    script: list[Entry]
    sent: list[Sent] = field(default_factory=list)
    left_job: bool = False

    def __post_init__(self) -> None:
        self.world = World(self.rank, self.size, self.rank, self.size, 0, 1, "fake-host")
        self.script = list(self.script)

    def _next(self, call: str, kind: type) -> Any:
        number = len(self.sent)
        if not self.script:
            raise AssertionError(f"rank {self.rank} called {call} (collective {number + 1}), "
                                 "after the script's last entry")
        entry = self.script.pop(0)
        if not isinstance(entry, kind):
            raise AssertionError(f"rank {self.rank} called {call} (collective {number + 1}); "
                                 f"the script expected {type(entry).__name__} there")
        return entry

    def unused(self) -> list[Entry]:
        """The script's entries this rank has not reached (a collective it skipped)."""
        return list(self.script)

    def calls(self) -> list[str]:
        return [sent.call for sent in self.sent]

    def values(self, call: str) -> list[Any]:
        """What this rank sent to each ``call``, in order."""
        return [sent.value for sent in self.sent if sent.call == call]

    # --- the Collectives protocol ----------------------------------------------------------

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        entry = self._next("broadcast_object", Broadcast)
        self.sent.append(Sent("broadcast_object", _wire(obj)))
        if self.rank == root_rank:
            assert entry.value is None, "the root receives its own object, not a scripted one"
            return _wire(obj)
        return _wire(entry.value)

    def allgather_object(self, obj: Any) -> list[Any]:
        entry = self._next("allgather_object", Gather)
        assert sorted(entry.others) == [r for r in range(self.size) if r != self.rank], (
            f"a Gather for rank {self.rank} of {self.size} lists every other rank")
        self.sent.append(Sent("allgather_object", _wire(obj)))
        everyone = {**entry.others, self.rank: obj}
        return [_wire(everyone[rank]) for rank in range(self.size)]

    def allreduce_sum(self, tensors: Sequence[Any]) -> list[Any]:
        return self._sum("allreduce_sum", list(tensors), 1.0)

    def reduce_gradients(self, tensors: Sequence[Any],
                         reduction: GradientReduction = GradientReduction()) -> list[Any]:
        if reduction.op == "adasum":
            raise NotImplementedError("the fake sums; script Adasum where a test needs it")
        scale = reduction.prescale * reduction.postscale / (
            self.size if reduction.op == "average" else 1)
        return self._sum("reduce_gradients", list(tensors), scale)

    def broadcast_variables(self, variables: Sequence[Any], root_rank: int = 0) -> None:
        assert root_rank == 0, "hvdtrain broadcasts from rank 0"
        entry = self._next("broadcast_variables", Variables)
        self.sent.append(Sent("broadcast_variables", [v.numpy() for v in variables]))
        if self.rank == root_rank or entry.values is None:
            return
        assert len(entry.values) == len(variables), "one value for each variable"
        for variable, value in zip(variables, entry.values):
            variable.assign(value)

    def shutdown(self) -> None:
        self.left_job = True

    # --- sums ------------------------------------------------------------------------------

    def _sum(self, call: str, mine: list[Any], scale: float) -> list[Any]:
        """Each tensor plus the other ranks' at its place, times ``scale`` (Horovod's pre- and
        postscale, and the division of an average)."""
        entry = self._next(call, Sum)
        assert len(entry.others) == self.size - 1, "a Sum lists every other rank's tensors"
        self.sent.append(Sent(call, [None if t is None else tf.convert_to_tensor(t).numpy()
                                     for t in mine]))
        others = [list(c(mine) if callable(c) else c) for c in entry.others]
        assert all(len(tensors) == len(mine) for tensors in others), (
            f"every rank sends {len(mine)} tensors to this {call}")
        total = []
        for index, tensor in enumerate(mine):
            if tensor is None:           # a None gradient stays None on every rank
                total.append(None)
                continue
            tensor = tf.convert_to_tensor(tensor)
            summed = tf.add_n([tensor, *(tf.cast(tensors[index], tensor.dtype)
                                         for tensors in others)])
            total.append(summed if scale == 1.0 else summed * scale)
        return total
