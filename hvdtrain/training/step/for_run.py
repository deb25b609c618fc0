"""The step a run trains with: made from the configuration (``made_step``: hvdtrain's step with
its ``StepOptions``, or the model's own), and, once the first real batch has built the model,
the run's step with the lines it says about itself (``step_for_run``: the batch-norm note, how
the ranks' losses combine, how the gradients travel, where a sharded optimizer's state lives).
"""

from __future__ import annotations

from hvdtrain.collectives import Collectives, GradientReduction
from hvdtrain.config import Config, ModelConfig, OptimConfig
from hvdtrain.data.contract import DataBundle
from hvdtrain.errors import UserError
from hvdtrain.log import logger
from hvdtrain.model_memory.remat import Remat
from hvdtrain.optimizers.zero import check_shardable
from hvdtrain.optimizers.zero import describe as describe_sharding
from hvdtrain.training.step.bucket_choice import describe as describe_choice
from hvdtrain.training.step.bucket_choice import measured_candidates
from hvdtrain.training.step.core import StepMath, StepOptions, TrainingStep
from hvdtrain.training.step.objective import agreed_share
from hvdtrain.training.step.own import OwnStep
from hvdtrain.training.step.sync_batch_norm import batch_norm_note
from hvdtrain.training.step.trainable import Trainable


def wire_and_powersgd_rank(compression: str, powersgd_rank: int,
                           world_size: int) -> tuple[str, int]:
    """What a ``--compression`` asks of the step: (the cast on the wire of the gradients that
    travel exact, PowerSGD's rank or 0). PowerSGD's uncompressed part travels as float32; the
    other choices are casts on the wire; one rank compresses nothing (no gradient travels)."""
    if compression != "powersgd":
        return compression, 0
    return "none", powersgd_rank if world_size > 1 else 0


def made_step(trainable: Trainable, data: DataBundle, collectives: Collectives,
              global_batch: int, optim: OptimConfig, remat: Remat | None = None,
              seed: int = 0) -> TrainingStep:
    """The step that trains ``trainable`` as ``optim`` says, its layers recomputing what
    ``remat`` says; the ranks' shares are counted against ``global_batch``; ``seed`` draws
    PowerSGD's first Q's (one rank compresses nothing: no gradient travels)."""
    wire, powersgd_rank = wire_and_powersgd_rank(optim.compression, optim.powersgd_rank,
                                                 collectives.world.size)
    if trainable.own_step is not None:
        op = "adasum" if optim.reduction == "adasum" else "average"
        return OwnStep(trainable.model, collectives, data.keras_element,
                       GradientReduction(op, wire,
                                         bucket_bytes=optim.bucket_bytes,
                                         in_issue_order=optim.bucket_order == "issued"),
                       optim.zero_stage, global_batch, remat, powersgd_rank, seed)
    assert trainable.share is not None, "probe_trainable measures the share before any step"
    return StepMath(trainable.model, trainable.optimizer, collectives, trainable.share,
                    StepOptions(accumulation_steps=optim.accumulation_steps,
                                adasum=optim.reduction == "adasum",
                                compression=wire,
                                global_batch=global_batch,
                                sample_weights=data.sample_weights,
                                bucket_bytes=optim.bucket_bytes,
                                xla=bool(trainable.model.jit_compile),
                                zero_stage=optim.zero_stage,
                                in_issue_order=optim.bucket_order == "issued",
                                remat=remat, powersgd_rank=powersgd_rank, seed=seed))


def remat_of(model: ModelConfig) -> Remat | None:
    """``--remat`` and its settings, None for none."""
    if model.remat == "none":
        return None
    return Remat(model.remat, model.remat_threshold, tuple(model.remat_layers))


def step_for_run(config: Config, trainable: Trainable, data: DataBundle,
                 collectives: Collectives, global_batch: int) -> TrainingStep:
    """The run's step, once ``probe_trainable`` has built the model on a real batch: the
    batch-norm note, the loss share every rank agrees on (``agreed_share``), then the step
    and its lines on the gradients' exchange and, sharded, the optimizer state (an optimizer
    that cannot be sharded is refused here, before any step)."""
    optim, world = config.optim, collectives.world
    own_step = trainable.own_step
    asks_xla = bool(trainable.model.jit_compile)
    note = batch_norm_note(trainable.model, world.size, global_batch,
                           config.train.sync_batch_norm, asks_xla and own_step is None)
    if note:
        logger.info(note)
    if trainable.share is not None:
        trainable.share = agreed_share(trainable.share, collectives, optim, asks_xla,
                                       config.train.elastic)
    step = made_step(trainable, data, collectives, global_batch, optim,
                     remat_of(config.model), config.train.seed)
    if world.size > 1:
        _exchange_lines(config, step, trainable, asks_xla)
    if optim.zero_stage == 3 and asks_xla:
        raise UserError(f"--zero-stage 3 gathers each layer's weights inside its call, which "
                        f"XLA cannot compile (the collectives have no XLA kernels); compile "
                        f"{trainable.model.name} with jit_compile=False or use --zero-stage 2")
    remat = step.layer_memory.remat
    if remat is not None:
        logger.info(remat.describe())
    if optim.zero_stage:
        for optimizer in step.optimizers.values():
            check_shardable(optimizer)
        if step.optimizer is not None:
            logger.info(describe_sharding(optim.zero_stage, world.size, step.optimizer,
                                          trainable.model.trainable_variables))
    return step


def _exchange_lines(config: Config, step: TrainingStep, trainable: Trainable,
                    asks_xla: bool) -> None:
    """The lines on how the step's gradients travel (several ranks), and whether the first
    steps measure its buckets against one allreduce (``bucket_choice``: it sets the step's
    candidates)."""
    optim = config.optim
    if optim.reduction == "adasum":
        if optim.bucket_order == "issued":
            logger.warning("--bucket-order issued does not apply to --reduction adasum: Adasum "
                           "sends each gradient in an allreduce of its own, in no bucket")
        return
    variables = trainable.model.trainable_variables
    all_at_once = ("accumulated over micro-steps" if optim.accumulation_steps > 1 else
                   "computed by one XLA cluster" if asks_xla and not trainable.own_step else "")
    logger.info(step.reduction.describe(variables, all_at_once))
    step.bucket_candidates = measured_candidates(
        step.reduction, variables,
        optim.bucket_choice == "measured" and not all_at_once and not optim.zero_stage
        and step.powersgd is None and not config.train.elastic)
    if step.bucket_candidates is not None:
        logger.info(describe_choice(step.bucket_candidates))
    if step.powersgd is not None:
        logger.info(step.powersgd.describe(variables))
