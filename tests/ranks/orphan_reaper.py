"""Start a command, SIGKILL one process of its tree (by name) once a path appears, and report
the exit codes of the processes that were orphaned by it.

    python tests/ranks/orphan_reaper.py --when 'run/checkpoints/epoch-*-step-*' --kill mpirun \
        --within 60 -- launch/mpirun.sh -np 2 ...

This process makes itself a child subreaper, so the killed process's children (the ranks) are
handed to it instead of to init, and their exit codes, which nobody else would see, can be
read. Prints one JSON object: {"command": code, "orphans": {pid: code}}.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        parent = int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        queue += children.get(current, [])
    return found


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--when", required=True, help="a glob: kill once it matches")
    parser.add_argument("--kill", required=True, help="the command name to SIGKILL")
    parser.add_argument("--within", type=float, default=60.0, help="seconds to wait for orphans")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    job = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    while not glob.glob(args.when):
        if job.poll() is not None:
            print(json.dumps({"command": job.returncode, "orphans": {}}))
            return 1
        time.sleep(0.2)
    victims = [pid for pid in tree(job.pid) if comm(pid) == args.kill]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    codes: dict[int, int] = {}
    deadline = time.time() + args.within
    while time.time() < deadline:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:          # no child and no orphan left
            break
        if pid == 0:
            time.sleep(0.1)
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
    command_code = codes.pop(job.pid, None)
    print(json.dumps({"command": command_code, "killed": victims,
                      "orphans": {str(pid): code for pid, code in codes.items()
                                  if pid not in victims}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
