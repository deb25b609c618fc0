"""Real 2-rank launches with horovodrun and mpirun: both ranks run, and an allreduce is right."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import launch
from hvdtrain.collectives import World, cpu_threads_per_rank
from hvdtrain.launchers import launched_by_a_launcher

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_doctor_on_two_ranks(launcher):
    result = launch(launcher, 2, ["doctor"])
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}/2\] host \S+, local rank {rank}/2", output), output
    assert output.count("allreduce sum of (rank+1) = 3 (expected 3) ok") == 2, output
    assert "verdict: PASS (2 rank(s) checked, ready to train)" in output
    assert "TensorFlow" in output and "controllers: MPI, Gloo" in output


def test_doctor_without_a_launcher_is_a_world_of_one():
    result = launch("none", 1, ["doctor"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank 0/1]" in result.stdout and "verdict: PASS" in result.stdout
    assert "Open MPI v4" in result.stdout and "\x00" not in result.stdout
    # TensorFlow's native start-up notices (oneDNN, absl) are not shown on a normal run.
    assert "oneDNN" not in result.stderr and "absl::InitializeLog" not in result.stderr


def test_version_flag():
    result = launch("none", 1, ["--version"])
    assert result.returncode == 0 and re.fullmatch(r"hvdtrain \d+\.\d+\.\d+\n", result.stdout)


def test_version_help_and_a_mistake_answer_without_loading_tensorflow():
    """The CLI imports TensorFlow and Keras only for a command that needs them (seconds saved
    on every --version, --help, mistyped flag and option value out of range)."""
    probe = ("import sys\nfrom hvdtrain.cli import main\n"
             "codes = [main(['--version']), main(['--epoch', '3']), "
             "main(['--learning-rate', 'nan'])]\n"
             "print(codes, sorted({'tensorflow', 'keras', 'horovod'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL)
    assert result.stdout.splitlines()[-1] == "[0, 2, 2] []", result.stdout + result.stderr


def test_launcher_detection_from_environment():
    assert not launched_by_a_launcher({})
    assert launched_by_a_launcher({"OMPI_COMM_WORLD_RANK": "0"})
    assert launched_by_a_launcher({"HOROVOD_RANK": "1"})
    assert launched_by_a_launcher({"PMIX_RANK": "0"})
    assert not launched_by_a_launcher({"PMIX_RANK": "0", "HVDTRAIN_BACKEND": "local"})


def test_cpu_threads_share_the_node_or_respect_binding():
    assert cpu_threads_per_rank(local_size=2, affinity=16, cores=16) == 8
    assert cpu_threads_per_rank(local_size=4, affinity=2, cores=2) == 1
    assert cpu_threads_per_rank(local_size=2, affinity=1, cores=16) == 1  # bound to one core
    assert World(rank=0).is_chief and not World(rank=1, size=2).is_chief


def test_tensorflows_own_thread_variables_are_honoured_unless_threads_is_given():
    """A user's TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS size the pools (TensorFlow
    reads them; replacing them would ignore the user); --threads wins over them; without
    either, the rank takes its share of the cores and at most 2 inter-op threads."""
    from hvdtrain.collectives.world import cpu_thread_pools

    assert cpu_thread_pools(None, 1, 2, 2, {}) == (2, 2, "a share of the cores")
    assert cpu_thread_pools(None, 4, 16, 16, {}) == (4, 2, "a share of the cores")
    assert cpu_thread_pools(None, 1, 2, 2, {"TF_NUM_INTRAOP_THREADS": "1"}) == (
        1, 1, "TF_NUM_INTRAOP_THREADS")
    assert cpu_thread_pools(None, 1, 8, 8, {"TF_NUM_INTRAOP_THREADS": "3",
                                            "TF_NUM_INTEROP_THREADS": "4"}) == (
        3, 4, "TF_NUM_INTRAOP_THREADS")
    assert cpu_thread_pools(2, 1, 8, 8, {"TF_NUM_INTRAOP_THREADS": "6"}) == (2, 2, "--threads")
    assert cpu_thread_pools(None, 2, 8, 8, {"TF_NUM_INTRAOP_THREADS": "0",
                                            "TF_NUM_INTEROP_THREADS": "x"}) == (
        4, 2, "a share of the cores")


def test_doctor_says_how_to_keep_a_bare_launcher_from_outliving_a_lost_node():
    from hvdtrain.install.doctor import launcher_notes
    from hvdtrain.launchers import launcher_defaults

    assert launcher_notes({}) == []                      # not started by Open MPI
    assert launcher_notes({"OMPI_COMM_WORLD_RANK": "0", **launcher_defaults()}) == []
    note, = launcher_notes({"OMPI_COMM_WORLD_RANK": "0"})
    assert note.startswith("mpirun would wait 480 s or more for a node that vanishes")
    assert ("export OMPI_MCA_oob_tcp_keepalive_time=10 OMPI_MCA_oob_tcp_keepalive_intvl=6 "
            "OMPI_MCA_oob_tcp_keepalive_probes=6 (launch/mpirun.sh") in note
