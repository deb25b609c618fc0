"""User-facing failures: shown as a single line, never as a traceback, with their own exit code."""


class UserError(Exception):
    """Something the user can fix; the message names the problem and the fix in one line."""

    exit_code = 2


class TrainingDiverged(UserError):
    """The loss stopped being finite; the run stopped without saving the bad weights."""

    exit_code = 3


# A rank whose training made no progress for --stall-timeout seconds (a lost node, a cut network:
# a collective that never returns) ends itself with this code, after one line naming it and
# what it waited for (hvdtrain/training/watchdog.py). Resume with --resume.
STALLED_EXIT_CODE = 76
