#!/usr/bin/env bash
# Launch an hvdtrain job (or any command) with Open MPI's mpirun and the flags Horovod recommends.
#
#   launch/mpirun.sh -np 4 [-H host1:2,host2:2 | --hostfile FILE] [--iface eth0] [--ssh CMD]
#                    [--] [TRAINER ARGS]
#   launch/mpirun.sh -np 2 --command "python my_script.py"
#
#   -np N             number of ranks (required)
#   -H, --hosts H     comma-separated host:slots list (default: this machine)
#   --hostfile FILE   Open MPI hostfile ("host slots=N" per line)
#   --iface NAME      interface (or subnet, e.g. 10.0.0.0/24) for MPI's data and control
#                     traffic, and NCCL's (e.g. eth0, ib0)
#   --ssh CMD         how mpirun reaches the other nodes (default: ssh), e.g. "ssh -i KEY"
#   --command CMD     run CMD on every rank instead of 'python -m hvdtrain'
#
# Adds: --bind-to none --map-by slot (Horovod manages its own threads), -x for the environment
# Horovod, TensorFlow and MLflow read, --allow-run-as-root when run as root (containers, CI), which
# Open MPI otherwise refuses, and TCP keep-alive between mpirun and its daemons, so that a lost
# node ends the job within a minute (export_launcher_defaults in common.sh). SIGTERM, SIGINT or SIGUSR1 to this script stops the job cleanly
# (every rank at one step, a checkpoint, exit 75); see run_relaying_stops in common.sh.
set -euo pipefail

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
command=""
ssh_agent=""
wrapper_flag() {
  case "$1" in
    --command) command="$2"; consumed=2 ;;
    --ssh) ssh_agent="$2"; consumed=2 ;;
    *) return 1 ;;
  esac
}
parse_launcher_args "$@"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${HVDTRAIN_PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"

export_launcher_defaults "$python"
args=(-np "$np" --bind-to none --map-by slot -mca pml ob1 -mca btl ^openib)
[ "$(id -u)" -eq 0 ] && args+=(--allow-run-as-root)
[ -n "$hosts" ] && args+=(-H "$hosts")
[ -n "$hostfile" ] && args+=(--hostfile "$hostfile")
[ -n "$iface" ] && args+=(-mca btl_tcp_if_include "$iface" -mca oob_tcp_if_include "$iface"
                          -x NCCL_SOCKET_IFNAME="$iface")
[ -n "$ssh_agent" ] && args+=(-mca plm_rsh_agent "$ssh_agent")
# Only variables that are set: mpirun warns about every -x name it cannot find.
for var in $(compgen -e | grep -E '^(HOROVOD_|HVDTRAIN_|MLFLOW_|NCCL_|TF_|OMPI_MCA_|CUDA_VISIBLE_DEVICES$|LD_LIBRARY_PATH$|PATH$|PYTHONPATH$)' || true); do
  args+=(-x "$var")
done

if [ -n "$command" ]; then
  # shellcheck disable=SC2086  # --command is a whole command line, split on purpose
  run_relaying_stops mpirun "${args[@]}" $command
fi
run_relaying_stops mpirun "${args[@]}" "$python" -m hvdtrain "${trainer_args[@]}"
