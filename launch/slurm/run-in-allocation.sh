#!/usr/bin/env bash
# The body of hvdtrain's Slurm batch scripts: one rank per Slurm task, started by
# 'srun --mpi=pmix' (default) or, with HVDTRAIN_LAUNCHER=mpirun, by Open MPI's mpirun inside the
# allocation. Rank, size and local rank come from the launcher. Any rank failing fails the job
# with a non-zero exit code.
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

case "$launcher" in
  srun)
    # --kill-on-bad-exit: one rank failing ends the step (and so the job) at once.
    exec srun --mpi=pmix --kill-on-bad-exit=1 python -m hvdtrain "$@" ;;
  mpirun)
    # Open MPI reads the allocation (hosts, slots) from Slurm.
    exec "$repo/launch/mpirun.sh" -np "$SLURM_NTASKS" -- "$@" ;;
  *)
    echo "hvdtrain: error: HVDTRAIN_LAUNCHER must be srun or mpirun, not '$launcher'" >&2
    exit 2 ;;
esac
