"""The one exception type for user mistakes: shown as a single line, never as a traceback."""


class UserError(Exception):
    """Something the user can fix; the message names the problem and the fix in one line."""
