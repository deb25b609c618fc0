"""How long a process took to get to work, counted from the moment the operating system started
it: interpreter start, imports, Horovod's initialisation, data, model and the first step's
tracing all count, which is what a user waits through after typing the launch command."""

from __future__ import annotations

import os
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
