"""The learning-rate schedules (one process): warmup to the scaled rate, cosine, step,
square-root scaling, and plateau decay across a restore. The training options on 2 ranks:
tests/distributed/training/test_training_options.py."""

from __future__ import annotations

import pytest

from hvdtrain.config import OptimConfig
from hvdtrain.training.step.schedule import PlateauDecay, make_schedule, scale_factor


def test_schedule_warms_up_to_the_scaled_rate():
    schedule = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=2), 4, 10, epochs=5)
    assert float(schedule(0)) == pytest.approx(0.1)
    assert float(schedule(10)) == pytest.approx(0.25)     # half way to 0.4
    assert float(schedule(20)) == pytest.approx(0.4)
    assert float(schedule(500)) == pytest.approx(0.4)
    assert scale_factor("sqrt", 4) == 2.0 and scale_factor("none", 4) == 1.0


def test_cosine_and_step_schedules_after_warmup():
    cosine = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=1, lr_schedule="cosine"),
                           2, 10, epochs=5)
    assert float(cosine(5)) == pytest.approx(0.15)          # warming up: 0.1 -> 0.2
    assert float(cosine(10)) == pytest.approx(0.2)          # warmup done: the scaled rate
    assert float(cosine(30)) == pytest.approx(0.1)          # half way through the cosine
    assert float(cosine(50)) == pytest.approx(0.0, abs=1e-7)
    step = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=0, lr_schedule="step",
                                     lr_decay_epochs=2, lr_decay_factor=0.5), 4, 10, epochs=9)
    assert [float(step(s)) for s in (0, 19, 20, 45)] == pytest.approx([0.4, 0.4, 0.2, 0.1])
    sqrt = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=0, lr_scaling="sqrt"),
                         4, 10, epochs=1)
    assert float(sqrt(0)) == pytest.approx(0.2)


def test_plateau_decay_waits_for_patience_and_survives_a_restore():
    schedule = make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=0,
                                         lr_schedule="plateau"), 1, 10, epochs=10)
    plateau = PlateauDecay(schedule, factor=0.5, patience=2)
    for epoch, val_loss in enumerate([1.0, 0.9, 0.95, 0.92, 0.91, 0.8]):
        plateau.on_epoch_end(epoch, {"val_loss": val_loss})
    assert float(schedule(0)) == pytest.approx(0.05)        # one decay, after two stalls
    saved = plateau.state()
    fresh = PlateauDecay(make_schedule(OptimConfig(learning_rate=0.1, warmup_epochs=0,
                                                   lr_schedule="plateau"), 1, 10, epochs=10),
                         0.5, 2)
    fresh.load(saved)
    assert fresh.state() == saved and float(fresh.schedule(0)) == pytest.approx(0.05)
