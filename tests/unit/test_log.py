"""hvdtrain's lines go through the ``hvdtrain`` logger (``hvdtrain.log``): ``--log-level`` is
obeyed, ranks other than 0 say only warnings, hvdtrain's own handler exists only during a run
and only where the program configured no logging, and a program's own root handler receives
each line once (single process, fast; one tiny ``hvdtrain.fit``)."""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest

from hvdtrain.log import for_run, logger


@contextlib.contextmanager
def unconfigured():
    """No logging configured by the program: pytest's capture handlers, which it adds to the
    root logger around each test's call, taken off meanwhile."""
    root = logging.getLogger()
    kept, root.handlers = root.handlers, []
    assert not logger.handlers and logger.level == logging.NOTSET and not logger.filters
    try:
        yield
    finally:
        root.handlers = kept + root.handlers


def state() -> tuple:
    root = logging.getLogger()
    return (list(logger.handlers), logger.level, list(logger.filters), logger.propagate,
            list(root.handlers), root.level)


def test_the_level_is_obeyed_and_rank_0_lines_read_hvdtrain(capsys):
    with unconfigured():
        with for_run("INFO", 0):
            logger.debug("not shown")
            logger.info("shown on stdout")
            logger.warning("a problem, on stderr")
        with for_run("WARNING", 0):
            logger.info("quiet now")
            logger.warning("still said")
        out, err = capsys.readouterr()
        assert out == "hvdtrain: shown on stdout\n"
        assert err == "hvdtrain: a problem, on stderr\nhvdtrain: still said\n"


def test_other_ranks_say_warnings_only_unless_debug(capsys):
    with unconfigured():
        with for_run("INFO", 3):
            logger.info("rank 0's story")
            logger.warning("this rank's own problem")
        out, err = capsys.readouterr()
        assert out == "" and err == "hvdtrain rank 3: this rank's own problem\n"
        with for_run("DEBUG", 3):
            logger.info("every rank's lines at DEBUG")
        assert capsys.readouterr().out == "hvdtrain rank 3: every rank's lines at DEBUG\n"


def test_the_rank_is_read_when_a_line_is_said(capsys):
    """An elastic job's ranks change: the rank is a function of the run's world."""
    with unconfigured():
        ranks = [1]
        with for_run("INFO", lambda: ranks[0]):
            logger.info("rank 1 now: silent")
            ranks[0] = 0
            logger.info("rank 0 now")
        assert capsys.readouterr().out == "hvdtrain: rank 0 now\n"


def test_everything_is_put_back_after_a_run_even_a_failed_one():
    with unconfigured():
        before = state()
        with pytest.raises(RuntimeError):
            with for_run("DEBUG", 0):
                assert logger.handlers and logger.level == logging.DEBUG and logger.filters
                raise RuntimeError("the run failed")
        assert state() == before


def test_a_programs_root_handler_gets_each_line_once_and_hvdtrain_adds_none(capsys):
    with unconfigured():
        records: list[logging.LogRecord] = []
        root_handler = logging.Handler()
        root_handler.emit = records.append
        logging.getLogger().addHandler(root_handler)
        before = state()
        with for_run("INFO", 0):
            assert logger.handlers == []
            logger.info("to the program's handler")
        with for_run("INFO", 2):
            logger.info("rank 2's info: dropped")
            logger.warning("rank 2's warning")
        assert [(r.getMessage(), r.rank) for r in records] == [("to the program's handler", 0),
                                                               ("rank 2's warning", 2)]
        assert capsys.readouterr() == ("", "")        # nothing printed besides
        assert state() == before


def test_a_level_the_program_set_on_the_logger_wins(capsys):
    with unconfigured():
        logger.setLevel(logging.WARNING)
        try:
            with for_run("INFO", 0):
                logger.info("the program asked for warnings only")
            assert logger.level == logging.WARNING
        finally:
            logger.setLevel(logging.NOTSET)
        assert capsys.readouterr().out == ""


def test_an_unknown_level_is_refused_by_the_config():
    from hvdtrain.config import ConfigError, build_config

    assert build_config({"log_level": "WARNING"}).train.log_level == "WARNING"
    with pytest.raises(ConfigError, match="'log_level' must be one of DEBUG, INFO, WARNING, "
                                          "ERROR, got 'LOUD'"):
        build_config({"log_level": "LOUD"})


def test_fit_says_its_lines_through_the_logger_and_leaves_it_as_it_was(capsys, tmp_path):
    import keras

    import hvdtrain

    with unconfigured():
        def model() -> keras.Model:
            built = keras.Sequential([keras.Input((4,)),
                                      keras.layers.Dense(3, activation="softmax")])
            built.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
            return built

        x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
        y = (np.arange(64) % 3).astype("int64")
        before = state()
        hvdtrain.fit(model, x, y, epochs=1, batch_size=16, verbose=0, validation_split=0.25,
                     run_dir=str(tmp_path / "info"), tensorboard=False)
        out, err = capsys.readouterr()
        assert "hvdtrain: 1 rank(s) on 1 node(s); rank 0 on " in out
        assert "hvdtrain: weights identical on all ranks" in out and "hvdtrain: held-out" in out
        assert state() == before
        hvdtrain.fit(model, x, y, epochs=1, batch_size=16, verbose=0, validation_split=0.25,
                     run_dir=str(tmp_path / "warning"), tensorboard=False, log_level="WARNING")
        out, err = capsys.readouterr()
        assert "hvdtrain:" not in out + err, out + err
        assert state() == before
