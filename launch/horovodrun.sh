#!/usr/bin/env bash
# Launch an hvdtrain job with horovodrun.
#
#   launch/horovodrun.sh -np 4 [-H host1:2,host2:2 | --hostfile FILE] [--iface eth0]
#                        [--gloo | --mpi] [--] [TRAINER ARGS]
#
#   -np N             number of ranks (required)
#   -H, --hosts H     comma-separated host:slots list (default: this machine)
#   --hostfile FILE   one "host slots=N" per line
#   --iface NAME      network interface for Horovod's and the controller's traffic
#   --gloo | --mpi    controller (default: MPI when Horovod has it, as horovodrun chooses)
#   TRAINER ARGS      passed to 'python -m hvdtrain' (e.g. --model cnn --epochs 10)
#
# SIGTERM, SIGINT or SIGUSR1 to this script stops the job cleanly (every rank at one step, a
# checkpoint, exit 75). horovodrun alone does not: on SIGTERM it exits and its mpirun and ranks
# train on. See run_relaying_stops in common.sh. A lost node ends the job within a minute
# (export_launcher_defaults in common.sh).
set -euo pipefail

# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
controller=""
wrapper_flag() {
  case "$1" in
    --gloo|--mpi) controller="$1"; consumed=1 ;;
    *) return 1 ;;
  esac
}
parse_launcher_args "$@"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${HVDTRAIN_VENV:-$repo/.venv}/bin"
[ -x "$bin/horovodrun" ] || { echo "horovodrun.sh: $bin/horovodrun not found; run launch/setup.sh" >&2; exit 2; }
export PATH="$bin:$PATH"
export_launcher_defaults "$bin/python"

args=(-np "$np")
[ -n "$hosts" ] && args+=(-H "$hosts")
[ -n "$hostfile" ] && args+=(--hostfile "$hostfile")
[ -n "$iface" ] && args+=(--network-interface "$iface")
[ -n "$controller" ] && args+=("$controller")
run_relaying_stops horovodrun "${args[@]}" python -m hvdtrain "${trainer_args[@]}"
