"""How a run reads its data: the shard specs of training and validation, the passes each epoch
trains on, and the checks that come first (one order on every rank, a count every rank agrees
on). The mechanisms are the data package's (``hvdtrain.data.equal_steps``,
``hvdtrain.data.order``); this module applies them to one run's config and world.

Built-in sources and arrays give every rank the same steps by construction and need no
collective here (an elastic rank joining a running job starts here and must meet none); a
user's dataset or pipeline is checked and counted on every rank, and the ranks agree. Every
refusal here is reached by every rank alike (``AgreedError``): no peer is left waiting, and
the job's collectives stay usable for a next run in the same processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import tensorflow as tf

from hvdtrain.collectives import Collectives
from hvdtrain.config import Config
from hvdtrain.data.contract import DataBundle, Split
from hvdtrain.data.equal_steps import Passes, agreed_steps, left_out_line
from hvdtrain.data.files import FileSplit
from hvdtrain.data.pipeline import ShardSpec, real_rows_only
from hvdtrain.errors import AgreedError


def resolved_remainder(config: Config, own_step: str | None, planned: bool = True) -> str:
    """``--remainder auto``: pad. A model's own step trains the last partial global batch of
    planned data (in memory or files: it is spread over the ranks, each rank's step sees its
    real rows and the optimizers weight each rank's gradients by them); a user's dataset, whose
    ranks count their own batches, would fill a short rank with a filler batch the model's own
    metrics would count, so there every rank stops at the fewest whole batches (drop)."""
    remainder = config.data.remainder
    unweighted = config.optim.zero_stage or config.optim.reduction == "adasum"
    cannot_pad = own_step is not None and (not planned or unweighted)
    if cannot_pad and remainder == "pad":
        why = ("under --zero-stage or Adasum its optimizers combine the ranks' gradients "
               "unweighted, so a rank's short last batch would count as much as a whole one"
               if planned else
               "a short rank of this data would repeat a batch at weight zero, which its own "
               "metrics would count")
        raise AgreedError(f"--remainder pad cannot be exact for the model's own step "
                          f"({own_step}): {why}; use --remainder drop (or auto)")
    if remainder == "auto":
        return "drop" if cannot_pad else "pad"
    return remainder


@dataclass(frozen=True)
class DataPlan:
    """The training shard spec (its ``steps_per_epoch``: the steps of one pass, agreed), the
    passes each epoch reads, the validation shard spec (None: no validation), and what rank 0
    says about the plan."""

    spec: ShardSpec
    passes: Passes
    val_spec: ShardSpec | None
    notes: tuple[str, ...] = ()
    # Rows of this rank's first batch (read by the probe): a pre-batched dataset's batch size.
    first_rows: int | None = None
    epochs: int = 1       # the run's last epoch (exclusive), as Keras' ``epochs``

    def updates_per_epoch(self, accumulation_steps: int) -> int:
        """Optimizer updates in an average epoch of the run, for the rate schedule's lengths
        (epochs differ where ``steps_per_epoch`` does not divide a pass)."""
        lengths = self.passes.epoch_lengths(self.passes.first_epoch, self.epochs)
        return max(1, round(sum(lengths) / len(lengths) / accumulation_steps))

    def describe_step(self, epoch: int, batch: int) -> str:
        """Which batch a step of ``epoch`` trained on, in words for an error note."""
        pass_index, offset, _ = self.passes.start(epoch)
        position = offset + batch
        counts = self.spec.rank_counts
        own = None if counts is None else counts[self.spec.world.rank]
        if own is not None and position >= own:
            return (f"a repeat of the data's first batch at loss weight zero (this rank's pass "
                    f"has {own} batches; every rank runs {self.passes.pass_steps})")
        return (f"batch {position + 1} of this rank's pass {pass_index + 1} over the training "
                "data, as given")

    def global_batch(self, split: Split) -> tuple[int, bool]:
        """(the global batch, whether it is the data's own): a pre-batched dataset's batches
        are the user's (the first one's size), times the ranks; else ``--batch-size`` times
        the ranks."""
        spec = self.spec
        if getattr(split, "batched", False) and self.first_rows is not None:
            return spec.world.size * self.first_rows, True
        return spec.global_batch, False

    def describe(self, split: Split) -> str:
        """The run log's words for the training data: examples, steps and the real global
        batch."""
        spec, passes = self.spec, self.passes
        steps = (f"{passes.steps_per_epoch} steps/epoch (steps_per_epoch; a pass is "
                 f"{'endless' if passes.pass_steps is None else passes.pass_steps})"
                 if passes.steps_per_epoch else f"{passes.pass_steps} steps/epoch")
        size, own = self.global_batch(split)
        batch = (f"global batch {spec.world.size} x {size // spec.world.size} = {size} (the "
                 "dataset's own batches, the first's size; --batch-size does not apply)"
                 if own else f"global batch {size}")
        examples = split.num_examples
        what = "a user dataset" if examples is None else f"{examples} examples"
        return f"{what}, {steps}, {batch}, remainder policy '{spec.remainder}'"

    def stream(self, split: Split, epoch: int, done_steps: int,
               end_epoch: int) -> tf.data.Dataset:
        """The training batches from step ``done_steps`` of ``epoch`` to the end of the epoch
        before ``end_epoch``, back to back: each epoch takes ``passes.epoch_steps`` of them."""
        if getattr(split, "infinite", False):     # one endless pass, in the dataset's order
            return split.dataset(self.spec, 0, 1).skip(done_steps)
        first_pass, offset, _ = self.passes.start(epoch)
        dataset = split.dataset(self.spec, first_pass, self.passes.passes_until(end_epoch))
        skip = offset + done_steps
        return real_rows_only(dataset.skip(skip) if skip else dataset, self.spec)


def agreed_pass_steps(split: Split, spec: ShardSpec,
                      collectives: Collectives) -> tuple[int, list[int]]:
    """The split's steps per pass (agreed where ranks count their own) and every rank's count."""
    steps = split.steps_per_epoch(spec)
    if split.normalised:
        return steps, [steps] * spec.world.size
    counts = collectives.allgather_object(steps)
    return agreed_steps(counts, fill=spec.remainder == "pad"), counts


def counted(spec: ShardSpec, steps: int, counts: list[int], split: Split) -> ShardSpec:
    """``spec`` with the agreed steps, and every rank's count where ranks count their own."""
    return dataclasses.replace(spec, agreed_steps=steps, rank_counts=None if split.normalised
                               else tuple(counts))


def _left_out(split: Split, spec: ShardSpec, counts: list[int], steps: int,
              collectives: Collectives) -> list[str]:
    """Rank 0's line on what stopping every rank at ``steps`` whole batches leaves out of each
    pass of a user's dataset (an unbatched one's examples are counted)."""
    rows = getattr(split, "rows_per_pass", lambda _: None)(spec)
    everyone = None if rows is None else collectives.allgather_object(rows)
    line = left_out_line(counts, steps, everyone, spec.batch_size)
    return [line] if line else []


def _check_orders(data: DataBundle, gather: Callable) -> list[str]:
    """Refuse a user dataset whose order differs across ranks (``hvdtrain.data.order``); the
    lines rank 0 says about the order of the others."""
    notes = []
    for split, what in ((data.train, "training"), (data.val, "validation")):
        check = getattr(split, "check_order", None)
        if check is not None:
            check(what, gather)
            note = split.order_note(what)
            notes += [note] if note else []
    return notes


def _own_step_filler(examples: int, spec: ShardSpec, own_step: str | None) -> list[str]:
    """Rank 0's line where a model's own step will see a filler: the last global batch has
    fewer examples than there are ranks, so some rank has none of it."""
    short, ranks = examples % spec.global_batch, spec.world.size
    if own_step is None or spec.remainder != "pad" or not 0 < short < ranks:
        return []
    return [f"training data: the last global batch of each pass has {short} example(s) for "
            f"{ranks} ranks, so {ranks - short} rank(s) run that step on a filler batch whose "
            f"gradients weigh nothing but which the model's own step ({own_step}) counts in "
            "its metrics; a --batch-size that leaves no such remainder avoids it"]


def plan_data(config: Config, data: DataBundle, collectives: Collectives,
              own_step: str | None) -> DataPlan:
    """The run's ``DataPlan``, or a one-line error. Evaluation under a model's own step runs
    each rank's share as it is (no collective per step there)."""
    world = collectives.world
    batch, optim = config.train.batch_size, config.optim
    if not data.train.normalised and optim.accumulation_steps > 1:
        raise AgreedError("--accumulation-steps needs in-memory or file data (the weights of an "
                          "update must be known before its first micro-step); raise the pipeline's "
                          "batch size instead")
    notes = _check_orders(data, collectives.allgather_object)
    remainder = resolved_remainder(config, own_step, data.train.normalised)
    examples = data.train.num_examples
    spec = ShardSpec(examples or 0, world, batch, remainder, config.data.shuffle,
                     config.train.seed, optim.accumulation_steps)
    wanted = config.train.steps_per_epoch
    if getattr(data.train, "infinite", False):
        if not wanted:
            raise AgreedError("the training dataset repeats forever; give steps_per_epoch")
        steps, pass_steps = wanted, None
        spec = dataclasses.replace(spec, agreed_steps=steps)
    else:
        steps, counts = agreed_pass_steps(data.train, spec, collectives)
        pass_steps = steps
        if remainder == "drop" and not data.train.normalised:
            notes += _left_out(data.train, spec, counts, steps, collectives)
        spec = counted(spec, steps, counts, data.train)
    if steps == 0:
        fix = "lower --batch-size" + (" or use --remainder pad" if own_step is None else "")
        raise AgreedError(f"{examples or 'the'} training examples cannot fill one update of "
                          f"{spec.update_batch} per rank group ({world.size} ranks x {batch} x "
                          f"{optim.accumulation_steps} accumulation steps); {fix}")
    if examples is not None and examples < world.size:
        raise AgreedError(f"{world.size} ranks but only {examples} training "
                          "examples: every rank needs at least one; launch fewer ranks")
    left = (examples or 0) - world.size * steps * batch
    if examples and remainder == "drop" and left > 0:
        notes.append(f"training data: each pass leaves out {left} of {examples} examples "
                     f"(every rank trains {steps} whole batches of {batch}: --remainder drop), "
                     "a different part each epoch when shuffled")
    notes += _own_step_filler(examples or 0, spec, own_step)
    if isinstance(data.train, FileSplit):
        notes.append(f"sharding {len(data.train.files)} file(s) across {world.size} rank(s) by "
                     f"{data.train.mode(world.size)}")
    passes = Passes(pass_steps, wanted, config.train.initial_epoch)
    epochs = max(config.train.epochs, config.train.initial_epoch + 1)
    if data.val is None:
        return DataPlan(spec, passes, None, tuple(notes), epochs=epochs)
    if getattr(data.val, "infinite", False) and getattr(data.val, "declared_steps", 1) is None:
        raise AgreedError("the validation dataset repeats forever; give validation_steps")
    val_spec = ShardSpec(data.val.num_examples or 0, world, batch, "pad", False,
                         equal_steps=own_step is None)
    if own_step is None:
        val_spec = counted(val_spec, *agreed_pass_steps(data.val, val_spec, collectives),
                           data.val)
    return DataPlan(spec, passes, val_spec, tuple(notes), epochs=epochs)
