"""The line ``--autotune`` ends with, as the unit and the 2-rank autotune tests read it."""

from __future__ import annotations

import re

FINAL_LINE = re.compile(r"autotune: best --bucket-mib (?P<bucket>\S+) with "
                        r"HOROVOD_CYCLE_TIME=(?P<cycle>\S+) \((?P<best>\S+) ms/step vs "
                        r"(?P<launched>\S+) ms/step as launched\)")
