"""hvdtrain's own lines: the ``hvdtrain`` logger of Python's ``logging``, aware of ranks.

Library code logs on ``logger``, so a program raises, lowers or routes hvdtrain's lines as with
any library (or ``--log-level``/``log_level=``). Not log lines: the progress bar (Keras') and
the command-line tools' results and one-line errors (``hvdtrain.cli``, whatever the level).
``for_run`` sets the rules for one run and puts everything back after it: ranks other than 0
say only warnings (all at DEBUG), a level the program set wins, and hvdtrain's own handler is
added only where the program configured none (the root logger is never touched). Rank facts
are handed in by the caller; this module imports no Horovod.
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
    """Records below WARNING to ``sys.stdout`` (in order with Keras' epoch lines, which a
    launcher's separate pipes would otherwise split, and in the ``> train.log`` a user keeps),
    WARNING and above to ``sys.stderr`` (beside the one-line errors and the liveness lines).
    Each stream is looked up when the record is written, so a rank's guarded streams
    (``hvdtrain.streams``, which copies rank 0's lines into ``RUN_DIR/hvdtrain.log``) and a
    test's capture receive them. Records carry ``record.rank`` (``%(rank)s`` in a format)."""

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
