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
set -euo pipefail

np=""; hosts=""; hostfile=""; iface=""; controller=""
trainer_args=()
usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    -np|--np) np="$2"; shift 2 ;;
    -H|--hosts) hosts="$2"; shift 2 ;;
    --hostfile) hostfile="$2"; shift 2 ;;
    --iface|--network-interface) iface="$2"; shift 2 ;;
    --gloo|--mpi) controller="$1"; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; trainer_args+=("$@"); break ;;
    *) trainer_args+=("$1"); shift ;;
  esac
done
[ -n "$np" ] || { echo "horovodrun.sh: -np N is required (try --help)" >&2; exit 2; }

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${HVDTRAIN_VENV:-$repo/.venv}/bin"
[ -x "$bin/horovodrun" ] || { echo "horovodrun.sh: $bin/horovodrun not found; run launch/setup.sh" >&2; exit 2; }
export PATH="$bin:$PATH"

args=(-np "$np")
[ -n "$hosts" ] && args+=(-H "$hosts")
[ -n "$hostfile" ] && args+=(--hostfile "$hostfile")
[ -n "$iface" ] && args+=(--network-interface "$iface")
[ -n "$controller" ] && args+=("$controller")
exec horovodrun "${args[@]}" python -m hvdtrain "${trainer_args[@]}"
