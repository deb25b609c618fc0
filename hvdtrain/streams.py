"""Where a rank's lines go: to its launcher while the launcher listens, and on rank 0 also to the
run directory's log, ``RUN_DIR/hvdtrain.log``.

When a launcher dies, a write to its pipe fails (EPIPE) mid-training or at exit, turning the
documented exit code into 120. So output is best effort: a stream whose write failed goes to
/dev/null and the rank carries on. Rank 0's log keeps the run's story, and the line saying why
it stopped, past a lost launcher; it is best effort too, so a full disk does not become the
failure. For the command-line entry (``install``); ``hvdtrain.fit`` leaves a script's streams
alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO

LOG_FILE = "hvdtrain.log"


class RankStream:
    """A text stream that never fails: writes go to ``stream`` until it breaks, and to the
    run's log once ``log_to`` has opened it (shared by stdout and stderr)."""

    log: TextIO | None = None

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if RankStream.log is not None:
            try:
                RankStream.log.write(text)
            except OSError:
                RankStream.log = None
        try:
            self._stream.write(text)
        except OSError:
            self._silence()
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._silence()

    def _silence(self) -> None:
        """The reader is gone: what this stream holds and will be given goes to /dev/null."""
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, self._stream.fileno())
        os.close(quiet)
        try:
            self._stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str) -> Any:     # isatty, fileno, encoding...
        return getattr(self._stream, name)


def install() -> None:
    """Make this process's ``sys.stdout`` and ``sys.stderr`` best effort."""
    sys.stdout = RankStream(sys.stdout)
    sys.stderr = RankStream(sys.stderr)


def log_to(run_dir: Path) -> None:
    """From now on, also append this process's lines to ``run_dir``'s log (rank 0; a no-op
    unless ``install`` ran)."""
    if not isinstance(sys.stdout, RankStream):
        return
    try:
        RankStream.log = open(Path(run_dir) / LOG_FILE, "a", buffering=1)
    except OSError:
        RankStream.log = None
