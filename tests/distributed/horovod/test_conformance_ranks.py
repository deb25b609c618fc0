"""``python -m hvdtrain.bench.conformance`` for real: the tiny Horovod-shaped suite of
tests/support/horovod_tree.py on 2 ranks on TensorFlow's collectives (not Horovod's suite: that
takes many minutes; the README gives its result). Its rewrite, counting and refusals in one
process: tests/unit/dropin/test_conformance.py."""

from __future__ import annotations

import json

import pytest

from conftest import RUN_TIMEOUT
from horovod_tree import horovod_shaped_tree
from hvdtrain.bench import conformance


@pytest.mark.distributed
def test_a_horovod_shaped_suite_on_two_ranks_on_tensorflows_collectives(tmp_path, capsys):
    checkout = horovod_shaped_tree(tmp_path / "horovod")
    deps = tmp_path / "deps"
    # The tiny suite imports neither mock nor parameterized: no pip, no network, in CI.
    deps.mkdir()
    (deps / ".installed").write_text(" ".join(conformance.TEST_DEPENDENCIES))
    out = tmp_path / "out"
    assert conformance.main([str(checkout), "--runs", "tensorflow", "--files",
                             "test_tensorflow.py", "--out", str(out), "--deps-dir", str(deps),
                             "--timeout", str(RUN_TIMEOUT)]) == 0
    printed = capsys.readouterr().out
    copied = (out / "suite" / "dropin" / "parallel" / "test_tensorflow.py").read_text()
    assert "import hvdtrain.tensorflow as hvd\n" in copied and "import horovod" not in copied
    # Methods: size passes; rank_is_negative and eager_only (graph mode) fail; gpu skipped.
    # Each of the four runs in both modes.
    assert "| tensorflow | test_tensorflow.py | 1/2/1 (exit 1) | 1/2/1 | 2/1/1 |" in printed
    assert ("TensorFlowTests::test_eager_only: [graph] AssertionError: False is not true : "
            "graph mode") in printed
    results = json.loads((out / "conformance.json").read_text())
    assert results[0]["methods"]["TensorFlowTests::test_gpu"]["outcome"] == "skipped"
