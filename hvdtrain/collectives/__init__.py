"""The rank seam: rank facts, device placement and the collective operations of a data-parallel
run, behind one ``Collectives`` protocol with three backends (Horovod, TensorFlow's collective
ops, a world of one). Nothing outside this package talks to a backend directly, so most of
hvdtrain and its tests run in one process without MPI. ``world`` holds the rank facts and
device placement; ``base`` the protocol, the bucketed ``GradientReduction`` and the world of
one; ``horovod_backend`` (the one module that imports Horovod) and ``tensorflow_backend`` (over
``tf_graph_mode`` and ``tf_messages``) the two backends; this module picks one
(``init_collectives``).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from hvdtrain.collectives.base import (Collectives, GradientReduction, LocalCollectives,
                                       assign_across_ranks, chief_decides, differentiable_sum,
                                       ended_by_another_rank, gathered_at_chief, gathered_rows,
                                       peer_unreachable, raised_here, static_bytes,
                                       summed_across_ranks, tf_variables, variable_bytes)
from hvdtrain.collectives.horovod_backend import HorovodCollectives, horovod_usable
from hvdtrain.collectives.world import World, cpu_threads_per_rank, place_devices
from hvdtrain.errors import first_sentence
from hvdtrain.launchers import launched_by_a_launcher

__all__ = ["BACKENDS", "Collectives", "GradientReduction", "LocalCollectives", "World",
           "assign_across_ranks", "chief_decides", "chosen_backend", "cpu_threads_per_rank",
           "differentiable_sum", "ended_by_another_rank", "gathered_at_chief", "gathered_rows",
           "init_collectives", "peer_unreachable", "place_devices", "raised_here",
           "static_bytes", "summed_across_ranks", "tf_variables", "variable_bytes"]

BACKENDS = ("auto", "horovod", "tensorflow")


def chosen_backend(requested: str, environ: Mapping[str, str] | None = None
                   ) -> tuple[str, str]:
    """(backend, why) for a launched job: ``requested`` (the config's ``backend``), else
    ``HVDTRAIN_BACKEND``, else auto: Horovod where it is installed and loads, TensorFlow's
    collectives otherwise."""
    env = os.environ if environ is None else environ
    if requested == "auto":
        requested = env.get("HVDTRAIN_BACKEND", "auto").lower()
        if requested not in BACKENDS:
            requested = "auto"
    if requested != "auto":
        return requested, "as asked"
    problem = horovod_usable()
    if problem is None:
        return "horovod", "auto: Horovod is installed and loads"
    return "tensorflow", f"auto: Horovod is not usable here ({first_sentence(problem)})"


def init_collectives(backend: str = "auto", prepare: Callable[[World], Any] = lambda world: None,
                     environ: Mapping[str, str] | None = None) -> Collectives:
    """The backend's collectives when a launcher started us (``chosen_backend``), a world of one
    otherwise; ``prepare(world)`` (device placement) runs once the rank facts are known and
    before TensorFlow's runtime starts."""
    collectives: Any
    if not launched_by_a_launcher(environ):
        collectives = LocalCollectives()
        prepare(collectives.world)
        return collectives
    name, why = chosen_backend(backend, environ)
    if name == "tensorflow":
        from hvdtrain.collectives.tensorflow_backend import tensorflow_collectives

        collectives = tensorflow_collectives(prepare)
    else:
        collectives = HorovodCollectives()
        prepare(collectives.world)
    collectives.chosen = why
    return collectives
