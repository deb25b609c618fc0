#!/usr/bin/env bash
# Launch an hvdtrain job (or any command) with Open MPI's mpirun and the flags Horovod recommends.
#
#   launch/mpirun.sh -np 4 [-H host1:2,host2:2 | --hostfile FILE] [--iface eth0] [--] [TRAINER ARGS]
#   launch/mpirun.sh -np 2 --command "python my_script.py"
#
#   -np N             number of ranks (required)
#   -H, --hosts H     comma-separated host:slots list (default: this machine)
#   --hostfile FILE   Open MPI hostfile ("host slots=N" per line)
#   --iface NAME      TCP interface for MPI and NCCL traffic (e.g. eth0, ib0)
#   --command CMD     run CMD on every rank instead of 'python -m hvdtrain'
#
# Adds: --bind-to none --map-by slot (Horovod manages its own threads), -x for the environment
# Horovod and TensorFlow read, and --allow-run-as-root when run as root (containers, CI), which
# Open MPI otherwise refuses.
set -euo pipefail

np=""; hosts=""; hostfile=""; iface=""; command=""
trainer_args=()
usage() { sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    -np|--np) np="$2"; shift 2 ;;
    -H|--hosts) hosts="$2"; shift 2 ;;
    --hostfile) hostfile="$2"; shift 2 ;;
    --iface|--network-interface) iface="$2"; shift 2 ;;
    --command) command="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; trainer_args+=("$@"); break ;;
    *) trainer_args+=("$1"); shift ;;
  esac
done
[ -n "$np" ] || { echo "mpirun.sh: -np N is required (try --help)" >&2; exit 2; }

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${HVDTRAIN_PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"

args=(-np "$np" --bind-to none --map-by slot
      -x LD_LIBRARY_PATH -x PATH -x PYTHONPATH -x TF_CPP_MIN_LOG_LEVEL
      -mca pml ob1 -mca btl ^openib)
[ "$(id -u)" -eq 0 ] && args+=(--allow-run-as-root)
[ -n "$hosts" ] && args+=(-H "$hosts")
[ -n "$hostfile" ] && args+=(--hostfile "$hostfile")
[ -n "$iface" ] && args+=(-mca btl_tcp_if_include "$iface" -x NCCL_SOCKET_IFNAME="$iface")
for var in $(compgen -e | grep -E '^(HOROVOD_|HVDTRAIN_|NCCL_|CUDA_VISIBLE_DEVICES$)' || true); do
  args+=(-x "$var")
done

if [ -n "$command" ]; then
  # shellcheck disable=SC2086  # --command is a whole command line, split on purpose
  exec mpirun "${args[@]}" $command
fi
exec mpirun "${args[@]}" "$python" -m hvdtrain "${trainer_args[@]}"
