"""``python -m hvdtrain.bench.conformance HOROVOD_CHECKOUT``: Horovod's own TensorFlow tests
against Horovod and against hvdtrain's drop-in, on 2 ranks, counted per method and per mode.

The drop-in claims a Horovod program runs with only its import lines changed; Horovod's test
suite is the largest body of such programs. From a checkout of Horovod's repository (none of it
kept here), it copies ``test_tensorflow.py`` and ``test_tensorflow2_keras.py`` into ``--out``,
rewrites only their imports for the drop-in, and runs each under ``horovodrun -np 2``: unchanged
against Horovod (``upstream``), then on the drop-in with each backend. ``conformance_plugin``
records each method per rank and mode. Prints a markdown table and each failure, writes
``conformance.json``; the tests' own dependencies go into a folder of ``--out``, never into this
environment.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hvdtrain

log = logging.getLogger("hvdtrain.bench.conformance")

DEFAULT_FILES = ("test_tensorflow.py", "test_tensorflow2_keras.py")
# run name -> (which copy of the suite, HVDTRAIN_BACKEND or None for Horovod itself)
RUNS = {"upstream": ("upstream", None), "horovod": ("dropin", "horovod"),
        "tensorflow": ("dropin", "tensorflow")}
RANKS = 2
MODES = ("graph", "eager")
OUTCOMES = ("passed", "failed", "skipped")
# What Horovod's tests import besides the module under test (pip names).
TEST_DEPENDENCIES = ("mock", "parameterized")
PIP_TIMEOUT = 300
IMPORT_CHECK_TIMEOUT = 180
# The helpers test_tensorflow.py imports, beside the tests (test/parallel) and in test/utils.
SUPPORT_FILES = ("parallel/base_test_tensorflow.py", "utils/common.py")
# module -> the drop-in's module; longest first, so horovod.tensorflow.keras wins.
MODULE_RENAMES = (("horovod.tensorflow.keras", "hvdtrain.keras"),
                  ("horovod.tensorflow", "hvdtrain.tensorflow"),
                  ("horovod.keras", "hvdtrain.keras"))
# A Horovod import that is not the API under test and that the drop-in has no module for: the
# one line that replaces it (test_tensorflow2_keras.py's version comparison).
LINE_REPLACEMENTS = {
    "from horovod.common.util import is_version_greater_equal_than":
        "from packaging.version import parse as _v; "
        "is_version_greater_equal_than = lambda a, b: _v(a) >= _v(b)  # noqa",
}
# The import lines each file is known to have: absent means another Horovod version whose
# rewrite would be incomplete, which must not pass silently as "the drop-in's result".
EXPECTED_IMPORTS = {
    "test_tensorflow.py": ("import horovod.tensorflow as hvd",
                           "from horovod.tensorflow.util import _executing_eagerly"),
    "base_test_tensorflow.py": ("from horovod.tensorflow.util import _executing_eagerly",),
    "test_tensorflow2_keras.py": ("import horovod.tensorflow.keras as hvd",),
}
IMPORT_LINE = re.compile(r"^(\s*)(import|from)\s+(horovod[\w.]*)(.*)$")


class ConformanceError(Exception):
    """A mistake in what the command was given: reported in one line, exit status 2."""


@dataclass
class Rewrite:
    """The drop-in copy of one file and which of its lines changed."""

    text: str
    changed: list[tuple[str, str]]
    kept: list[str]


def rewrite_imports(text: str, filename: str) -> Rewrite:
    """Point a Horovod test file's import lines at the drop-in; nothing else changes.

    Horovod imports outside the API (``horovod.runner`` in test/utils/common.py) are kept, and
    reported, since the drop-in does not replace Horovod's launcher tooling.
    """
    lines = text.splitlines(keepends=True)
    found = {line.strip() for line in lines}
    missing = [line for line in EXPECTED_IMPORTS.get(filename, ()) if line not in found]
    if missing:
        raise ConformanceError(f"{filename}: expected import line not found: {missing[0]!r}")
    changed, kept = [], []
    for number, line in enumerate(lines):
        match = IMPORT_LINE.match(line.rstrip("\n"))
        if not match:
            continue
        indent, _, module, _ = match.groups()
        new = LINE_REPLACEMENTS.get(line.strip())
        if new is None:
            rename = next(((old, mine) for old, mine in MODULE_RENAMES
                           if module == old or module.startswith(old + ".")), None)
            if rename is None:
                kept.append(line.strip())
                continue
            new = line.strip().replace(rename[0], rename[1], 1)
        lines[number] = indent + new + "\n"
        changed.append((line.strip(), new))
    return Rewrite("".join(lines), changed, kept)


def build_suites(checkout: Path, files: list[str], work: Path) -> dict[str, Path]:
    """Copy the test files into ``work/upstream`` as they are and into ``work/dropin``
    rewritten; return each copy's test/parallel folder (where pytest runs)."""
    test = checkout / "test"
    wanted = [f"parallel/{name}" for name in files] + list(SUPPORT_FILES)
    for relative in wanted:
        if not (test / relative).is_file():
            raise ConformanceError(f"{checkout} is not a Horovod checkout: "
                                   f"test/{relative} is missing")
    suites = {}
    for flavor in ("upstream", "dropin"):
        root = work / flavor
        shutil.rmtree(root, ignore_errors=True)
        for relative in wanted:
            text = (test / relative).read_text()
            if flavor == "dropin":
                rewrite = rewrite_imports(text, Path(relative).name)
                for old, new in rewrite.changed:
                    log.debug("%s: %s -> %s", relative, old, new)
                for line in rewrite.kept:
                    log.info("%s: kept (not the API under test): %s", relative, line)
                text = rewrite.text
            (root / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / relative).write_text(text)
        # An empty ini makes this folder pytest's rootdir: a setup.cfg or pytest.ini above
        # --out (a project's own options, markers) must not apply to Horovod's tests.
        (root / "pytest.ini").write_text("[pytest]\n")
        suites[flavor] = root / "parallel"
    return suites


def install_dependencies(target: Path) -> Path:
    """``pip install --target`` the tests' own imports once into ``target`` (then reused)."""
    done = target / ".installed"
    if done.is_file() and done.read_text().split() == list(TEST_DEPENDENCIES):
        return target
    log.info("installing %s into %s", " ".join(TEST_DEPENDENCIES), target)
    shutil.rmtree(target, ignore_errors=True)
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--disable-pip-version-check", "--target", str(target),
                        *TEST_DEPENDENCIES], check=True, timeout=PIP_TIMEOUT)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        raise ConformanceError(f"pip could not install {' '.join(TEST_DEPENDENCIES)} into "
                               f"{target} ({error}); pass --deps-dir with them installed")
    done.write_text(" ".join(TEST_DEPENDENCIES))
    return target


def horovod_importable(env: dict[str, str]) -> str:
    """Empty when ``import horovod.tensorflow`` works in a fresh process, else why not."""
    try:
        result = subprocess.run([sys.executable, "-c", "import horovod.tensorflow"], env=env,
                                capture_output=True, text=True, timeout=IMPORT_CHECK_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"import horovod.tensorflow took over {IMPORT_CHECK_TIMEOUT} s"
    if result.returncode == 0:
        return ""
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {result.returncode}"


def launcher() -> Path:
    """horovodrun beside this interpreter (the environment the ranks must run in)."""
    path = Path(sys.executable).parent / "horovodrun"
    if not path.is_file():
        raise ConformanceError(f"horovodrun not found beside {sys.executable}")
    return path


def base_env(deps: Path) -> dict[str, str]:
    """This environment, plus the private test dependencies and this hvdtrain on the path."""
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    source = str(Path(hvdtrain.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(deps), source,
                                                      env.get("PYTHONPATH", "")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_file(parallel: Path, filename: str, backend: str | None, env: dict[str, str],
             out: Path, timeout: float) -> dict[str, Any]:
    """One file on 2 ranks; returns the per-rank outcomes, exit status and seconds."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(env, HVDTRAIN_CONFORMANCE_DIR=str(out))
    if backend:
        env["HVDTRAIN_BACKEND"] = backend
    command = [str(launcher()), "-np", str(RANKS), "-H", f"localhost:{RANKS}", sys.executable,
               "-m", "pytest", "-p", "hvdtrain.bench.conformance_plugin", "-p",
               "no:cacheprovider", "--color=no", "-q", "-W", "ignore::DeprecationWarning",
               filename]
    started = time.monotonic()
    with open(out / "launcher.log", "w") as output:
        process = subprocess.Popen(command, cwd=parallel, env=env, stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status: int | str = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # horovodrun's ranks are in its session: end them all, not just the launcher.
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = f"timed out after {timeout:.0f} s"
    ranks = []
    for rank in range(RANKS):
        path = out / f"outcomes-{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.is_file() else {})
    return {"status": status, "seconds": round(time.monotonic() - started, 1), "ranks": ranks}


def combine(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One outcome per method and per mode over all ranks: failed if it failed on any rank
    (or a rank never reported it), else skipped if skipped on any, else passed."""
    names = sorted(set().union(*ranks)) if ranks else []
    methods = {}
    for name in names:
        entries = [r.get(name, {"outcome": "missing", "reason": "", "modes": {}})
                   for r in ranks]
        modes, reasons = {}, []
        for mode in MODES:
            seen = [e["modes"][mode] for e in entries if mode in e["modes"]]
            if not seen:
                continue
            modes[mode] = worst(seen + ["missing"] * (len(entries) - len(seen)))
            reasons += [f"[{mode}] {e['mode_reasons'][mode]}" for e in entries
                        if e["modes"].get(mode) == "failed"][:1]
        outcome = worst([e["outcome"] for e in entries] + list(modes.values()))
        reasons += [e["reason"] for e in entries if e["outcome"] == "failed"][:1]
        missing = [str(rank) for rank, e in enumerate(entries) if e["outcome"] == "missing"]
        if missing:
            reasons.append(f"no result from rank {', '.join(missing)} (crashed or timed out)")
        methods[name] = {"outcome": outcome, "modes": modes,
                         "reason": "; ".join(reasons) if outcome == "failed" else ""}
    return methods


def worst(outcomes: list[str]) -> str:
    """failed (or missing) beats skipped beats passed."""
    if "failed" in outcomes or "missing" in outcomes:
        return "failed"
    return "skipped" if "skipped" in outcomes else "passed"


def count(methods: dict[str, dict[str, Any]]) -> dict[str, Counter]:
    """passed/failed/skipped over methods, and over each mode's subtests."""
    counts = {"methods": Counter(m["outcome"] for m in methods.values())}
    for mode in MODES:
        counts[mode] = Counter(m["modes"][mode] for m in methods.values() if mode in m["modes"])
    return counts


def cell(counter: Counter) -> str:
    """``passed/failed/skipped``."""
    return "/".join(str(counter.get(outcome, 0)) for outcome in OUTCOMES)


def status_note(status: int | str) -> str:
    """Nothing for exit 0; pytest exits 1 whenever a test fails, so a note, not an error."""
    if status == 0:
        return ""
    return f" (exit {status})" if isinstance(status, int) else f" ({status})"


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table and, under it, each failure with its one-line reason."""
    lines = ["| run | file | methods passed/failed/skipped | graph mode p/f/s | eager mode p/f/s "
             "| seconds |", "|---|---|---|---|---|---|"]
    failures = []
    for result in results:
        if result.get("skipped"):
            lines.append(f"| {result['run']} | {result['file']} | skipped: {result['skipped']} "
                         "| | | |")
            continue
        counts = count(result["methods"])
        status = status_note(result["status"])
        lines.append(f"| {result['run']} | {result['file']} | {cell(counts['methods'])}{status} "
                     f"| {cell(counts['graph'])} | {cell(counts['eager'])} "
                     f"| {result['seconds']:.0f} |")
        failures += [f"- {result['run']} {result['file']} {name}: {method['reason']}"
                     for name, method in result["methods"].items()
                     if method["outcome"] == "failed"]
    if failures:
        lines += ["", "Failures (first rank's reason):", *failures]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.bench.conformance",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a checkout of Horovod's repository")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"comma-separated, of {', '.join(RUNS)} (default: all)")
    parser.add_argument("--files", default=",".join(DEFAULT_FILES),
                        help="test/parallel files, comma-separated (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("conformance-out"),
                        help="work folder: the copied suites, logs, conformance.json")
    parser.add_argument("--deps-dir", type=Path,
                        help="where mock and parameterized go (default: OUT/deps)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per (run, file)")
    return parser


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every requested (run, file), in order; each result as :func:`table` reads it."""
    runs = [run for run in args.runs.split(",") if run]
    unknown = [run for run in runs if run not in RUNS]
    if unknown:
        raise ConformanceError(f"unknown run {unknown[0]!r} (choose from {', '.join(RUNS)})")
    files = [name for name in args.files.split(",") if name]
    out = args.out.resolve()
    suites = build_suites(args.checkout.resolve(), files, out / "suite")
    env = base_env(install_dependencies((args.deps_dir or out / "deps").resolve()))
    no_horovod = horovod_importable(env) if "upstream" in runs else ""
    if no_horovod:
        log.warning("upstream run skipped: import horovod.tensorflow fails here: %s", no_horovod)
    results = []
    for run in runs:
        flavor, backend = RUNS[run]
        for name in files:
            result: dict[str, Any] = {"run": run, "file": name}
            if run == "upstream" and no_horovod:
                result["skipped"] = f"import horovod.tensorflow fails: {no_horovod}"
            else:
                log.info("%s: %s on %d ranks", run, name, RANKS)
                outcome = run_file(suites[flavor], name, backend, env,
                                   out / "runs" / f"{run}-{Path(name).stem}", args.timeout)
                result.update(status=outcome["status"], seconds=outcome["seconds"],
                              methods=combine(outcome["ranks"]))
                log.info("%s: %s: %s in %.0f s", run, name,
                         cell(count(result["methods"])["methods"]), outcome["seconds"])
            results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write conformance.json; 2 and one line for a usage mistake."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        results = run_all(args)
    except ConformanceError as error:
        log.error("conformance: %s", error)
        return 2
    (args.out / "conformance.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
