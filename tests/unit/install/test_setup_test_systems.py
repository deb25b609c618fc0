"""``launch/setup.sh --with-test-systems`` installs what the Slurm, podman and multi-node tests
need (tests/support/system_packages.py: a test that finds one missing skips, naming it), and
only ``make test`` asks for it."""

from __future__ import annotations

import re
import subprocess

import system_packages
from conftest import REPO

SETUP = REPO / "launch" / "setup.sh"


def test_setup_installs_exactly_the_packages_the_tests_check_for():
    listed = re.search(r"^test_system_packages=\(([^)]*)\)", SETUP.read_text(), re.M)
    assert listed, "launch/setup.sh has no test_system_packages=(...) list"
    assert sorted(listed.group(1).split()) == sorted(system_packages.EVERY)
    assert system_packages.INSTALL.split()[1] in re.findall(r"^\s+(--[\w-]+)\)",
                                                            SETUP.read_text(), re.M)


def test_setup_help_names_the_option_and_make_test_alone_passes_it():
    shown = subprocess.run(["bash", str(SETUP), "--help"], text=True, capture_output=True,
                           timeout=30, stdin=subprocess.DEVNULL)
    assert shown.returncode == 0 and "--with-test-systems" in shown.stdout
    assert "launch/setup.sh --with mlflow" in shown.stdout
    dry = {target: subprocess.run(["make", "-n", "-C", str(REPO), target], text=True,
                                  capture_output=True, timeout=30).stdout
           for target in ("test", "train", "test-fast")}
    assert "launch/setup.sh" in dry["test"] and "--with-test-systems" in dry["test"]
    assert "--with mlflow" in dry["test"] and "--with mlflow" not in dry["train"]
    assert "launch/setup.sh" in dry["train"] and "--with-test-systems" not in dry["train"]
    # With the venv there (it runs this test), test-fast runs no setup: none of its checks.
    assert "launch/setup.sh" not in dry["test-fast"] and "pytest tests/unit" in dry["test-fast"]


def test_a_missing_package_is_named_with_the_command_that_installs_it():
    assert system_packages.missing("hvdtrain-no-such-package") == ["hvdtrain-no-such-package"]
    reason = system_packages.why_missing(["podman", "runc"])
    assert reason == ("needs Debian packages podman runc: as root run "
                      "launch/setup.sh --with-test-systems")
    assert "\n" not in reason
