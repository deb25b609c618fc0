"""The setup logic that runs in-process: the source fix, the cache key, the build check."""

from __future__ import annotations

import pytest

from hvdtrain.install import horovod_build as hb

CMAKELISTS = """\
set(TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/mpi_ops.cc"
               "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")
list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/other.cc")
"""

CHECK_BUILD = """\
Horovod v0.28.1:

Available Frameworks:
    [X] TensorFlow
    [ ] PyTorch
    [ ] MXNet

Available Controllers:
    [X] MPI
    [ ] Gloo

Available Tensor Operations:
    [ ] NCCL
    [ ] DDL
    [ ] CCL
    [X] MPI
    [X] Gloo
"""


def test_patch_drops_only_the_xla_source():
    patched = hb.patch_tensorflow_cmakelists(CMAKELISTS)
    assert "xla_mpi_ops.cc" not in patched
    assert "mpi_ops.cc" in patched and "other.cc" in patched
    assert len(patched.splitlines()) == len(CMAKELISTS.splitlines()) - 1


def test_patch_is_idempotent():
    once = hb.patch_tensorflow_cmakelists(CMAKELISTS)
    assert hb.patch_tensorflow_cmakelists(once) == once


def test_patch_refuses_an_unknown_layout():
    with pytest.raises(hb.BuildError, match="TF_SOURCES"):
        hb.patch_tensorflow_cmakelists("project(something_else)\n")


def test_cache_key_changes_with_tensorflow_python_and_switches():
    cpu = hb.build_switches(gpu=False)
    key = hb.cache_key("2.21.0", "cp311", cpu)
    assert key == hb.cache_key("2.21.0", "cp311", dict(cpu))
    assert key != hb.cache_key("2.20.0", "cp311", cpu)
    assert key != hb.cache_key("2.21.0", "cp312", cpu)
    gpu_key = hb.cache_key("2.21.0", "cp311", hb.build_switches(gpu=True))
    assert gpu_key != key and "-gpu-" in gpu_key and "-cpu-" in key


def test_build_switches_enable_tensorflow_mpi_gloo_only():
    switches = hb.build_switches(gpu=False)
    assert switches["HOROVOD_WITH_TENSORFLOW"] == switches["HOROVOD_WITH_MPI"] == "1"
    assert switches["HOROVOD_WITHOUT_PYTORCH"] == "1"
    assert "HOROVOD_GPU_OPERATIONS" not in switches
    assert hb.build_switches(gpu=True)["HOROVOD_GPU_OPERATIONS"] == "NCCL"


def test_parse_check_build_reads_each_section():
    sections = hb.parse_check_build(CHECK_BUILD)
    assert sections["Frameworks"] == {"TensorFlow": True, "PyTorch": False, "MXNet": False}
    assert sections["Controllers"] == {"MPI": True, "Gloo": False}
    assert sections["Tensor Operations"]["Gloo"] is True


def test_missing_features_names_what_is_absent():
    sections = hb.parse_check_build(CHECK_BUILD)
    assert hb.missing_features(sections, gpu=False) == ["Gloo (Controllers)"]
    assert hb.missing_features(sections, gpu=True) == ["Gloo (Controllers)",
                                                       "NCCL (Tensor Operations)"]
    assert hb.missing_features({}, gpu=False) == [
        "TensorFlow (Frameworks)", "MPI (Controllers)", "Gloo (Controllers)"]


def test_cache_dir_prefers_the_explicit_override(monkeypatch, tmp_path):
    monkeypatch.setenv("HVDTRAIN_CACHE_DIR", str(tmp_path))
    assert hb.default_cache_dir() == tmp_path
    monkeypatch.delenv("HVDTRAIN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hb.default_cache_dir() == tmp_path / "xdg" / "hvdtrain"


def test_a_cache_that_cannot_be_written_builds_into_a_temporary_directory(tmp_path, capsys):
    """A container build mounts the host's cache read-only: a slot that cannot be made there
    (here: under a file) gives a fresh temporary directory instead of a failed build."""
    assert hb.writable_slot(tmp_path / "slot") == tmp_path / "slot"
    (tmp_path / "file").write_text("")
    fallback = hb.writable_slot(tmp_path / "file" / "slot")
    assert fallback.is_dir() and fallback.name.startswith("hvdtrain-horovod-wheel-")
    assert "cannot write the cache" in capsys.readouterr().out
    fallback.rmdir()


def test_safe_extract_unpacks_and_refuses_escaping_members(tmp_path):
    import io
    import tarfile

    def archive(name: str, members: dict[str, bytes]):
        path = tmp_path / name
        with tarfile.open(path, "w:gz") as tar:
            for member, data in members.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path

    good = archive("good.tar.gz", {"horovod-0.28.1/setup.py": b"print()"})
    hb.safe_extract(good, tmp_path / "out")
    assert (tmp_path / "out" / "horovod-0.28.1" / "setup.py").read_bytes() == b"print()"
    bad = archive("bad.tar.gz", {"../escape.txt": b"x"})
    with pytest.raises(hb.BuildError, match="refusing unsafe member"):
        hb.safe_extract(bad, tmp_path / "out2")
    assert not (tmp_path / "escape.txt").exists()
