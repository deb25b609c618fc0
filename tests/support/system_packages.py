"""The Debian packages the Slurm, podman and multi-node tests need. ``launch/setup.sh
--with-test-systems`` installs them (``make test`` passes it), never pytest: a test that finds
one missing skips, naming that command."""

from __future__ import annotations

import shutil
import subprocess

SLURM = ("munge", "slurmctld", "slurmd", "slurm-client")
PODMAN = ("podman", "runc", "debootstrap", "uidmap")
NETWORK_CLUSTER = ("openssh-server", "iproute2")     # netcluster.py; with --slurm also SLURM
EVERY = SLURM + PODMAN + NETWORK_CLUSTER
INSTALL = "launch/setup.sh --with-test-systems"


def missing(*packages: str) -> list[str]:
    """Those of ``packages`` that dpkg does not report installed (all of them without dpkg)."""
    if shutil.which("dpkg-query") is None:
        return list(packages)

    def installed(package: str) -> bool:
        result = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], text=True,
                                capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
        return result.stdout == "install ok installed"
    return [p for p in packages if not installed(p)]


def why_missing(packages: list[str]) -> str:
    """One line: what is missing and the command that installs it."""
    return f"needs Debian packages {' '.join(packages)}: as root run {INSTALL}"
