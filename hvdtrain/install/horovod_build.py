"""Build and install Horovod 0.28.1 against the TensorFlow in this environment.

Horovod's last release does not compile against current TensorFlow: ``xla_mpi_ops.cc`` includes
XLA headers TensorFlow no longer ships. Its ops are used only with ``HOROVOD_ENABLE_XLA_OPS=1``,
which hvdtrain never sets, so the one fix is to drop that source before building. The extension
is tied to the exact TensorFlow, so wheels are cached outside the repository keyed by Horovod,
TensorFlow and Python versions and the build switches. ``launch/setup.sh`` runs
``python -m hvdtrain.install.horovod_build [--gpu]``; nothing heavy is imported, so it can be
unit-tested.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
# Bump when the patch or the build recipe changes, so older cached wheels are not reused.
RECIPE_REVISION = 1
DROPPED_SOURCE = "xla_mpi_ops.cc"
# Horovod's own install_requires, installed beside the wheel (which goes in with --no-deps).
HOROVOD_RUNTIME_DEPENDENCIES = ("cloudpickle", "psutil", "pyyaml", "packaging")


class BuildError(RuntimeError):
    """A step of the Horovod build failed; the message says which and what to do."""


def build_switches(gpu: bool) -> dict[str, str]:
    """Environment switches for Horovod's setup.py: TensorFlow with MPI and Gloo, nothing else."""
    switches = {
        "HOROVOD_WITH_TENSORFLOW": "1",
        "HOROVOD_WITH_MPI": "1",
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITHOUT_PYTORCH": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
    }
    if gpu:
        switches["HOROVOD_GPU_OPERATIONS"] = "NCCL"
    return switches


def cache_key(tf_version: str, python_tag: str, switches: dict[str, str]) -> str:
    """A directory name that changes whenever the built extension would differ."""
    recipe = json.dumps({"switches": switches, "revision": RECIPE_REVISION}, sort_keys=True)
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:10]
    flavour = "gpu" if "HOROVOD_GPU_OPERATIONS" in switches else "cpu"
    return f"horovod-{HOROVOD_VERSION}-tf{tf_version}-{python_tag}-{flavour}-{digest}"


def patch_tensorflow_cmakelists(text: str) -> str:
    """Drop the XLA ops source from the TensorFlow target; idempotent on patched text."""
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if DROPPED_SOURCE not in line]
    if len(kept) == len(lines) and "TF_SOURCES" not in text:
        raise BuildError(
            "horovod/tensorflow/CMakeLists.txt has no TF_SOURCES list: "
            f"this is not Horovod {HOROVOD_VERSION}'s layout, so the source fix cannot be applied"
        )
    return "".join(kept)


def parse_check_build(output: str) -> dict[str, dict[str, bool]]:
    """Parse ``horovodrun --check-build`` into {section: {feature: available}}."""
    sections: dict[str, dict[str, bool]] = {}
    current: dict[str, bool] | None = None
    for raw in output.splitlines():
        line = raw.strip()
        heading = re.fullmatch(r"Available (.+):", line)
        if heading:
            current = sections.setdefault(heading.group(1), {})
            continue
        mark = re.fullmatch(r"\[(X| )\]\s+(.+)", line)
        if mark and current is not None:
            current[mark.group(2)] = mark.group(1) == "X"
    return sections


def missing_features(sections: dict[str, dict[str, bool]], gpu: bool) -> list[str]:
    """The features a working hvdtrain needs that the check-build output lacks."""
    wanted = [
        ("Frameworks", "TensorFlow"),
        ("Controllers", "MPI"),
        ("Controllers", "Gloo"),
    ]
    if gpu:
        wanted.append(("Tensor Operations", "NCCL"))
    return [f"{name} ({section})" for section, name in wanted
            if not sections.get(section, {}).get(name, False)]


def default_cache_dir() -> Path:
    """Where built wheels are kept: outside the repository, shared by every checkout."""
    override = os.environ.get("HVDTRAIN_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hvdtrain"


def _say(message: str) -> None:
    print(f"[horovod-build] {message}", flush=True)


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    _say("$ " + " ".join(cmd))
    result = subprocess.run(cmd, env=env, cwd=cwd, text=True, capture_output=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-40:])
        raise BuildError(f"command failed ({result.returncode}): {' '.join(cmd)}\n{tail}")
    return result.stdout


def _tensorflow_version() -> str:
    try:
        from importlib.metadata import version
        import tensorflow  # noqa: F401  (the build needs it importable, so check it here)
    except ImportError as error:
        raise BuildError(f"TensorFlow is not importable ({error}); install it first") from error
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return version(dist)
        except Exception:  # noqa: BLE001 - metadata lookup: try the next distribution name
            continue
    raise BuildError("TensorFlow is importable but its distribution metadata is missing")


def _installed_horovod_record(record_path: Path) -> str | None:
    if not record_path.exists():
        return None
    try:
        return json.loads(record_path.read_text()).get("cache_key")
    except (OSError, ValueError):
        return None


def _gpu_environment(env: dict[str, str]) -> dict[str, str]:
    """Point Horovod's CMake at NCCL from the nvidia-nccl wheel unless the user set it."""
    if "HOROVOD_NCCL_HOME" not in env:
        try:
            import nvidia.nccl  # type: ignore[import-not-found]
            env["HOROVOD_NCCL_HOME"] = str(Path(list(nvidia.nccl.__path__)[0]))
        except ImportError:
            pass
    if shutil.which("nvcc", path=env.get("PATH")) is None and "CUDA_HOME" not in env:
        raise BuildError(
            "the GPU build needs the CUDA toolkit (nvcc) and NCCL at build time: install CUDA "
            "and set CUDA_HOME (and HOROVOD_NCCL_HOME if NCCL is not from pip)"
        )
    return env


def safe_extract(archive: Path, destination: Path) -> None:
    """Unpack a source tarball, refusing members that would land outside ``destination``.

    Python 3.11.4+ has ``extractall(filter="data")``; Debian bookworm's 3.11.2 does not, so
    the check is done here for every version.
    """
    root = destination.resolve()
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            target = (root / member.name).resolve()
            unsafe_link = (member.issym() or member.islnk()) and not (
                target.parent / member.linkname).resolve().is_relative_to(root)
            if not target.is_relative_to(root) or unsafe_link or member.isdev():
                raise BuildError(f"{archive.name}: refusing unsafe member {member.name!r}")
        tar.extractall(destination)  # noqa: S202 - every member was checked above


def build_wheel(switches: dict[str, str], destination: Path) -> Path:
    """Download the sdist, apply the source fix, build a wheel into ``destination``."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-horovod-") as tmp:
        workdir = Path(tmp)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"horovod=={HOROVOD_VERSION}", "-d", str(workdir)])
        archive = next(workdir.glob(f"horovod-{HOROVOD_VERSION}.tar.gz"))
        safe_extract(archive, workdir)
        source = workdir / f"horovod-{HOROVOD_VERSION}"
        cmakelists = source / "horovod" / "tensorflow" / "CMakeLists.txt"
        cmakelists.write_text(patch_tensorflow_cmakelists(cmakelists.read_text()))
        _say(f"applied source fix: removed {DROPPED_SOURCE} from {cmakelists.relative_to(workdir)}")
        env = dict(os.environ, **switches)
        env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 1}")
        # Gloo's old cmake_minimum_required is refused by CMake 4; harmless on CMake 3.
        env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
        if "HOROVOD_GPU_OPERATIONS" in switches:
            env = _gpu_environment(env)
        _say("compiling Horovod (several minutes on 2 cores)")
        staging = workdir / "wheel"
        _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
              "-w", str(staging), str(source)], env=env)
        built = next(staging.glob("horovod-*.whl"))
        destination.mkdir(parents=True, exist_ok=True)
        final = destination / built.name
        shutil.copy2(built, final.with_suffix(".partial"))
        os.replace(final.with_suffix(".partial"), final)
        return final


def check_build(gpu: bool) -> None:
    """Run ``horovodrun --check-build`` and fail loudly if a needed piece is missing."""
    horovodrun = Path(sys.executable).with_name("horovodrun")
    output = _run([str(horovodrun), "--check-build"])
    print(output, flush=True)
    missing = missing_features(parse_check_build(output), gpu)
    if missing:
        raise BuildError("Horovod was built without: " + ", ".join(missing))


def writable_slot(slot: Path) -> Path:
    """``slot``, or a new temporary directory where the cache cannot be written (a container
    build mounts the host's cache read-only: a wheel that fits is used from it, and one that
    does not is built beside it)."""
    try:
        slot.mkdir(parents=True, exist_ok=True)
        if os.access(slot, os.W_OK):
            return slot
    except OSError:
        pass
    fallback = Path(tempfile.mkdtemp(prefix="hvdtrain-horovod-wheel-"))
    _say(f"cannot write the cache {slot}: building into {fallback}")
    return fallback


def ensure_horovod(gpu: bool, cache_dir: Path, rebuild: bool = False) -> None:
    """Install a Horovod that matches this TensorFlow, building it only when no cache fits."""
    switches = build_switches(gpu)
    python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    key = cache_key(_tensorflow_version(), python_tag, switches)
    record = Path(sys.prefix) / "hvdtrain-horovod.json"
    if not rebuild and _installed_horovod_record(record) == key:
        _say(f"Horovod already installed for {key}")
    else:
        slot = cache_dir / key
        wheels = sorted(slot.glob("horovod-*.whl"))
        if wheels and not rebuild:
            _say(f"reusing cached wheel {wheels[0]}")
            wheel = wheels[0]
        else:
            _say(f"no cached wheel for {key}: building")
            wheel = build_wheel(switches, writable_slot(slot))
        _run([sys.executable, "-m", "pip", "install", *HOROVOD_RUNTIME_DEPENDENCIES])
        _run([sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall",
              str(wheel)])
        record.write_text(json.dumps({"cache_key": key, "wheel": str(wheel)}) + "\n")
    check_build(gpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="build with NCCL GPU allreduce")
    parser.add_argument("--rebuild", action="store_true", help="ignore the cached wheel")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                        help="where built wheels are kept (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        ensure_horovod(args.gpu, args.cache_dir, args.rebuild)
    except BuildError as error:
        print(f"[horovod-build] error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
