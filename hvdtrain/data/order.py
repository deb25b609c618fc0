"""Shards of a user's ``tf.data`` dataset never overlap: the same order on every rank, or a
refusal before training.

hvdtrain shards a user's dataset by position (rank r keeps elements, or batches, r, r+N, ...),
which splits it into disjoint parts only if every rank reads it in the same order. An unseeded
``shuffle`` built before ``hvdtrain.fit`` draws its seed afresh in every process: sharded, about
a quarter of the examples would be trained twice per epoch and a quarter never (measured: 254,
516 and 254 of 1,024 examples seen never, once and twice on 2 ranks). ``check_same_order``
runs two checks on every rank, for the training and the validation dataset:

* **The pipeline's randomness** (no data read): a ``shuffle``, ``Dataset.random`` or
  ``sample_from_datasets`` whose two seeds are both 0 (TensorFlow's mark for "seed this op
  from nothing"), or a parallel ``map`` with ``deterministic=False`` (its order follows timing).
* **A fingerprint of the first elements**, compared across ranks: what the graph does not show
  (a generator that draws its own random numbers). It hashes the targets and sample weights, or
  the features where there are no targets: a random augmentation of the features differs per
  rank in one process too, and moves no example to another rank.

A dataset that fails either is refused on every rank with one line naming the fixes: seed the
shuffle, or pass a function that builds the dataset (``x=make_dataset``), which hvdtrain calls
inside the run after giving every rank the same seeds, so an unseeded shuffle in it is the same
everywhere. Both checks read a dataset the same number of times on every rank (see
``hvdtrain.data.equal_steps`` on why that matters).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import tensorflow as tf

from hvdtrain.errors import AgreedError
from hvdtrain.keras_internals import unseeded_randomness

# Elements (unbatched) or batches whose fingerprint is compared.
FIRST_ELEMENTS = 64
FIRST_BATCHES = 2


def fingerprint(dataset: tf.data.Dataset, batched: bool,
                parts: Callable[[Any], tuple[Any, Any, Any]]) -> str:
    """A digest of the dataset's first elements: their targets and sample weights, or their
    features where there are none. ``parts``: an element as Keras' ``(x, y, sample_weight)``."""
    digest = hashlib.sha256()
    for element in dataset.take(FIRST_BATCHES if batched else FIRST_ELEMENTS):
        x, y, sample_weight = parts(element)
        chosen = (y, sample_weight) if y is not None else x
        for leaf in tf.nest.flatten(chosen, expand_composites=True):
            if leaf is not None:
                digest.update(tf.io.serialize_tensor(leaf).numpy())
    return digest.hexdigest()


def order_facts(dataset: tf.data.Dataset, batched: bool,
                parts: Callable[[Any], tuple[Any, Any, Any]]) -> tuple[str | None, str | None]:
    """(what in the pipeline draws unseeded randomness, or None; the fingerprint, or None when
    the first already refuses it)."""
    found = unseeded_randomness(dataset)
    return found, None if found else fingerprint(dataset, batched, parts)


def refusal(what: str, facts: list[tuple[str | None, str | None]]) -> str | None:
    """The one-line refusal for every rank's ``order_facts`` (None: the order is the same)."""
    fixes = ("give the shuffle a seed (shuffle(n, seed=1)), or pass a function that builds the "
             "dataset (x=make_dataset), which hvdtrain calls after seeding every rank alike")
    found = next((reason for reason, _ in facts if reason), None)
    if found:
        return (f"the {what} dataset's order differs on every rank ({found}, built before "
                f"hvdtrain.fit), so its shards would overlap; {fixes}")
    if len({digest for _, digest in facts}) > 1:
        return (f"the {what} dataset's first elements differ across ranks (already sharded "
                "per rank, or random per process), so hvdtrain's shards of it would overlap or "
                f"miss examples; give every rank the whole dataset (hvdtrain shards it), {fixes}")
    return None


def check_same_order(dataset: tf.data.Dataset, batched: bool,
                     parts: Callable[[Any], tuple[Any, Any, Any]], what: str,
                     allgather_object: Callable[[Any], list]) -> None:
    """Refuse, on every rank alike, a dataset whose order differs across ranks (module doc)."""
    line = refusal(what, allgather_object(order_facts(dataset, batched, parts)))
    if line:
        raise AgreedError(line)
