"""``python -m hvdtrain.bench.conformance``: its import rewrite, its counting, its refusals,
on the tiny Horovod-shaped tree of tests/support/horovod_tree.py, in one process. Its real
2-rank run: tests/distributed/horovod/test_conformance_ranks.py.
"""

from __future__ import annotations

import logging

import pytest

from horovod_tree import TESTS, horovod_shaped_tree
from hvdtrain.bench import conformance


def test_only_import_lines_change_and_a_missing_one_is_named():
    rewrite = conformance.rewrite_imports(TESTS, "test_tensorflow.py")
    before, after = TESTS.splitlines(), rewrite.text.splitlines()
    changed = [(old, new) for old, new in zip(before, after) if old != new]
    assert changed == [
        ("from horovod.tensorflow.util import _executing_eagerly",
         "from hvdtrain.tensorflow.util import _executing_eagerly"),
        ("import horovod.tensorflow as hvd", "import hvdtrain.tensorflow as hvd")]
    keras = conformance.rewrite_imports(
        "import horovod.keras as hvd_keras\nimport horovod.tensorflow.keras as hvd\n"
        "    from horovod.runner.util.threads import in_thread\n", "test_tensorflow2_keras.py")
    assert keras.text.splitlines()[:2] == ["import hvdtrain.keras as hvd_keras",
                                           "import hvdtrain.keras as hvd"]
    assert keras.kept == ["from horovod.runner.util.threads import in_thread"]
    with pytest.raises(conformance.ConformanceError, match="^test_tensorflow.py: expected"):
        conformance.rewrite_imports(TESTS.replace("import horovod.tensorflow as hvd", ""),
                                    "test_tensorflow.py")


def entry(outcome: str, reason: str = "", **modes: str) -> dict:
    return {"outcome": outcome, "reason": reason, "modes": modes,
            "mode_reasons": {mode: f"{mode} broke" for mode in modes}}


def test_a_method_or_mode_fails_when_it_failed_on_either_rank():
    rank0 = {"A::ok": entry("passed", graph="passed", eager="passed"),
             "A::graph": entry("passed", graph="failed", eager="passed"),
             "A::gpu": entry("skipped", "No GPUs", graph="skipped", eager="skipped"),
             "A::one_rank": entry("passed"),
             "A::died": entry("passed")}
    rank1 = dict(rank0, **{"A::one_rank": entry("failed", "AssertionError: 1 != 0"),
                           "A::died": entry("missing")})
    methods = conformance.combine([rank0, rank1])
    counts = conformance.count(methods)
    assert conformance.cell(counts["methods"]) == "1/3/1"
    assert conformance.cell(counts["graph"]) == "1/1/1"
    assert conformance.cell(counts["eager"]) == "2/0/1"
    assert methods["A::graph"]["reason"] == "[graph] graph broke"
    assert methods["A::one_rank"]["reason"] == "AssertionError: 1 != 0"
    assert "no result from rank 1" in methods["A::died"]["reason"]
    printed = conformance.table([{"run": "tensorflow", "file": "t.py", "status": 1,
                                  "seconds": 3.0, "methods": methods},
                                 {"run": "upstream", "file": "t.py", "skipped": "no horovod"}])
    assert "| tensorflow | t.py | 1/3/1 (exit 1) | 1/1/1 | 2/0/1 | 3 |" in printed
    assert "| upstream | t.py | skipped: no horovod |" in printed
    assert "- tensorflow t.py A::graph: [graph] graph broke" in printed


def test_a_failures_reason_is_the_errors_line_also_from_inside_a_tf_function():
    from types import SimpleNamespace

    from hvdtrain.bench.conformance_plugin import one_line

    def report(message: str) -> SimpleNamespace:
        return SimpleNamespace(reprcrash=SimpleNamespace(message=message))

    assert one_line(report("ValueError: bad\nmore")) == "ValueError: bad"
    traced = ("UserError: in user code:\n\n    File \"t.py\", line 5, in step  *\n"
              "        tape.register_local_source(w)\n\n    UserError: not supported\n")
    assert one_line(report(traced)) == "UserError: not supported"


def test_a_path_that_is_not_a_horovod_checkout_is_one_line_and_exit_2(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    assert conformance.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [f"conformance: {tmp_path} is not a Horovod checkout: "
                      "test/parallel/test_tensorflow.py is missing"]


def test_without_horovod_the_upstream_run_is_skipped_in_one_line(tmp_path, caplog,
                                                                 monkeypatch, capsys):
    deps = tmp_path / "deps"
    deps.mkdir()
    (deps / ".installed").write_text(" ".join(conformance.TEST_DEPENDENCIES))
    monkeypatch.setattr(conformance, "horovod_importable",
                        lambda env: "ModuleNotFoundError: No module named 'horovod'")
    caplog.set_level(logging.INFO)
    assert conformance.main([str(horovod_shaped_tree(tmp_path / "horovod")), "--runs",
                             "upstream", "--files", "test_tensorflow.py", "--out",
                             str(tmp_path / "out"), "--deps-dir", str(deps)]) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["upstream run skipped: import horovod.tensorflow fails here: "
                        "ModuleNotFoundError: No module named 'horovod'"]
    assert "| upstream | test_tensorflow.py | skipped: " in capsys.readouterr().out
