"""A pytest plugin, loaded in each rank by ``python -m hvdtrain.bench.conformance``
(``-p hvdtrain.bench.conformance_plugin``): each test method's outcome, and its outcome per
mode where TensorFlow's ``run_all_in_graph_and_eager_modes`` runs it as the subtests
``graph_mode`` and ``eager_mode``, written to ``$HVDTRAIN_CONFORMANCE_DIR/outcomes-<rank>.json``.

pytest's own summary counts subtests and methods together and cannot say which mode failed,
and a rank that a launcher kills prints nothing at all: so every collected method is written
as ``missing`` first and the file is rewritten after each method, and what a rank finished
survives a timeout. Only the standard library and pytest's hooks are used here: this module
runs inside the tests' processes, beside TensorFlow and whichever Horovod they import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The subtest names TensorFlow's run_all_in_graph_and_eager_modes gives each mode.
MODE_SUBTESTS = {"graph_mode": "graph", "eager_mode": "eager"}
# tf.test.TestCase.test_session is a deprecated context manager that pytest collects (and
# skips as "Not a test."): TensorFlow's helper, not one of the suite's tests.
NOT_TESTS = {"test_session"}
REASON_CHARS = 240

_methods: dict[str, dict[str, Any]] = {}


def rank() -> str:
    """This process's rank, from whichever launcher started it (horovodrun's Gloo or MPI)."""
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return os.environ[name]
    return "0"


def one_line(longrepr: Any) -> str:
    """The exception's first line (type and message), which is what tells failures apart;
    pytest's report ends with the failing line's location instead."""
    crash = getattr(longrepr, "reprcrash", None)
    text = str(getattr(crash, "message", "") or "").strip()
    if not text:
        errors = [line[1:].strip() for line in str(longrepr).splitlines()
                  if line.startswith("E ")]
        text = errors[0] if errors else str(longrepr).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "failed"
    # An error raised inside a tf.function arrives as "<type>: in user code:", the traced
    # call stack, then the original error on the last line: that line is the reason.
    reason = lines[-1] if lines[0].endswith("in user code:") else lines[0]
    return reason[:REASON_CHARS]


def skip_reason(longrepr: Any) -> str:
    """A skip's message: pytest keeps it as (file, line, message)."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")[:REASON_CHARS]
    return one_line(longrepr)


def method_name(nodeid: str) -> str:
    """``Class::method`` without the file: the results key (a method's subtests share it)."""
    return "::".join(nodeid.split("::")[1:]) or nodeid


def write() -> None:
    """Rewrite this rank's file with everything recorded so far."""
    directory = Path(os.environ.get("HVDTRAIN_CONFORMANCE_DIR", "."))
    path = directory / f"outcomes-{rank()}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(_methods, indent=1, sort_keys=True))
    partial.replace(path)


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """Record every collected method as ``missing`` until its reports come in."""
    for item in items:
        name = method_name(item.nodeid)
        if name.split("::")[-1] not in NOT_TESTS:
            _methods[name] = {"outcome": "missing", "reason": "", "modes": {}}
    write()


def pytest_runtest_logreport(report: Any) -> None:
    """Fold one report (a phase of a method, or one of its subtests) into the method's entry."""
    entry = _methods.get(method_name(report.nodeid))
    if entry is None:
        return
    context = getattr(report, "context", None)
    mode = MODE_SUBTESTS.get(str(getattr(context, "msg", None)))
    if context is not None:
        if mode is None:
            # Another subtest (not a mode): its failure is the method's.
            if report.failed:
                entry["outcome"], entry["reason"] = "failed", one_line(report.longrepr)
            return
        if report.failed:
            entry["modes"][mode] = "failed"
            entry.setdefault("mode_reasons", {})[mode] = one_line(report.longrepr)
        elif report.skipped:
            entry["modes"][mode] = "skipped"
            entry.setdefault("mode_reasons", {})[mode] = skip_reason(report.longrepr)
        else:
            entry["modes"].setdefault(mode, "passed")
        return
    if report.failed or report.skipped:
        if entry["outcome"] in ("missing", "passed"):
            entry["outcome"] = report.outcome
            entry["reason"] = (one_line(report.longrepr) if report.failed
                               else skip_reason(report.longrepr))
    elif report.when == "call" and entry["outcome"] == "missing":
        entry["outcome"] = "passed"
    if report.when == "teardown":
        write()
