"""The linter and the type checker configured in setup.cfg stay clean (``make lint`` runs both)."""

import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.slow   # a fresh Python reading the whole tree (5 s of CPU): make lint, make test
def test_flake8_is_clean():
    result = subprocess.run([sys.executable, "-m", "flake8", "hvdtrain", "tests"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean():
    """The packages whose design rests on protocols (setup.cfg's ``[mypy] files``: the
    collectives, the step, the data contract) type-check."""
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_test_files_have_unique_names():
    """pytest imports each test file by its name alone (no packages under tests/), so two
    files of one name in different folders stop the whole run at collection."""
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert not {name for name in names if names.count(name) > 1}
