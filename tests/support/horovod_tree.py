"""A tiny Horovod-shaped checkout for ``python -m hvdtrain.bench.conformance``: the files the
runner copies from a Horovod checkout, at Horovod's paths, with Horovod's import lines, and four
tests: one passing, one failing, one skipped, and one run in graph and eager mode the way
Horovod's test_tensorflow.py runs its tests (failing in graph mode only). Used by
tests/unit/dropin/test_conformance.py and tests/distributed/horovod/test_conformance_ranks.py."""

from __future__ import annotations

from pathlib import Path


BASE = '''import tensorflow as tf
from horovod.tensorflow.util import _executing_eagerly


class BaseTensorFlowTests(tf.test.TestCase):
    def evaluate(self, tensors):
        return self.evaluate_eagerly(tensors) if _executing_eagerly() else super().evaluate(tensors)

    def evaluate_eagerly(self, tensors):
        return tensors.numpy()
'''


TESTS = '''import os
import sys

import tensorflow as tf
from horovod.tensorflow.util import _executing_eagerly

sys.path.append(os.path.join(os.path.dirname(__file__), os.pardir, 'utils'))

from common import two  # noqa

import horovod.tensorflow as hvd

from base_test_tensorflow import *  # noqa


class TensorFlowTests(BaseTensorFlowTests):
    def test_size(self):
        hvd.init()
        self.assertEqual(hvd.size(), two())

    def test_rank_is_negative(self):
        hvd.init()
        self.assertEqual(hvd.rank(), -1, "deliberately false")

    def test_gpu(self):
        self.skipTest("No GPUs available")

    def test_eager_only(self):
        hvd.init()
        self.assertTrue(_executing_eagerly(), "graph mode")


from tensorflow.python.framework.test_util import run_all_in_graph_and_eager_modes  # noqa
run_all_in_graph_and_eager_modes(TensorFlowTests)
'''


def horovod_shaped_tree(root: Path) -> Path:
    """The files the runner copies, at Horovod's paths."""
    (root / "test" / "parallel").mkdir(parents=True)
    (root / "test" / "utils").mkdir()
    (root / "test" / "utils" / "common.py").write_text("def two():\n    return 2\n")
    (root / "test" / "parallel" / "base_test_tensorflow.py").write_text(BASE)
    (root / "test" / "parallel" / "test_tensorflow.py").write_text(TESTS)
    return root
