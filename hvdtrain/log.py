"""hvdtrain's own lines: the ``hvdtrain`` logger of Python's ``logging``, aware of ranks.

Every line hvdtrain's library code says (the run's setup, resume, elastic and final report;
its notes and warnings) goes through ``logger`` (``logging.getLogger("hvdtrain")``), so a
program raises or lowers hvdtrain's verbosity and routes its lines as with any library:
``logging.getLogger("hvdtrain").setLevel(...)``, its own handlers, or ``--log-level`` /
``hvdtrain.fit(..., log_level=...)``. What is not a log line: the progress bar (Keras'), and
the command-line tools' results and their one-line errors (``hvdtrain: error: ...``, printed
by ``hvdtrain.cli``, whatever the level: the one-line error contract never depends on logging).

During a run (``for_run``):

- rank rule: a rank other than 0 emits only WARNING and above (its own failure still reaches
  the user; rank 0 tells the run's story once), unless the level is DEBUG (every rank's lines);
- level: ``--log-level`` sets the ``hvdtrain`` logger's level, unless the program set one on it
  itself (the program's configuration wins);
- handler: only where neither the ``hvdtrain`` logger nor the root logger has a handler (a
  program that configured ``logging`` gets hvdtrain's lines through its own handlers, once),
  hvdtrain adds its own, formatted ``hvdtrain: message`` on rank 0 and ``hvdtrain rank 3:
  message`` elsewhere (the prefix of the CLI's one-line errors, so one grep finds them all);
- everything is put back when the run ends: the handler removed, the filter removed, the
  level restored. The root logger is never touched and ``logging.basicConfig`` never called.

Streams of hvdtrain's own handler, chosen deliberately: lines below WARNING go to stdout,
where they went before hvdtrain used ``logging``: in order with Keras' epoch lines and progress
bar (stdout and stderr are separate pipes under a launcher, so lines split across them lose
their order), and into the redirect (``> train.log``) a user already keeps of a run's story.
WARNING and above go to stderr, beside the one-line errors and the liveness monitor's lines,
so that ``2>`` or a launcher's stderr holds every problem. Both streams are looked up when a
line is written, so a rank's guarded streams (``hvdtrain.output``, which also copies rank 0's
lines into ``RUN_DIR/hvdtrain.log``) and a test's capture receive them.

Records passing the ``hvdtrain`` logger during a run carry ``record.rank`` (``%(rank)s`` in a
program's own format). Rank facts are handed in by the caller (a ``World``'s rank, or a function
returning it for an elastic job whose ranks change); this module imports no Horovod.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Callable, Iterator

logger = logging.getLogger("hvdtrain")

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _rank_of(rank: int | None | Callable[[], int | None]) -> int | None:
    return rank() if callable(rank) else rank


class RankFilter(logging.Filter):
    """Sets ``record.rank``; drops records below WARNING from ranks other than 0 unless
    ``every_rank``. Put on the ``hvdtrain`` logger itself, so it applies whatever handler a
    program configured (a logger's filters see only records logged on it: hvdtrain's code logs
    on ``logger`` itself, not on children)."""

    def __init__(self, rank: int | None | Callable[[], int | None],
                 every_rank: bool = False) -> None:
        super().__init__()
        self.rank = rank
        self.every_rank = every_rank

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank_of(self.rank)
        record.rank = rank
        return self.every_rank or not rank or record.levelno >= logging.WARNING


class RankFormatter(logging.Formatter):
    """``hvdtrain: message`` on rank 0 (and where the rank is unknown), ``hvdtrain rank 3:
    message`` on rank 3; a message of several lines keeps its later lines as they are."""

    def format(self, record: logging.LogRecord) -> str:
        rank = getattr(record, "rank", None)
        prefix = f"hvdtrain rank {rank}: " if rank else "hvdtrain: "
        return prefix + super().format(record)


class StreamsHandler(logging.StreamHandler):
    """Records below WARNING to ``sys.stdout``, WARNING and above to ``sys.stderr``, each looked
    up when the record is written (see the module doc for why)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.setFormatter(RankFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        # emit runs under the handler's lock (Handler.handle), so the stream is ours to set.
        self.stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        super().emit(record)


def configured_elsewhere() -> bool:
    """Whether a program configured handlers for hvdtrain's lines (on the ``hvdtrain`` logger
    or the root logger): then hvdtrain adds none."""
    return bool(logger.handlers or logging.getLogger().handlers)


@contextlib.contextmanager
def for_run(level: str = "INFO",
            rank: int | None | Callable[[], int | None] = None) -> Iterator[RankFilter]:
    """hvdtrain's logging for one run (or one command) on this rank, put back when it ends:
    the rank rule, ``level`` (unless the program set the logger's level) and, where the
    program configured no handler, hvdtrain's own (see the module doc). Nested uses keep the
    outer handler (the logger has one then)."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; choose from {', '.join(LEVELS)}")
    rank_filter = RankFilter(rank, every_rank=numeric <= logging.DEBUG)
    handler = None if configured_elsewhere() else StreamsHandler()
    level_before = logger.level
    if level_before == logging.NOTSET:
        logger.setLevel(numeric)
    logger.addFilter(rank_filter)
    if handler is not None:
        logger.addHandler(handler)
    try:
        yield rank_filter
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            handler.close()
        logger.removeFilter(rank_filter)
        logger.setLevel(level_before)
