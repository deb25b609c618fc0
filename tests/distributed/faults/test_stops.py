"""Stopping a job cleanly and continuing it, for real: a stop signal to the launcher
(horovodrun.sh, mpirun.sh, srun) mid-epoch stops every rank at one step with a checkpoint, one
line and exit 75; a launcher lost mid-run; ``hvdtrain.fit`` stopped under mpirun.sh; a Slurm
time limit that requeues the job; a locked run directory; a second stop request, and one stuck
behind an ended rank (one process). Every resumed run ends with an uninterrupted run's weights
and metrics rows, also for models with dropout without ``--deterministic`` (checkpoints carry
every rank's random-generator state) and for a GAN with its own ``train_step`` through the
command line (both optimizers and every rank's noise generator)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (BACKENDS, RANKS, RANK_PYTHONPATH, REPO, SLOW_CYCLE_MS, assert_same_weights,
                      final_weights, processes_mentioning, rank_env, rank_pid, read_metrics,
                      read_summary, run, train, wait_for)
from hvdtrain.checkpoints.store import Checkpoint
from hvdtrain.cli import main
from jobs import (assert_nothing_left, finish, flip_a_byte, start_wrapper, step_checkpoint_after,
                  stop_after_a_step_checkpoint)
from uninterrupted_runs import ARGS, DROPOUT_ARGS, GAN_ARGS

STOPPED = 75
WRAPPERS = {"horovodrun.sh": "fit", "mpirun.sh": "custom"}


def lock_is_held(run_dir: Path) -> bool:
    """True when some process holds ``run_dir``'s lock (probed without waiting)."""
    fd = os.open(run_dir / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.contextmanager
def holding_the_lock(run_dir: Path):
    fd = os.open(run_dir / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on test-host\n".encode())
        yield
    finally:
        os.close(fd)


def assert_same_run(straight: Path, resumed: Path) -> None:
    """Equal final weights, and the same per-epoch rows (throughput aside)."""
    assert_same_weights(final_weights(straight), final_weights(resumed), atol=1e-6)
    theirs, ours = read_metrics(straight), read_metrics(resumed)
    assert [row["epoch"] for row in ours] == [row["epoch"] for row in theirs]
    for a, b in zip(theirs, ours):
        for name in ("loss", "accuracy", "val_loss", "val_accuracy", "lr"):
            assert b[name] == pytest.approx(a[name], rel=1e-6, abs=1e-9), (a["epoch"], name)


@pytest.mark.distributed
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_sigterm_to_the_launcher_stops_at_a_step_and_resume_auto_matches(
        tmp_path, capsys, uninterrupted, wrapper):
    """SIGTERM to the wrapper mid-run: every rank stops at the same step with exit 75 and one
    line, a mid-epoch checkpoint exists, nothing of the job remains; the job held the run
    directory's lock. horovodrun.sh: a run on a directory another process holds is refused.
    mpirun.sh: the newest checkpoint is damaged before the resume, which takes the one before.
    The resumed run loses a process after a later step checkpoint (horovodrun.sh: SIGKILL to
    rank 1; mpirun.sh: SIGKILL to mpirun, whose ranks must notice and end) and nothing of it
    remains; resumed again, both end equal to an uninterrupted run."""
    loop = WRAPPERS[wrapper]
    run_dir = tmp_path / "run"
    args = [*ARGS, "--loop", loop, "--resume", "auto"]
    job = start_wrapper(wrapper, run_dir, *args)
    try:
        wait_for(lambda: step_checkpoint_after(run_dir) or job.poll() is not None, 240)
        assert lock_is_held(run_dir), "the running job does not hold the run directory's lock"
        os.kill(job.pid, signal.SIGTERM)
    finally:
        code, output = finish(job, 120)
    assert code == STOPPED, output[-3000:]
    stops = re.findall(r"hvdtrain: error: (stopped by SIGUSR1 on rank [01].*?--resume auto)",
                       output)
    assert len(stops) == 2 and stops[0] == stops[1], output[-3000:]   # every rank, alike
    assert "Traceback" not in output
    assert_nothing_left(run_dir)
    stopped_at = re.search(r"checkpoint (\S+) written", stops[0]).group(1)
    assert (run_dir / "checkpoints" / stopped_at).is_dir()
    assert list((run_dir / "checkpoints").glob("epoch-*-step-*")), "no mid-epoch checkpoint"

    if wrapper == "horovodrun.sh":
        with holding_the_lock(run_dir):   # as another run would (in this process: a lock
            # of its own, on another open file)
            code = main(["--run-dir", str(run_dir), *args])
        err = capsys.readouterr().err
        assert code == 2, err
        assert re.search(r"hvdtrain: error: run directory \S+ is in use by another run "
                         r"\(pid \d+ on \S+\); wait for it", err), err
        victim = functools.partial(rank_pid, str(run_dir), 1)
    else:
        flip_a_byte(run_dir / "checkpoints" / stopped_at / "optimizer.npz")
        victim = functools.partial(launcher_pid, run_dir)
    job = start_wrapper(wrapper, run_dir, *args)
    try:
        wait_for(lambda: step_checkpoint_after(run_dir, stopped_at) or job.poll() is not None,
                 240)
        os.kill(wait_for(victim, 30), signal.SIGKILL)
    finally:
        code, output = finish(job, 120)
    assert code != 0, output[-3000:]
    assert_nothing_left(run_dir)   # mpirun.sh: the ranks saw their launcher die and stopped
    if wrapper == "mpirun.sh":
        assert f"checkpoint {run_dir}/checkpoints/{stopped_at} is damaged (optimizer.npz does " \
               "not match its SHA-256); set aside as .damaged-" in output, output[-3000:]
    job = start_wrapper(wrapper, run_dir, *args, slow=False)
    code, output = finish(job, 240)
    assert code == 0, output[-3000:]
    assert_same_run(uninterrupted("horovod", loop), run_dir)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_hvdtrain_fit_under_mpirun_stops_cleanly_on_sigterm(tmp_path, backend):
    """The Python API gets the CLI's stop: SIGTERM to launch/mpirun.sh mid-run stops both
    ranks at one step with a checkpoint, ``fit`` raises StoppedBySignal (the script exits 75),
    and the run leaves the process's signal handlers as it found them; on either backend."""
    run_dir = tmp_path / "run"
    job = subprocess.Popen(
        [str(REPO / "launch" / "mpirun.sh"), "-np", "2", "--command",
         f"{sys.executable} {RANKS / 'fit_stop_script.py'} {run_dir}"],
        env=rank_env(HOROVOD_CYCLE_TIME=SLOW_CYCLE_MS, PYTHONPATH=RANK_PYTHONPATH,
                     HVDTRAIN_BACKEND=backend),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: step_checkpoint_after(run_dir) or job.poll() is not None, 240)
        os.kill(job.pid, signal.SIGTERM)
    finally:
        code, output = finish(job, 120)
    assert code == STOPPED, output[-3000:]
    stops = re.findall(r"fit stopped: (stopped by SIGUSR1 on rank [01].*?--resume auto)", output)
    assert len(stops) == 2 and stops[0] == stops[1], output[-3000:]
    assert output.count("handlers restored: True") == 2, output[-3000:]
    assert "Traceback" not in output
    stopped_at = re.search(r"checkpoint (\S+) written", stops[0]).group(1)
    assert (run_dir / "checkpoints" / stopped_at).is_dir()
    assert_nothing_left(run_dir)


@pytest.mark.distributed
def test_ranks_whose_mpirun_is_killed_stop_with_their_exit_code_and_log_the_line(tmp_path):
    """mpirun SIGKILLed mid-run (under launch/mpirun.sh): its ranks, whose output now leads
    nowhere, stop at one step with a checkpoint and exit 75 (they exited 120, Python's failed
    flush of the dead pipe, or 195, Open MPI ending a rank whose daemon is gone), and the stop
    line is in rank 0's run log. A subreaper collects the orphaned ranks' exit codes."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(RANKS / "orphan_reaper.py"), "--when",
         str(run_dir / "checkpoints" / "epoch-*-step-*"), "--kill", "mpirun", "--",
         str(REPO / "launch" / "mpirun.sh"), "-np", "2", "--", "--run-dir", str(run_dir),
         "--no-progress", *ARGS], env=rank_env(HOROVOD_CYCLE_TIME=SLOW_CYCLE_MS), cwd=tmp_path,
        text=True, capture_output=True, timeout=240, stdin=subprocess.DEVNULL)
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["command"] != 0 and list(report["orphans"].values()) == [STOPPED] * 2, report
    lines = re.findall(r"hvdtrain: error: .*", (run_dir / "hvdtrain.log").read_text())
    assert len(lines) == 1 and re.fullmatch(
        r"hvdtrain: error: stopped by its launcher ending on rank \d.* checkpoint (\S+) written; "
        r"continue with the same command and --resume auto", lines[0]), lines
    written = re.search(r"checkpoint (\S+) written", lines[0]).group(1)
    assert Checkpoint(run_dir / "checkpoints" / written).damage() is None
    assert_nothing_left(run_dir)


def launcher_pid(run_dir: Path) -> int | None:
    """The job's mpirun."""
    return next((pid for pid in processes_mentioning(str(run_dir))
                 if Path(f"/proc/{pid}/comm").read_text().strip() == "mpirun"), None)


@pytest.mark.distributed
@pytest.mark.slow
def test_slurm_stop_and_time_limit_requeue_finish_like_an_uninterrupted_run(slurm, uninterrupted):
    """SIGTERM to the job step mid-epoch: the job ends with exit 75 and a mid-epoch checkpoint,
    nothing remains. Resubmitted with a two-minute time limit shorter than its training (each
    step of the first allocation slowed by 1 s in a user's callback, which changes timing, not
    the math; the allocation after the requeue trains at full speed), the shipped script's
    SIGUSR1 trap stops the ranks before the limit, with a checkpoint (every rank that says so
    at one step), and requeues the job, which then trains to the end; the weights and metrics
    rows equal an uninterrupted run's."""
    run_dir = slurm.directory / "preempted"
    args = [*ARGS, "--loop", "fit", "--no-progress", "--run-dir", str(run_dir)]
    slow = {"HOROVOD_CYCLE_TIME": "250"}
    job = slurm.submit(*args, **slow)
    wait_for(lambda: step_checkpoint_after(run_dir) or slurm.finished(job), 240)
    # SIGTERM to the job's step (its ranks), not to srun: srun turns a SIGTERM of its own into
    # SIGKILL for every task (see README).
    assert run(["scancel", "--signal=TERM", job], 30, env=slurm.env).returncode == 0
    record = wait_for(lambda: slurm.finished(job), 120, every=0.5)
    output = slurm.output(job)
    # 75, or 143 when srun's --kill-on-bad-exit ended a rank still exiting after another
    # left with 75; either way every rank stopped at the agreed step first.
    assert record["ExitCode"] in (f"{STOPPED}:0", "143:0"), output[-3000:]
    stops = re.findall(r"hvdtrain: error: (stopped by SIGTERM on rank 0, SIGTERM on rank 1 .*)",
                       output)
    assert len(stops) == 2 and stops[0] == stops[1], output[-3000:]
    assert list((run_dir / "checkpoints").glob("epoch-*-step-*")), "no mid-epoch checkpoint"
    assert_nothing_left(run_dir)

    # Slurm tests time limits about every 30 s: it sends the --signal warning at the first test
    # within 30 s + the warning's seconds of the limit, and ends the job at the first test past
    # the limit. With two minutes and @45 the warning comes 45-75 s into the allocation (the
    # ranks train by then: 10 s in on 2 cores, 27 s with 25 processes competing for them), at
    # least 45 s before the limit is enforced: time for the ranks to stop and the script to
    # requeue even when a loaded controller runs a test late. (With one minute and @1, a late
    # test once sent the warning seconds before the limit: the ranks took the time limit's
    # SIGTERM as a second request and exited without a checkpoint.) The slowed training (130
    # steps of over 1 s) outlasts the warning.
    job = slurm.submit(*args, "--callbacks", "workloads:slow_first_slurm_allocation",
                       sbatch=("--time=2", "--signal=B:USR1@45"), PYTHONPATH=RANK_PYTHONPATH)
    deadline, requeued_at = time.time() + 600, {}
    while (record := slurm.finished(job)) is None:
        assert time.time() < deadline, slurm.output(job)[-3000:]
        release_a_requeued_job(slurm, job, requeued_at)
        time.sleep(0.5)
    output = slurm.output(job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", output[-3000:]
    assert int(record["Restarts"]) == 1, output[-3000:]
    # The first allocation stopped with a checkpoint, every rank that said so at one step:
    # the signal came mid-run. (Under load the first step of this resumed run's second fit
    # call, which traces again, once ran 22 s after the warning: a rank called it stuck and
    # exited 138, and its peer, finding it gone, followed; such a step is no longer judged
    # stuck. srun's --kill-on-bad-exit may still end a rank before its line: one line or two.)
    stops = re.findall(r"hvdtrain: error: (stopped by SIGUSR1 on rank [01].*?"
                       r"checkpoint \S+ written; .*?--resume auto)", output)
    assert stops and set(stops) == {stops[0]}, output[-3000:]
    assert "requeueing it to continue from the checkpoint" in output
    assert_same_run(uninterrupted("horovod", "fit"), run_dir)


def release_a_requeued_job(slurm, job: str, requeued_at: dict[str, float]) -> None:
    """Slurm holds a requeued job back for about two minutes (its begin time), long enough for
    the last allocation to finish; release it once that allocation's step daemons (its batch
    shell's and its ranks') have ended and ``REVOKED_FOR_S`` have passed since the job was
    first seen held (``requeued_at``, kept by the caller), as a cluster with free nodes would
    soon. (Released while the ranks' daemon still ran, the next allocation's srun found its
    PMIx socket taken and no rank started. Released 0.1 s after the requeue, within the same
    second, slurmd took the new allocation's credential for the revoked one, "Job 6 already
    killed, do not launch batch job", and the job ended FAILED.) Its limit is raised to ten
    minutes then, as an administrator may: the rest of training takes seconds, but a loaded
    machine's start and final save can outlast another minute, which would end the job at
    the limit instead of completing it."""
    shown = run(["scontrol", "show", "job", job], 30, env=slurm.env).stdout
    record = dict(re.findall(r"(\w+)=(\S+)", shown))
    if record.get("JobState") != "PENDING" or record.get("Reason") != "BeginTime":
        return
    held_since = requeued_at.setdefault(job, time.time())
    if time.time() - held_since >= REVOKED_FOR_S and not step_daemons(job):
        run(["scontrol", "update", f"JobId={job}", "StartTime=now", "TimeLimit=10"], 30,
            env=slurm.env)


# slurmd refuses a credential created no later than the old allocation's revocation, counted in
# whole seconds: a new allocation within the same second is refused.
REVOKED_FOR_S = 3.0


def step_daemons(job: str) -> list[int]:
    """The pids of the job's slurmstepd processes (titled ``slurmstepd: [JOB.STEP]``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            title = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if title.startswith(f"slurmstepd: [{job}.".encode()):
            found.append(int(entry.name))
    return found


@pytest.mark.distributed
@pytest.mark.parametrize("backend", ["horovod", "tensorflow"])
def test_stop_and_resume_with_dropout_equals_an_uninterrupted_run(tmp_path, uninterrupted, backend):
    """SIGTERM through launch/mpirun.sh after a step checkpoint, then --resume auto: the same
    weights and rows as an uninterrupted run (dropout masks included), on either backend. The
    TensorFlow backend's interrupted run slows its steps with a callback of the user's kind
    (HOROVOD_CYCLE_TIME does not reach it). The built-in cnn's dropout takes the same path
    (the same seed generators in the checkpoint), so it is not run separately."""
    args = [*DROPOUT_ARGS, "--backend", backend]
    paths = {"PYTHONPATH": RANK_PYTHONPATH}
    run_dir = tmp_path / "stopped"
    slow = ["--callbacks", "workloads:slow_steps"] if backend == "tensorflow" else []
    code, output = stop_after_a_step_checkpoint(run_dir, *args, *slow, "--resume", "auto",
                                                **paths)
    assert code == 75, output[-3000:]
    resumed = train(tmp_path, "stopped", *args, "--resume", "auto", **paths)
    assert "resuming after epoch" in resumed.with_suffix(".log").read_text()
    assert_same_run(uninterrupted(backend, "dropout"), resumed)


def final_state(run_dir) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(weights, optimizer variables) of the run's last checkpoint (the GAN is saved as
    weights only: Keras cannot serialise a subclass without get_config)."""
    last = run_dir / "checkpoints" / "epoch-0002"
    with np.load(last / "weights.npz") as weights, np.load(last / "optimizer.npz") as slots:
        return ([weights[k] for k in sorted(weights.files)],
                [slots[k] for k in sorted(slots.files)])


@pytest.mark.distributed
def test_gan_through_the_cli_stops_and_resumes_to_the_uninterrupted_result(tmp_path, uninterrupted):
    straight = uninterrupted("horovod", "gan")
    log = straight.with_suffix(".log").read_text()
    assert "step: the model's own train_step (it defines train_step)" in log
    assert read_summary(straight)["weights_identical"]
    assert (straight / "model.weights.h5").exists()

    run_dir = tmp_path / "stopped"
    code, output = stop_after_a_step_checkpoint(run_dir, *GAN_ARGS, "--resume", "auto",
                                                PYTHONPATH=RANK_PYTHONPATH)
    assert code == 75, output[-3000:]
    assert re.search(r"stopped by SIG\w+ on rank [01].* at epoch \d, step \d+", output)
    resumed = train(tmp_path, "stopped", *GAN_ARGS, "--resume", "auto", PYTHONPATH=RANK_PYTHONPATH)
    assert "resuming after epoch" in resumed.with_suffix(".log").read_text()
    (ours_w, ours_o), (theirs_w, theirs_o) = final_state(resumed), final_state(straight)
    for left, right in zip(ours_w + ours_o, theirs_w + theirs_o):
        np.testing.assert_allclose(left, right, rtol=1e-6, atol=1e-7)
