"""A process's start: how long it took to get to work, counted from the moment the operating
system started it (interpreter start, imports, Horovod's initialisation, data, model and the
first step's tracing all count, which is what a user waits through after typing the launch
command), and a quiet stderr for the command-line entry."""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time

_IMPORTED = time.monotonic()


def process_age_seconds() -> float:
    """Seconds since this process started (Linux ``/proc``; elsewhere, since hvdtrain's import,
    which misses only the interpreter's own start)."""
    try:
        with open("/proc/self/stat") as stat:
            # Field 22, after the parenthesised command name (which may hold spaces).
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


# Informational lines TensorFlow's native code writes straight to file descriptor 2 before its
# logging is set up, so TF_CPP_MIN_LOG_LEVEL cannot hide them (the oneDNN notice comes twice a
# process). They say nothing a user can act on; every other line passes through unchanged.
NATIVE_NOTICES = re.compile(
    rb"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
    rb"STDERR|I\d{4} [\d:. ]+\d+ (port|cpu_feature_guard)\.cc:\d+\] .*|To enable the following "
    rb"instructions: .*rebuild TensorFlow with the appropriate compiler flags\.)\n?$")
# The descriptor that reaches the process's real stderr: 2, or its copy once
# ``hide_native_notices`` has put a filtering pipe on 2.
_real_stderr = 2


def real_stderr() -> int:
    """The file descriptor of the real stderr, for a line written just before ``os._exit``: a
    write to 2 goes through ``hide_native_notices``' pipe, whose reader thread the exit ends
    before it has forwarded the line."""
    return _real_stderr


def hide_native_notices() -> None:
    """Route native writes to stderr through a filter that drops ``NATIVE_NOTICES``.

    Python's own ``sys.stderr`` (hvdtrain's one-line errors, tracebacks, warnings) keeps writing
    to the real stderr directly, so nothing it prints can be held up or lost at exit. For the
    command-line entry only: it replaces the process's file descriptor 2.
    """
    global _real_stderr
    real = _real_stderr = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    sys.stderr = open(real, "w", buffering=1, closefd=False)

    def forward() -> None:
        with open(read_end, "rb", buffering=0) as lines:
            for line in iter(lines.readline, b""):
                if not NATIVE_NOTICES.match(line):
                    try:
                        os.write(real, line)
                    except OSError:     # the launcher is gone: drop what comes from now on
                        os.dup2(os.open(os.devnull, os.O_WRONLY), real)

    worker = threading.Thread(target=forward, name="hvdtrain-stderr", daemon=True)
    worker.start()

    def drain() -> None:
        os.dup2(real, 2)          # closes the pipe's last write end: the reader sees its end
        worker.join(timeout=2)

    atexit.register(drain)
