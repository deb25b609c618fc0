#!/usr/bin/env bash
# One-command setup for hvdtrain on Debian/Ubuntu: system packages, a virtual environment in
# .venv, TensorFlow, mpi4py, hvdtrain itself, and Horovod built against that TensorFlow.
# Idempotent: every step checks first and a second run takes seconds.
#
#   launch/setup.sh          CPU build (tensorflow-cpu; MPI and Gloo allreduce)
#   launch/setup.sh --gpu    GPU build (tensorflow[and-cuda]; NCCL allreduce; needs CUDA + nvcc)
#
# Environment: PYTHON (interpreter for the venv, default python3), HVDTRAIN_VENV (default
# <repo>/.venv), HVDTRAIN_CACHE_DIR (where built Horovod wheels are cached, default
# ~/.cache/hvdtrain), HVDTRAIN_GPU=1 (same as --gpu).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HVDTRAIN_VENV:-$repo/.venv}"
python="${PYTHON:-python3}"
gpu="${HVDTRAIN_GPU:-0}"
for arg in "$@"; do
  case "$arg" in
    --gpu) gpu=1 ;;
    -h|--help) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# --- 1. System packages: Open MPI (runtime + headers), a C++ compiler, cmake 3.x, make -------
missing_system_packages() {
  local missing=()
  command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
  command -v mpicxx >/dev/null 2>&1 || missing+=(libopenmpi-dev)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  command -v make >/dev/null 2>&1 || missing+=(make)
  if ! command -v cmake >/dev/null 2>&1 || ! cmake --version | head -n1 | grep -q ' 3\.'; then
    missing+=(cmake)
  fi
  "$python" -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
  printf '%s\n' "${missing[@]}"
}

mapfile -t missing < <(missing_system_packages | sed '/^$/d')
if [ "${#missing[@]}" -eq 0 ]; then
  say "system packages present: Open MPI, g++, make, cmake 3.x, python venv"
elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
  mapfile -t still < <(missing_system_packages | sed '/^$/d')
  [ "${#still[@]}" -eq 0 ] || die "still missing after apt-get: ${still[*]}"
else
  die "missing system packages: ${missing[*]}. As root run: apt-get install -y ${missing[*]}" \
      "(or load your cluster's Open MPI, compiler and cmake 3 modules), then re-run this script"
fi

# --- 2. Virtual environment with TensorFlow, mpi4py, hvdtrain (editable) and test tools -------
if [ ! -x "$venv/bin/python" ]; then
  say "creating virtual environment $venv"
  "$python" -m venv "$venv"
fi
vpy="$venv/bin/python"
pip_quiet=(--quiet --disable-pip-version-check --no-input)
flavour=cpu
[ "$gpu" = 1 ] && flavour=gpu
stamp="$venv/hvdtrain-deps.sha256"
wanted="$(cat "$repo/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)-$flavour"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  say "Python packages up to date in $venv ($flavour)"
else
  say "installing pip tooling"
  "$vpy" -m pip install "${pip_quiet[@]}" --upgrade pip setuptools wheel
  # mpi4py is built from source so it links the same Open MPI that Horovod uses.
  say "installing mpi4py (built against the system Open MPI)"
  "$vpy" -m pip install "${pip_quiet[@]}" --no-binary mpi4py "mpi4py>=3.1,<5"
  say "installing TensorFlow ($flavour), hvdtrain (editable) and test tools"
  "$vpy" -m pip install "${pip_quiet[@]}" -e "$repo[$flavour,test]"
  echo "$wanted" > "$stamp"
fi

# --- 3. Horovod, built against this TensorFlow (cached wheel), then verified ---------------
build_args=()
[ "$gpu" = 1 ] && build_args+=(--gpu)
"$vpy" -m hvdtrain.install.horovod_build "${build_args[@]}" || die "Horovod build or check failed (see above)"
say "done: activate with 'source $venv/bin/activate'"
