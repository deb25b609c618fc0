"""What a run trains: the user's model, which step trains it, its optimizers and the rate they
follow.

A model on Keras' own ``train_step`` with a loss and targets gets hvdtrain's exact step
(``core``); one with its own step, trained on ``add_loss`` alone, or given data without targets
runs its own code (``own``). The optimizer is the model's compiled one unless
``--optimizer`` names another (an uncompiled model is compiled with hvdtrain's defaults), and
every rate is scaled and warmed up as configured (``schedule``). Each choice is said in one line
of the run log (``prepare``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.collectives import World
from hvdtrain.config import DEFAULT_LEARNING_RATE, Config
from hvdtrain.data.contract import DataBundle
from hvdtrain.errors import UserError, first_sentence
from hvdtrain.keras_internals import compile_arguments, remembered_rates, sublayers
from hvdtrain.log import logger
from hvdtrain.training.step.objective import (DEFAULT_LOSS, DEFAULT_METRICS, LossShare,
                                              build_for_training)
from hvdtrain.training.step.own import own_step_methods, owned_optimizers
from hvdtrain.training.step.schedule import (RateControl, WarmupScaledRate, make_optimizer,
                                             make_schedule)


def own_step_reason(model: keras.Model, data: DataBundle) -> str | None:
    """Why the model must be trained by its own step, or None for hvdtrain's exact step."""
    methods = own_step_methods(model)
    if methods:
        return f"it defines {', '.join(methods)}"
    if not data.targets:
        return "the data has no targets"
    if getattr(model, "compiled", False) and compile_arguments(model).get("loss") is None:
        return "it was compiled without a loss (Keras trains it on its add_loss losses)"
    return None


def settable_rate(optimizer: keras.optimizers.Optimizer) -> float | None:
    """The optimizer's rate for one rank, or None when it is a ``LearningRateSchedule`` (Keras
    cannot set such a rate). After an earlier run of this model it is that run's base rate,
    unless the user has set another since (``RateControl.on_train_end``)."""
    try:
        rate = float(optimizer.learning_rate)
        optimizer.learning_rate = rate
    except TypeError:
        return None
    base, last = remembered_rates(optimizer) or (rate, rate)
    return base if rate == last else rate


@dataclass
class Trainable:
    """The model, why its own step trains it (None: hvdtrain's step), the optimizers, the
    schedule they follow and the callback that sets their rates; ``share``: what its compiled
    loss divides a batch by (measured by ``probe_trainable``; None for a model's own step)."""

    model: keras.Model
    own_step: str | None
    optimizer: keras.optimizers.Optimizer
    schedule: WarmupScaledRate
    rates: RateControl
    share: LossShare | None = None
    # The model came uncompiled and got hvdtrain's default loss, which expects probabilities.
    default_loss: bool = False


def _checked_compile(model: keras.Model, own_step: str | None, config: Config) -> None:
    """Refuse what the run cannot honour, in one line each."""
    per_execution = getattr(model, "steps_per_execution", 1) or 1
    if per_execution != 1:
        raise UserError(f"the model was compiled with steps_per_execution={per_execution}; "
                        "hvdtrain needs every step to reach its callbacks (stop votes, "
                        "checkpoints): compile with steps_per_execution=1")
    if own_step is None:
        return
    if not getattr(model, "compiled", False):
        raise UserError(f"the model trains with its own step ({own_step}) but is not "
                        "compiled; call model.compile(...) as you would before model.fit")
    if config.optim.optimizer != "auto" or config.optim.learning_rate is not None:
        raise UserError(f"--optimizer/--learning-rate choose hvdtrain's optimizer, but this "
                        f"model trains with its own step ({own_step}) and its own optimizers; "
                        "drop them (the rates are still scaled with --lr-scaling)")
    if config.optim.accumulation_steps != 1 or config.train.elastic:
        raise UserError(f"--accumulation-steps and --elastic need hvdtrain's step, but this "
                        f"model trains with its own ({own_step}); drop them")


def _compiled_optimizer(model: keras.Model) -> keras.optimizers.Optimizer | None:
    return getattr(model, "optimizer", None) if getattr(model, "compiled", False) else None


def _exact_optimizer(config: Config, model: keras.Model, compiled: keras.optimizers.Optimizer |
                     None, schedule: WarmupScaledRate) -> tuple[keras.optimizers.Optimizer, str]:
    """hvdtrain's step: the ``compiled`` optimizer, or the configured one put on the model."""
    optim = config.optim
    if optim.optimizer == "auto" and compiled is not None:
        if optim.learning_rate is not None:
            compiled.learning_rate = optim.learning_rate
        return compiled, f"the model's compiled {type(compiled).__name__}"
    named = "sgd" if optim.optimizer == "auto" else optim.optimizer
    optimizer = make_optimizer(optim, schedule)
    if config.train.precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    if compiled is None:
        model.compile(optimizer=optimizer, loss=DEFAULT_LOSS, metrics=list(DEFAULT_METRICS))
    else:   # compiled again, so a saved model names the optimizer it was trained with
        arguments = compile_arguments(model)
        model.compile(**{**arguments, "optimizer": optimizer})
    momentum = f" (momentum {optim.momentum:g})" if named in ("sgd", "rmsprop") else ""
    return optimizer, f"{named}{momentum}"


def prepare(config: Config, model: keras.Model, data: DataBundle, world: World,
            updates_per_epoch: int, own_step: str | None) -> Trainable:
    """The run's optimizers and rates, the model compiled where hvdtrain's step needs it; the
    run log gets the step chosen, the optimizers with their rates, and XLA (``say_the_step``)."""
    _checked_compile(model, own_step, config)
    optim = config.optim
    if own_step is None:
        compiled = _compiled_optimizer(model)
        own_rate = (settable_rate(compiled) if compiled is not None and optim.optimizer == "auto"
                    else None)
        base = optim.learning_rate or own_rate or DEFAULT_LEARNING_RATE
        schedule = make_schedule(optim, world.size, updates_per_epoch, config.train.epochs,
                                 base)
        optimizer, what = _exact_optimizer(config, model, compiled, schedule)
        bases = {"optimizer": (optimizer, base)} if settable_rate(optimizer) is not None else {}
        fixed = [] if bases else ["optimizer"]
    else:
        schedule = make_schedule(optim, world.size, updates_per_epoch, config.train.epochs)
        optimizers = owned_optimizers(model)
        bases = {name: (o, rate) for name, o in optimizers.items()
                 if (rate := settable_rate(o)) is not None}
        fixed = [name for name in optimizers if name not in bases]
        optimizer = next(iter(optimizers.values()))
        what = ", ".join(f"{name} ({type(o).__name__})" for name, o in optimizers.items())
    say_the_step(own_step, _describe(what, bases, fixed, schedule, config, world),
                 bool(model.jit_compile))
    return Trainable(model, own_step, optimizer, schedule, RateControl(schedule, bases),
                     default_loss=own_step is None and compiled is None)


def say_the_step(own_step: str | None, optimizers: str, jit_compile: bool) -> None:
    """The run log's lines on what trains the model: which step (``own_step``: why the model's
    own, None: Keras' ``train_step`` with hvdtrain's exchange), the ``optimizers`` line, and
    XLA (a warning where the model asks for XLA its own step cannot have)."""
    logger.info("step: " + ("Keras' train_step (its compute_loss and metrics), the "
                            "gradients combined across ranks under it"
                            if own_step is None else
                            f"the model's own train_step ({own_step})"))
    logger.info(optimizers)
    (logger.warning if jit_compile and own_step else logger.info)(
        xla_line(jit_compile, own_step is not None))


def _describe(what: str, bases: dict, fixed: list[str], schedule: WarmupScaledRate,
              config: Config, world: World) -> str:
    """One line: which optimizer(s), at what rates, scaled how."""
    optim = config.optim
    rates = ", ".join(f"{base:g}" if list(bases) == ["optimizer"] else f"{name} {base:g}"
                      for name, (_, base) in bases.items())
    scaled = (f"x{schedule.scale:g} for {world.size} rank(s) (--lr-scaling {optim.lr_scaling})"
              if schedule.scale != 1 else "not scaled")
    warmup = (f" after a {optim.warmup_epochs:g}-epoch warmup" if schedule.warmup_steps and
              schedule.scale != 1 else "")
    line = f"optimizer: {what}; rate per rank {rates or 'as built'}, {scaled}{warmup}"
    if fixed:
        line += (f"; {', '.join(fixed)} follow(s) the user's own LearningRateSchedule, left as "
                 "written (not scaled)")
    return line


def check_default_output(model: keras.Model, x: Any) -> None:
    """Stop before training when hvdtrain chose the loss (the model came uncompiled) and the
    model's outputs are not the probabilities that loss expects: it would train, badly, on
    logits. Computed in a graph (no eager call a program could count)."""
    predictions = tf.nest.flatten(tf.function(lambda inputs: model(inputs, training=False))(x))
    values = np.asarray(tf.cast(predictions[0], tf.float32))
    in_unit = bool(np.all((values >= 0) & (values <= 1)))
    if values.ndim < 2 or values.shape[-1] < 2 or not (
            in_unit and np.allclose(values.sum(axis=-1), 1.0, atol=1e-3)):
        raise UserError(f"the model's output is not a probability distribution (values "
                        f"{values.min():.3g}..{values.max():.3g}) but hvdtrain's default loss "
                        f"for an uncompiled model, {DEFAULT_LOSS}, expects one; compile the model "
                        "with keras.losses.SparseCategoricalCrossentropy(from_logits=True) (or "
                        "your loss) or end it with a softmax")


def probe_trainable(trainable: Trainable, batch: tuple, label: str,
                    build_optimizer: bool = True, sample_weights: bool = True
                    ) -> LossShare | None:
    """One real batch before training: hvdtrain's step has Keras build the model, its loss and
    metrics from the batch's shapes, then its optimizer (``build_optimizer``: not under ZeRO,
    which builds it in pieces when training starts), and measures what the loss divides by
    (kept as ``trainable.share`` and returned); a model's own step is built (as its first
    step would)."""
    model = trainable.model
    if trainable.own_step is None:
        trainable.share = build_for_training(model, batch, label, sample_weights)
        if build_optimizer and not trainable.optimizer.built:   # once every weight exists
            trainable.optimizer.build(model.trainable_variables)
        if trainable.default_loss:
            check_default_output(model, batch[0])
        return trainable.share
    if all(layer.built for layer in sublayers(model)) and model.weights:
        return None
    try:
        model(batch[0], training=False)
    except Exception as error:  # noqa: BLE001 - whatever a user's call raises
        why = f"{type(error).__name__}: {first_sentence(str(error))}"
        raise UserError(f"model '{label}' is not built and calling it on a batch "
                        f"failed ({why}); build it (and its sub-models) before training"
                        ) from error
    return None


def xla_line(jit_compile: bool, own_step: bool) -> str:
    """The run log's line on XLA: the model's ``jit_compile`` (Keras' "auto" already resolved:
    on with a GPU where the model supports it, off on CPUs) taken as the user set it."""
    if jit_compile and own_step:
        return ("note: the model's own train_step runs without XLA although its jit_compile is "
                "True: its optimizers reduce gradients with collectives, which XLA cannot "
                "compile; compile the model with jit_compile=False to silence this")
    if jit_compile:
        return ("XLA: on for the forward and backward pass (the model's jit_compile); the "
                "collectives and the update run outside it")
    return "XLA: off (the model's jit_compile is False; Keras' 'auto' chooses off without a GPU)"
