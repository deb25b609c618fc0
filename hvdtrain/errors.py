"""User-facing failures: shown as a single line, never as a traceback, with their own exit code.

Exit codes: 1 another rank failed (its error is shown by that rank), 2 a mistake to fix, 3 the
loss diverged, 74 a checkpoint or another file of the run could not be written, 75 stopped by a
signal with a checkpoint written (continue with ``--resume auto``), 76 a rank made no progress
for ``--stall-timeout`` (its liveness monitor ended it).
"""

import contextlib
import errno
import os
import re
from typing import Iterator


# Keras wraps an error raised inside a layer's call: a preamble, the reason in ANSI bold, and
# the call's arguments after it.
_KERAS_CALL = re.compile(r"^Exception encountered when calling [^\n]*\n+(.*?)"
                         r"(\n\s*Arguments received by .*)?$", re.S)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def unwrapped(text: str) -> str:
    """A message without the preamble and arguments Keras wraps around an error raised
    inside a layer's call, nor its ANSI colours."""
    text = _ANSI.sub("", text).strip()
    wrapped = _KERAS_CALL.match(text)
    return wrapped.group(1).strip() if wrapped else text


def first_sentence(text: str) -> str:
    """Another library's message as one whole sentence for a one-line report: its lines joined,
    up to the end of its first sentence (never cut inside one); of an error Keras wrapped
    around a layer's call, the reason inside."""
    flat = " ".join(unwrapped(text).split())
    match = re.search(r"[.!?](\s|$)", flat)
    return flat[:match.end()].strip() if match else flat


class UserError(Exception):
    """Something the user can fix; the message names the problem and the fix in one line."""

    exit_code = 2


class AgreedError(UserError):
    """A mistake every rank found together, after a collective (rank 0's decision broadcast, a
    check of every rank's data): each raises the same line at the same point, so no peer waits
    for another and the job's collectives stay usable for a next run in the same processes."""


@contextlib.contextmanager
def found_by_every_rank() -> Iterator[None]:
    """Around what every rank runs alike (the step's trace: the same program on every rank): a
    mistake found there is found by every rank at the same point, so it leaves as an
    ``AgreedError``, and what the ranks hold in pieces for the run is gathered whole again."""
    try:
        yield
    except AgreedError:
        raise
    except UserError as error:   # (raised in a layer's call: without Keras' wrapping)
        raise AgreedError(unwrapped(str(error))) from error


class TrainingDiverged(UserError):
    """The loss stopped being finite; the run stopped without saving the bad weights."""

    exit_code = 3


class WriteFailed(UserError):
    """A file of the run could not be written (disk full, quota, permission); the checkpoints
    on disk are whole. 74 is sysexits' EX_IOERR."""

    exit_code = 74


class PeerFailed(UserError):
    """Another rank ended with an error (it shows it); this one stopped with it instead of
    waiting for that rank in a collective."""

    exit_code = 1


class CheckpointWriteFailed(WriteFailed):
    """A checkpoint could not be written; the previous one is whole."""


class StoppedBySignal(UserError):
    """A stop was requested (SIGTERM, SIGINT, SIGUSR1, or the launcher went away); every rank
    stopped at the same step and rank 0 wrote a checkpoint there. Run the same command with
    ``--resume auto`` to continue. 75 is sysexits' EX_TEMPFAIL: try again later."""

    exit_code = 75


# A rank whose training made no progress for --stall-timeout seconds (a lost node, a cut network:
# a collective that never returns) ends itself with this code, after one line naming it and
# what it waited for (hvdtrain/liveness/watch.py). Resume with --resume.
STALLED_EXIT_CODE = 76


def os_error_reason(error: OSError) -> str:
    """'No space left on device (ENOSPC)', or the error's text when it has no errno."""
    if error.errno in errno.errorcode:
        return f"{os.strerror(error.errno)} ({errno.errorcode[error.errno]})"
    return str(error)
