"""``--autotune`` on 2 real ranks (horovodrun: the bucket size, then the cycle time, Horovod
restarted within the ranks): the final line comes out once, the process exits 0, and the run
directory holds the search's result and the run's log, no checkpoint and no model."""

from __future__ import annotations

import json
import re

import pytest

from hvdtrain.checkpoints.store import LOCK_FILE
from conftest import launch
from autotune_lines import FINAL_LINE

pytestmark = pytest.mark.distributed


def test_autotune_prints_the_best_flags_and_saves_nothing(tmp_path):
    run_dir = tmp_path / "tuned"
    result = launch("horovodrun", 2, ["--run-dir", str(run_dir), "--no-progress", "--dataset",
                                      "digits", "--model", "mlp", "--hidden-units", "1024", "512",
                                      "--autotune"], cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    untagged = re.sub(r"\[\d+,\d+\]<stdout>:", "", result.stdout)   # also mid-line
    finals = re.findall(r"autotune: best [^\n]*", untagged)
    assert len(finals) == 1, output                      # rank 0 alone prints
    found = FINAL_LINE.fullmatch(finals[0])
    assert found, finals[0]
    assert float(found["bucket"]) in (0, 1, 4, 16, 64), finals[0]
    assert sorted(path.name for path in run_dir.iterdir()) == [
        LOCK_FILE, "autotune.json", "hvdtrain.log"]
    saved = json.loads((run_dir / "autotune.json").read_text())
    assert saved["line"] == finals[0]
    assert saved["launched"] == {"bucket_mib": 4.0, "cycle_ms": 0.1}
    # 2.3 MiB of gradients: 0, 4, 16 and 64 MiB make one bucket (timed once), 1 MiB two.
    assert "split this model's gradients alike and are timed once: 4, 0, 16, 64 MiB" in untagged
    assert [(trial["bucket_mib"], trial["cycle_ms"]) for trial in saved["trials"][:2]] == [
        (4.0, 0.1), (1.0, 0.1)]
    assert [trial["cycle_ms"] for trial in saved["trials"][2:]] == [1.0, 5.0]
    assert "Horovod has been shut down" not in output
