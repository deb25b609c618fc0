"""PowerSGD's math in one process (``hvdtrain.optimizers.powersgd``): one round recovers a
matrix of the compression's rank exactly, what it leaves out stays in the error buffer, and
which gradients travel compressed. Two ranks on both backends: test_training_options.py."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvdtrain.collectives import GradientReduction, LocalCollectives
from hvdtrain.optimizers.powersgd import PowerSGD, matrix_shape


def test_which_shapes_are_compressed_and_as_which_matrix():
    assert matrix_shape((3, 3, 16, 32), 2) == (144, 32)    # a convolution's kernel
    assert matrix_shape((64, 10), 2) == (64, 10)
    assert matrix_shape((64,), 2) is None                   # a bias
    assert matrix_shape((8, 10), 2) is None                 # (8 + 10) x 2 x 4 > 80: not worth it
    assert matrix_shape((64, 2), 2) is None                 # no smaller than the rank


def test_one_round_recovers_a_matrix_of_its_rank_with_no_error_left():
    rng = np.random.default_rng(0)
    exact = (rng.standard_normal((40, 2)) @ rng.standard_normal((2, 30))).astype(np.float32)
    variables = [tf.Variable(tf.zeros((40, 30))), tf.Variable(tf.zeros((30,)))]
    powersgd = PowerSGD(variables, rank=2, seed=1)
    bias = tf.ones((30,))
    reduced, (scalar,) = powersgd.reduced(LocalCollectives(), [tf.constant(exact), bias],
                                          variables, GradientReduction(), [tf.constant(5.0)])
    np.testing.assert_allclose(reduced[0].numpy(), exact, atol=1e-4)
    np.testing.assert_allclose(powersgd.error_variables[0].numpy(), 0.0, atol=1e-4)
    assert reduced[1] is bias and float(scalar) == 5.0     # a bias travels as it is


def test_what_a_round_leaves_out_is_kept_and_sent_later():
    """A full-rank gradient: the approximation and the error add up to it, and the error is
    added to the next step's gradient (here zero), so over steps everything is sent."""
    rng = np.random.default_rng(1)
    gradient = rng.standard_normal((32, 24)).astype(np.float32)
    variables = [tf.Variable(tf.zeros((32, 24)))]
    powersgd = PowerSGD(variables, rank=2, seed=1)
    sent = powersgd.reduce(LocalCollectives(), [tf.constant(gradient)], variables)[0].numpy()
    np.testing.assert_allclose(sent + powersgd.error_variables[0].numpy(), gradient, atol=1e-5)
    total = sent
    for _ in range(40):
        total += powersgd.reduce(LocalCollectives(), [tf.zeros((32, 24))], variables)[0].numpy()
    assert np.abs(total - gradient).max() < 0.1 * np.abs(gradient).max()


def test_a_checkpoints_state_comes_back_and_a_world_change_drops_the_errors():
    variables = [tf.Variable(tf.zeros((32, 24)))]
    saved = PowerSGD(variables, rank=2, seed=1)
    saved.reduce(LocalCollectives(), [tf.ones((32, 24))], variables)
    every_rank = [saved.rank_values(), saved.rank_values()]
    resumed = PowerSGD(variables, rank=2, seed=7)
    assert resumed.load(every_rank, 1, 2) == ""
    for mine, theirs in zip(resumed.rank_values(), saved.rank_values()):
        np.testing.assert_array_equal(mine, theirs)
    assert "error buffers are dropped (this run has 3)" in resumed.load(every_rank, 1, 3)
    assert not resumed.error_variables[0].numpy().any()
    np.testing.assert_array_equal(resumed.q_variables[0].numpy(), saved.q_variables[0].numpy())
    assert "no compression state" in resumed.load([[]], 0, 1)


def test_every_rank_draws_the_same_first_q():
    variables = [tf.Variable(tf.zeros((32, 24)))]
    first, second = PowerSGD(variables, 2, 3), PowerSGD(variables, 2, 3)
    np.testing.assert_array_equal(first.q_variables[0].numpy(), second.q_variables[0].numpy())


def test_the_step_and_the_benchmark_read_a_compression_alike():
    """--compression powersgd: its exact part travels as float32 and one rank compresses
    nothing; the casts travel as they are (the benchmark once passed 'powersgd' on as a cast)."""
    from hvdtrain.training.step.for_run import wire_and_powersgd_rank

    assert wire_and_powersgd_rank("powersgd", 2, world_size=2) == ("none", 2)
    assert wire_and_powersgd_rank("powersgd", 4, world_size=1) == ("none", 0)
    assert wire_and_powersgd_rank("bf16", 2, world_size=2) == ("bf16", 0)
    GradientReduction(compression=wire_and_powersgd_rank("powersgd", 2, 2)[0])
