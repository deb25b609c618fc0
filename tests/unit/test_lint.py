"""The linter configured in setup.cfg stays clean."""

import subprocess
import sys

from conftest import REPO


def test_flake8_is_clean():
    result = subprocess.run([sys.executable, "-m", "flake8", "hvdtrain", "tests"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
