"""A full disk for the tests of what a run does when a write fails (ENOSPC): a small tmpfs
(root only; the test is skipped elsewhere), filled up to a few bytes, and the one error line a
failed write leaves. Used by tests/unit/checkpoints/test_checkpoints.py (the final save, one
process) and
tests/distributed/faults/test_checkpoint_faults.py (a metrics write, 2 ranks)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of ``size`` at ``path`` (root only), unmounted afterwards."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], timeout=30)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Fill ``disk`` up, then free ``leave_bytes``; returns the filler file."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass
    os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))
    return filler


def one_write_error(output: str, what: str, run_dir: Path, checkpoint: str) -> None:
    """Exactly one error line, the failed write's, naming the whole checkpoint; no traceback."""
    assert re.findall(r"hvdtrain: error: .*", output) == [
        f"hvdtrain: error: could not write {what} in {run_dir}: No space left on device "
        f"(ENOSPC); the last checkpoint {run_dir}/checkpoints/{checkpoint} is whole; free "
        "space or fix the quota or permissions, then continue with --resume auto"], output[-3000:]
    assert "Traceback" not in output
