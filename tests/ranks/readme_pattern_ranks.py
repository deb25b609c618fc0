"""Runs on every rank: each Python block of the "Four patterns, complete" section of
hvdtrain/README.md (the package's reference, which README.md links), as a user would run the
saved program, one after another in the same process (each in its own working directory), and
prints one line per block with the weight digests of every rank."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

PATTERNS = Path(__file__).resolve().parents[2] / "hvdtrain" / "README.md"
SECTION = "\n## Four patterns, complete\n"


def pattern_blocks(doc: str) -> list[str]:
    """The ```python blocks between the section's heading and the next heading."""
    section = doc.split(SECTION, 1)[1]
    section = re.split(r"\n#{2,3} ", section, maxsplit=1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def main(directory: str) -> None:
    for number, code in enumerate(pattern_blocks(PATTERNS.read_text()), start=1):
        workdir = Path(directory) / f"pattern-{number}"
        workdir.mkdir(parents=True, exist_ok=True)
        os.chdir(workdir)
        namespace = {"__name__": "__main__"}
        exec(compile(code, f"hvdtrain/README.md pattern {number}", "exec"), namespace)
        result = namespace["result"]
        print("pattern " + json.dumps({"number": number, "fingerprints": result.fingerprints,
                                       "epochs": len(result.history.epoch)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
