"""A small cluster of nodes on this machine: network namespaces on a bridge, each node with its
own address, hostname (a UTS namespace per process started in it) and sshd; optionally its link
shaped to a real cluster's bandwidth, and a Slurm cluster with one slurmd per node.

The file system stays shared between the nodes, as a cluster's shared home is. Inside a node,
``ssh node2`` works without flags (each node sees its own /etc/hosts and /etc/ssh: its own
mount namespace binds /etc/netns/NAMESPACE/{hosts,ssh} over them), as on a cluster set up for
MPI. Only the names and the addresses this module creates are ever touched: the bridge
``hvdbr0`` with 10.77.0.1/24, one veth pair per node (``hvdv<i>`` outside, ``eth1`` inside,
10.77.0.1<i>), the namespaces ``hvd-node<i>``.

By hand (as root, with the packages of ``launch/setup.sh --with-test-systems``):

    python tests/support/netcluster.py up [--nodes 2] [--bandwidth 1gbit] [--slurm] [--dir DIR]
                                  [--congestion-control cubic|bbr|...|system]
    python tests/support/netcluster.py exec node1 -- hostname      # a command on a node
    python tests/support/netcluster.py down [--dir DIR]

``up`` prints what it made (addresses, the ssh config to use from outside, the hostfile);
``down`` stops every process in the nodes and removes everything ``up`` made, by name.
The test fixture (tests/cluster/test_multinode.py) uses the same ``up``/``down``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import system_packages

SUBNET = "10.77.0"
BRIDGE = "hvdbr0"
NODE_INTERFACE = "eth1"          # the same name in every node: launchers select it by name
DEFAULT_DIR = Path("/tmp/hvdtrain-cluster")
# The nodes' TCP between each other: Linux's default congestion control, as on most clusters,
# set on the nodes' route (the host's own settings stay). This VM defaults to BBR, under which
# some of ResNet-50's 94 MB allreduces at 1 Gbit/s took ~1.2 s instead of ~0.8 s (consistent
# with BBR's periodic RTT probe, a window of 4 packets for 200 ms about every 10 s of transfer),
# none under CUBIC (hvdtrain/bench/README.md, "Scaling over the network"). ``up
# --congestion-control bbr`` (or ``system``: the machine's default) measures it again.
CONGESTION_CONTROL = "cubic"
AVAILABLE_CONGESTION_CONTROL = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
NETNS_ETC = Path("/etc/netns")
# Slurm settings that work on one machine without systemd or cgroup setup (also used by the
# single-node Slurm fixture in conftest.py).
SLURM_BASICS = """\
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmUser=root
AuthType=auth/munge
ReturnToService=2
MpiDefault=none
"""
SLURM_CONF = """\
ClusterName=hvdtrain-nodes
SlurmctldHost={head}({head_address})
{nodes}
PartitionName=nodes Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""" + SLURM_BASICS + """\
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket
StateSaveLocation={dir}/slurm/state
SlurmdSpoolDir={dir}/slurm/spool-%n
SlurmctldPidFile={dir}/slurm/slurmctld.pid
SlurmdPidFile={dir}/slurm/slurmd-%n.pid
SlurmctldLogFile={dir}/slurm/slurmctld.log
SlurmdLogFile={dir}/slurm/slurmd-%n.log
TmpFS={dir}/slurm/tmp-%n
FirstJobId=7701
"""


def sh(command: list[str], timeout: float = 60, check: bool = True,
       **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, text=True, capture_output=True, timeout=timeout,
                            stdin=subprocess.DEVNULL, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): "
                           f"{result.stderr.strip()[-500:]}")
    return result


@dataclass
class Node:
    """One node: its hostname, network namespace, address and the host end of its link."""

    name: str
    netns: str
    address: str
    host_link: str


@dataclass
class Cluster:
    """A running cluster, described by ``cluster.json`` in its directory."""

    directory: Path
    nodes: list[Node]
    bandwidth: str | None = None
    slurm: bool = False
    congestion_control: str | None = None     # set on the nodes' route; None: the machine's
    started: list[int] = field(default_factory=list)     # pids of the daemons up started

    # --- describing it ---------------------------------------------------------------------
    @property
    def key(self) -> Path:
        return self.directory / "id_ed25519"

    @property
    def ssh_config(self) -> Path:
        """For ssh from outside the nodes (this machine's own namespace): ``ssh -F FILE node1``."""
        return self.directory / "ssh_config"

    @property
    def slurm_conf(self) -> Path:
        return self.directory / "slurm" / "slurm.conf"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def hostfile(self, slots: int, by_address: bool = False) -> Path:
        """An Open MPI hostfile with ``slots`` per node (names, or addresses from outside)."""
        path = self.directory / f"hostfile-{slots}{'-addresses' if by_address else ''}"
        path.write_text("".join(f"{n.address if by_address else n.name} slots={slots}\n"
                                for n in self.nodes))
        return path

    def save(self) -> None:
        state = {**asdict(self), "directory": str(self.directory)}
        (self.directory / "cluster.json").write_text(json.dumps(state, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> Cluster:
        state = json.loads((directory / "cluster.json").read_text())
        state["directory"] = Path(state["directory"])
        state["nodes"] = [Node(**n) for n in state["nodes"]]
        return cls(**state)

    # --- running things on a node ----------------------------------------------------------
    def on(self, node: str, command: list[str]) -> list[str]:
        """``command`` as run on ``node``: in its network namespace (with its /etc) and a UTS
        namespace carrying its hostname."""
        netns = self.node(node).netns
        etc = NETNS_ETC / netns
        # Not 'ip netns exec': it remounts /sys, hiding the cgroup file systems slurmd needs.
        return ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "--mount", "sh",
                "-c", f"hostname {node} && mount --bind {etc}/hosts /etc/hosts && "
                f'mount --bind {etc}/ssh /etc/ssh && exec "$@"', "sh", *command]

    def run(self, node: str, command: list[str], timeout: float,
            **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.on(node, command), text=True, capture_output=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, **kwargs)

    def pids(self, node: str) -> list[int]:
        """Every process living in the node's network namespace."""
        out = sh(["ip", "netns", "pids", self.node(node).netns], check=False).stdout
        return [int(p) for p in out.split()]

    def stray_pids(self, node: str) -> list[int]:
        """Processes in the node other than the daemons ``up`` started (sshd, slurmd...) and
        slurmctld's script helper: what jobs left behind."""
        def daemon(pid: int) -> bool:
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                return True      # already gone
            return pid in self.started or name == "slurmscriptd"

        return [p for p in self.pids(node) if not daemon(p)]

    def set_link(self, node: str, up: bool) -> None:
        """Take a node's link down (it vanishes from the network) or bring it back."""
        sh(["ip", "netns", "exec", self.node(node).netns, "ip", "link", "set", NODE_INTERFACE,
            "up" if up else "down"])


# --- bringing it up ------------------------------------------------------------------------

def missing_packages(slurm: bool) -> list[str]:
    """The Debian packages ``up`` needs that are not installed (setup.sh installs them)."""
    return system_packages.missing(*system_packages.NETWORK_CLUSTER,
                                   *(system_packages.SLURM if slurm else ()))


def require_packages(slurm: bool) -> None:
    absent = missing_packages(slurm)
    if absent:
        raise RuntimeError(system_packages.why_missing(absent))


def burst_for(bandwidth: str) -> str:
    """tbf's bucket: 10 ms of traffic at the rate (a kernel tick must fit in it), >= 32 kbit."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if bandwidth.endswith(unit):
            bits = float(bandwidth[:-len(unit)]) * scale
            return f"{max(32_000, int(bits / 100 / 8))}b"
    raise ValueError(f"bandwidth must end in kbit, mbit or gbit, got {bandwidth!r}")


def _start_daemon(cluster: Cluster, node: str, command: list[str], log: Path) -> int:
    with open(log, "ab") as out:
        daemon = subprocess.Popen(cluster.on(node, command), stdout=out, stderr=out,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    cluster.started.append(daemon.pid)
    cluster.save()
    return daemon.pid


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise RuntimeError(f"{what} within {timeout} s")
        time.sleep(0.2)


def _ssh_files(cluster: Cluster) -> None:
    """One user key, one host key per node, the ssh client config (inside the nodes and out)."""
    directory = cluster.directory
    sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(cluster.key)])
    shutil.copy(f"{cluster.key}.pub", directory / "authorized_keys")
    # No ServerAliveInterval, as ssh's defaults: a session to a lost node then waits for TCP,
    # and it is hvdtrain's watchdog that ends the job (tests/cluster/test_multinode.py).
    options = (f"  User root\n  IdentityFile {cluster.key}\n  StrictHostKeyChecking no\n"
               "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
               "  ConnectTimeout 5\n")
    hosts = "".join(f"Host {n.name}\n  HostName {n.address}\n" for n in cluster.nodes)
    cluster.ssh_config.write_text(hosts + "Host *\n" + options)
    for node in cluster.nodes:
        etc = NETNS_ETC / node.netns
        (etc / "ssh").mkdir(parents=True, exist_ok=True)
        (etc / "ssh" / "ssh_config").write_text("Host *\n" + options)
        (etc / "hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{n.address} {n.name}\n" for n in cluster.nodes))
        node_dir = directory / node.name
        node_dir.mkdir()
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(node_dir / "host_key")])
        (node_dir / "sshd_config").write_text(
            f"ListenAddress {node.address}\nHostKey {node_dir / 'host_key'}\n"
            f"AuthorizedKeysFile {directory / 'authorized_keys'}\nStrictModes no\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUsePAM no\n"
            f"PidFile {node_dir / 'sshd.pid'}\nMaxStartups 100\nMaxSessions 100\n"
            # A client whose node vanished: its session (and what runs in it) ends in ~10 s.
            "ClientAliveInterval 5\nClientAliveCountMax 2\n")


def _network(cluster: Cluster) -> None:
    sh(["ip", "link", "add", BRIDGE, "type", "bridge"])
    sh(["ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE])
    sh(["ip", "link", "set", BRIDGE, "up"])
    for node in cluster.nodes:
        sh(["ip", "netns", "add", node.netns])
        sh(["ip", "link", "add", node.host_link, "type", "veth", "peer", "name", "hvdpeer"])
        sh(["ip", "link", "set", "hvdpeer", "netns", node.netns])
        sh(["ip", "link", "set", node.host_link, "master", BRIDGE, "up"])
        inside = ["ip", "netns", "exec", node.netns]
        sh([*inside, "ip", "link", "set", "hvdpeer", "name", NODE_INTERFACE])
        sh([*inside, "ip", "addr", "add", f"{node.address}/24", "dev", NODE_INTERFACE])
        sh([*inside, "ip", "link", "set", NODE_INTERFACE, "up"])
        sh([*inside, "ip", "link", "set", "lo", "up"])
        if cluster.congestion_control:
            sh([*inside, "ip", "route", "replace", f"{SUBNET}.0/24", "dev", NODE_INTERFACE,
                "proto", "kernel", "scope", "link", "src", node.address,
                "congctl", cluster.congestion_control])
        if cluster.bandwidth:   # both directions: into the node (host end) and out of it
            shape = ["root", "tbf", "rate", cluster.bandwidth, "burst",
                     burst_for(cluster.bandwidth), "latency", "400ms"]
            sh(["tc", "qdisc", "add", "dev", node.host_link, *shape])
            sh([*inside, "tc", "qdisc", "add", "dev", NODE_INTERFACE, *shape])


def up(directory: Path = DEFAULT_DIR, nodes: int = 2, bandwidth: str | None = None,
       slurm: bool = False, congestion_control: str | None = CONGESTION_CONTROL) -> Cluster:
    """Create the cluster (tearing down on any failure) and return it."""
    if os.geteuid() != 0:
        raise RuntimeError("a cluster of network namespaces needs root")
    if not 1 <= nodes <= 9:
        raise ValueError("--nodes must be 1..9")
    if (directory / "cluster.json").exists() or Path("/run/netns/hvd-node1").exists():
        raise RuntimeError(f"a cluster is already up (run: python {__file__} down)")
    if congestion_control:
        available = AVAILABLE_CONGESTION_CONTROL.read_text().split()
        if congestion_control not in available:
            raise ValueError(f"congestion control {congestion_control!r} is not among this "
                             f"kernel's: {' '.join(available)}")
    require_packages(slurm)
    if bandwidth:
        burst_for(bandwidth)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    cluster = Cluster(directory, [Node(f"node{i}", f"hvd-node{i}", f"{SUBNET}.1{i}", f"hvdv{i}")
                                  for i in range(1, nodes + 1)], bandwidth, slurm,
                      congestion_control=congestion_control)
    cluster.save()
    try:
        _network(cluster)
        _ssh_files(cluster)
        Path("/run/sshd").mkdir(exist_ok=True)
        for node in cluster.nodes:
            _start_daemon(cluster, node.name, ["/usr/sbin/sshd", "-D", "-e", "-f",
                                               str(directory / node.name / "sshd_config")],
                          directory / node.name / "sshd.log")
        for node in cluster.nodes:
            _wait(lambda: sh(["ssh", "-F", str(cluster.ssh_config), node.name, "hostname"], 20,
                             check=False).stdout.strip() == node.name, 30,
                  f"sshd on {node.name} did not answer")
        if slurm:
            _start_slurm(cluster)
        return cluster
    except BaseException:
        down(directory)
        raise


def _start_slurm(cluster: Cluster) -> None:
    """A private munged (its own socket and key), slurmctld on node1, one slurmd per node."""
    directory = cluster.directory
    munge = directory / "munge"
    munge.mkdir(mode=0o700)
    (munge / "munge.key").write_bytes(os.urandom(1024))
    (munge / "munge.key").chmod(0o400)
    daemon = subprocess.Popen(
        ["munged", "--foreground", "--force", f"--socket={munge / 'munge.socket'}",
         f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
         f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        start_new_session=True)
    cluster.started.append(daemon.pid)
    cluster.save()
    _wait(lambda: (munge / "munge.socket").exists(), 30, "munged did not start")
    slurm = directory / "slurm"
    (slurm / "state").mkdir(parents=True)
    head = cluster.nodes[0]
    node_lines = "".join(f"NodeName={n.name} NodeAddr={n.address} CPUs={os.cpu_count()} "
                         "State=UNKNOWN\n" for n in cluster.nodes)
    cluster.slurm_conf.write_text(SLURM_CONF.format(head=head.name, head_address=head.address,
                                                    nodes=node_lines.rstrip(), dir=directory))
    for node in cluster.nodes:
        (slurm / f"spool-{node.name}").mkdir()
        (slurm / f"tmp-{node.name}").mkdir()   # PMIx's per-node directories (not a shared /tmp)
    conf = str(cluster.slurm_conf)
    _start_daemon(cluster, head.name, ["slurmctld", "-D", "-f", conf], slurm / "ctld.out")
    for node in cluster.nodes:
        _start_daemon(cluster, node.name, ["slurmd", "-D", "-f", conf, "-N", node.name],
                      slurm / f"slurmd-{node.name}.out")
    env = dict(os.environ, SLURM_CONF=conf)
    _wait(lambda: sh(["sinfo", "-h", "-o", "%T"], 30, False, env=env).stdout.split()
          == ["idle"], 60, "the Slurm nodes did not become idle")


# --- tearing it down -----------------------------------------------------------------------

def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def down(directory: Path = DEFAULT_DIR) -> None:
    """Stop every process in the nodes and the daemons up started; remove what up made."""
    try:
        cluster = Cluster.load(directory)
    except FileNotFoundError:
        return
    for node in cluster.nodes:
        if Path(f"/run/netns/{node.netns}").exists():
            _kill(cluster.pids(node.name))
    _kill(cluster.started)
    for node in cluster.nodes:
        if Path(f"/run/netns/{node.netns}").exists():
            sh(["ip", "netns", "del", node.netns], check=False)
        sh(["ip", "link", "del", node.host_link], check=False)   # gone with the namespace
        shutil.rmtree(NETNS_ETC / node.netns, ignore_errors=True)
    sh(["ip", "link", "del", BRIDGE], check=False)
    shutil.rmtree(directory, ignore_errors=True)
    try:
        NETNS_ETC.rmdir()          # made by up unless it was there (then not empty, or kept)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="cluster state directory")
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("up", help="create the nodes")
    make.add_argument("--nodes", type=int, default=2)
    make.add_argument("--bandwidth", help="shape each node's link, e.g. 1gbit or 10gbit")
    make.add_argument("--slurm", action="store_true", help="also start munge and Slurm")
    make.add_argument("--congestion-control", default=CONGESTION_CONTROL,
                      help=f"the nodes' TCP congestion control (default: {CONGESTION_CONTROL}; "
                           "system: this machine's default)")
    commands.add_parser("down", help="remove everything up made")
    execute = commands.add_parser("exec", help="run a command on a node")
    execute.add_argument("node")
    execute.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "up":
        cluster = up(args.dir, args.nodes, args.bandwidth, args.slurm,
                     None if args.congestion_control == "system" else args.congestion_control)
        for node in cluster.nodes:
            print(f"{node.name} {node.address} (namespace {node.netns})")
        print(f"ssh -F {cluster.ssh_config} node1   # from this machine")
        print(f"hostfile: {cluster.hostfile(2)}")
        if args.slurm:
            print(f"export SLURM_CONF={cluster.slurm_conf}")
    elif args.command == "down":
        down(args.dir)
    else:
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        cluster = Cluster.load(args.dir)
        return subprocess.run(cluster.on(args.node, command)).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
