#!/usr/bin/env bash
# The body of hvdtrain's Slurm batch scripts: one rank per Slurm task, started by
# 'srun --mpi=pmix' (default) or, with HVDTRAIN_LAUNCHER=mpirun, by Open MPI's mpirun inside the
# allocation. Rank, size and local rank come from the launcher. Any rank failing fails the job
# with a non-zero exit code.
#
# Stops and requeue: the trainer runs with --run-dir runs/slurm-<job id> and --resume auto (your
# own arguments come after and win), so the same command starts the run and continues it.
# Slurm itself sends SIGTERM to every rank on scancel, at the time limit and on preemption: the
# ranks stop at one step, rank 0 checkpoints, and they exit 75. The sbatch scripts also ask for
# SIGUSR1 to this batch shell some minutes before the time limit (--signal=B:USR1@SECONDS):
# it is relayed to the ranks the same way, and once they have stopped the job is requeued
# (scontrol requeue; the scripts say --requeue), so it continues in its next allocation by
# itself until training ends.
#
# Environment: HVDTRAIN_REPO (checkout with .venv; default: the submit directory),
# HVDTRAIN_VENV (default: $HVDTRAIN_REPO/.venv), HVDTRAIN_LAUNCHER (srun or mpirun).
set -euo pipefail

repo="${HVDTRAIN_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}"
venv="${HVDTRAIN_VENV:-$repo/.venv}"
launcher="${HVDTRAIN_LAUNCHER:-srun}"
if [ ! -x "$venv/bin/python" ]; then
  echo "hvdtrain: error: no environment at $venv; run launch/setup.sh in $repo first" >&2
  exit 2
fi
export PATH="$venv/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
echo "hvdtrain job ${SLURM_JOB_ID:-?}: ${SLURM_NTASKS:-?} rank(s) on ${SLURM_JOB_NUM_NODES:-?}" \
     "node(s) ($SLURM_JOB_NODELIST), launcher $launcher"

trainer_args=(--run-dir "runs/slurm-${SLURM_JOB_ID:-0}" --resume auto "$@")
case "$launcher" in
  srun)
    # --kill-on-bad-exit: one rank failing ends the step (and so the job) at once. srun
    # forwards the signals it gets to every task.
    srun --mpi=pmix --kill-on-bad-exit=1 python -m hvdtrain "${trainer_args[@]}" & ;;
  mpirun)
    # Open MPI reads the allocation (hosts, slots) from Slurm; the wrapper relays SIGUSR1.
    "$repo/launch/mpirun.sh" -np "$SLURM_NTASKS" -- "${trainer_args[@]}" & ;;
  *)
    echo "hvdtrain: error: HVDTRAIN_LAUNCHER must be srun or mpirun, not '$launcher'" >&2
    exit 2 ;;
esac
step=$!
requeue=""
# The time-limit warning: stop the ranks (they checkpoint), then requeue. SIGTERM: Slurm
# signals the ranks itself; just wait for them.
trap 'requeue=1; kill -USR1 "$step" 2>/dev/null || true' USR1
trap ':' TERM
while :; do
  status=0; wait "$step" || status=$?
  kill -0 "$step" 2>/dev/null || break   # a signal interrupted the wait
done
status=0; wait "$step" || status=$?
if [ -n "$requeue" ] && [ "$status" -ne 0 ]; then
  echo "hvdtrain job ${SLURM_JOB_ID:-?}: stopped before the time limit (exit $status);" \
       "requeueing it to continue from the checkpoint"
  scontrol requeue "${SLURM_JOB_ID:-0}" && exit 0
fi
exit "$status"
