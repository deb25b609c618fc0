"""Shards of a user's ``tf.data`` dataset never overlap: the same order on every rank, or a
refusal before training.

hvdtrain shards a user's dataset by position, which is a partition only if every rank reads it
in the same order; an unseeded ``shuffle`` built before ``hvdtrain.fit`` is not (on 2 ranks a
quarter of the examples trained twice, a quarter never). ``check_same_order`` looks for unseeded
randomness in the pipeline's graph and compares a fingerprint of the first elements (targets,
or features where there are none) across ranks, and refuses on every rank with one line naming
the fixes: seed the shuffle, or pass a function that builds the dataset.
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
             "dataset (x=make_dataset), which hvdtrain calls with rank 0's random state on every "
             "rank")
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
