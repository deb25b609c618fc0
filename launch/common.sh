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

# export_launcher_defaults PYTHON: the launcher's own settings (hvdtrain.launchers.launcher_defaults:
# Open MPI's TCP keep-alive between mpirun and its daemons, so that a lost node ends the job
# within a minute instead of leaving mpirun waiting for it), exported unless already set.
export_launcher_defaults() {
  local setting name
  while IFS= read -r setting; do
    name="${setting%%=*}"
    [ -n "${!name:-}" ] || export "${setting?}"
  done < <("$1" -c 'from hvdtrain.launchers import launcher_defaults
for name, value in launcher_defaults().items(): print(f"{name}={value}")')
}

# run_relaying_stops CMD...: run the launcher CMD in the background, relay stop signals to its
# job, and exit with its status. SIGTERM, SIGINT or SIGUSR1 sent to this script (by `timeout`, a
# container runtime, a scheduler, Ctrl-C) becomes one SIGUSR1 to the job's mpirun, which forwards
# it to every rank on every host: the ranks stop at the same step, rank 0 checkpoints, and they
# exit 75. A later signal is relayed too and ends the ranks at once. Without this, SIGTERM ends
# horovodrun alone and its mpirun and ranks train on unseen, and mpirun given SIGTERM gives the
# ranks about a second before SIGKILL.
run_relaying_stops() {
  "$@" &
  job_pid=$!
  trap relay_stop TERM INT USR1
  local status
  while :; do
    status=0; wait "$job_pid" || status=$?
    kill -0 "$job_pid" 2>/dev/null || break   # a relayed signal interrupted the wait
  done
  trap - TERM INT USR1
  status=0; wait "$job_pid" || status=$?        # the job's own exit status
  exit "$status"
}

relay_stop() {
  local targets
  targets="$(job_mpirun "$job_pid")"
  # horovodrun --gloo has no mpirun: signal the local ranks (python children) directly.
  [ -n "$targets" ] || targets="$(job_processes "$job_pid" | while read -r pid; do
    case "$(ps -o comm= -p "$pid")" in python*) echo "$pid" ;; esac; done)"
  if [ -n "$targets" ]; then
    # shellcheck disable=SC2086  # one pid per word
    kill -USR1 $targets 2>/dev/null || true
  else   # nothing started yet: nothing to save
    kill -TERM "$job_pid" 2>/dev/null || true
  fi
}

# The process ids of a process tree, root first.
job_processes() {
  local child
  echo "$1"
  for child in $(pgrep -P "$1"); do job_processes "$child"; done
}

# The job's mpirun, if any. (Bare "return" in a function called from a trap handler would
# return the status of the command the trap interrupted: hence "return 0".)
job_mpirun() {
  local pid
  for pid in $(job_processes "$1"); do
    case "$(ps -o comm= -p "$pid")" in mpirun|mpiexec|orterun|prterun) echo "$pid"; return 0 ;; esac
  done
}
