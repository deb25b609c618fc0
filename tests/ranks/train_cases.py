"""Several ``hvdtrain train`` command lines, one after the other, in the same rank processes:

    mpirun -np 2 python -m train_cases CASES_JSON      (or python -m train_cases CASES_JSON)

CASES_JSON lists ``{"argv": [...], "stem": PATH}``: each case is ``hvdtrain.cli.main(argv)`` as
the console script runs it, its lines (stdout and stderr, rank 0's also copied into the run's
``hvdtrain.log`` as ``python -m hvdtrain`` does) written to ``STEM.rank<R>.log`` and its exit
code to ``STEM.rank<R>.code``. A run restores the process-wide state it set (seeds, op
determinism, the dtype policy: ``training/process_state``), so each case trains what a job of
its own trains; the launch (TensorFlow's import, the collectives' start) is paid once. One
backend per job: a process starts its collectives once. ``tests/support/case_jobs.py`` launches
it and reads the cases back.

A case that fails ends the job (an exception that is not a user mistake ends the process, and
the launcher stops the other ranks), so collectives left shut down or half done cannot hang the
next case; the cases after it have no code file.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import keras

from hvdtrain import streams
from hvdtrain.cli import main as hvdtrain_main
from hvdtrain.startup import hide_native_notices

RANK = os.environ.get("OMPI_COMM_WORLD_RANK", "0")


def run_case(argv: list[str], stem: str) -> int:
    """One case's command line with this rank's lines in its own log; its code beside it.

    Keras' session is cleared first, as a process of its own starts: the names it gives
    layers count up per process, rank 0 alone builds models after a run (saving a mixed
    precision model as float32), and Horovod matches a collective across ranks by its name
    (the layer's): without it, a mixed precision run after another found Horovod shut down."""
    keras.backend.clear_session()
    with open(f"{stem}.rank{RANK}.log", "w", buffering=1) as handle:
        stream = streams.RankStream(handle)
        try:
            with redirect_stdout(stream), redirect_stderr(stream):
                code = hvdtrain_main(argv)
        except BaseException:
            handle.write(traceback.format_exc())
            raise
        finally:
            if streams.RankStream.log is not None:    # rank 0's hvdtrain.log of this run
                streams.RankStream.log.close()
                streams.RankStream.log = None
    Path(f"{stem}.rank{RANK}.code").write_text(str(code))
    return code


def run_all(cases_file: str) -> None:
    hide_native_notices()
    for case in json.loads(Path(cases_file).read_text()):
        if run_case(case["argv"], case["stem"]) != 0:
            break      # the collectives may be left shut down: the next case would wait
    sys.stdout.flush()


if __name__ == "__main__":
    run_all(sys.argv[1])
