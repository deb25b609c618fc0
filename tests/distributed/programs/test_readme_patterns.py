"""The four complete programs of hvdtrain/README.md, which README.md summarises and links (a
custom train_step, a GAN, preprocessing layers, a tf.data time series), run as written on 2 ranks
and end with the same weights on both."""

from __future__ import annotations

import json
import re

import pytest

from conftest import LAUNCHER, RANK_PYTHONPATH, launch
from readme_pattern_ranks import PATTERNS, pattern_blocks

pytestmark = pytest.mark.distributed


def test_the_readme_patterns_run_on_two_ranks_with_identical_weights(tmp_path):
    blocks = pattern_blocks(PATTERNS.read_text())
    assert len(blocks) == 4
    result = launch(LAUNCHER, 2, [str(tmp_path)], module="readme_pattern_ranks",
                    timeout=400, PYTHONPATH=RANK_PYTHONPATH)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    reports = [json.loads(line) for line in re.findall(r"pattern (\{.*\})", output)]
    assert sorted(report["number"] for report in reports) == [1, 1, 2, 2, 3, 3, 4, 4], output
    for report in reports:
        assert len(report["fingerprints"]) == 2 and len(set(report["fingerprints"])) == 1, report
        assert report["epochs"] in (2, 3), report
    assert output.count("step: the model's own train_step") >= 2, output[-4000:]
