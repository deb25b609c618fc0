# Sourced by launch/horovodrun.sh and launch/mpirun.sh: the flags both wrappers share.
# A wrapper defines wrapper_flag (set 'consumed' to the words it took, or return 1) for its
# own flags, then calls parse_launcher_args "$@", which sets np, hosts, hostfile, iface and
# trainer_args (everything else, and everything after --).

usage() { sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

parse_launcher_args() {
  np=""; hosts=""; hostfile=""; iface=""; trainer_args=()
  while [ $# -gt 0 ]; do
    case "$1" in
      -np|--np) np="$2"; shift 2 ;;
      -H|--hosts) hosts="$2"; shift 2 ;;
      --hostfile) hostfile="$2"; shift 2 ;;
      --iface|--network-interface) iface="$2"; shift 2 ;;
      -h|--help) usage; exit 0 ;;
      --) shift; trainer_args+=("$@"); break ;;
      *)
        if wrapper_flag "$@"; then shift "$consumed"; else trainer_args+=("$1"); shift; fi ;;
    esac
  done
  [ -n "$np" ] || { echo "$(basename "$0"): -np N is required (try --help)" >&2; exit 2; }
}
