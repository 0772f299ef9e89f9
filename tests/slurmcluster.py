"""A real Slurm cluster on one machine: slurmctld and two slurmd, each in a network namespace of its own.

    login/controller netns  <name>c: bridge, 10.201.0.1 "ctl", slurmctld; sbatch & co. run here
    compute netns           <name>1: veth on that bridge, 10.201.0.11, hostname node1, slurmd
    compute netns           <name>2: veth on that bridge, 10.201.0.12, hostname node2, slurmd

Each slurmd also has a UTS namespace of its own (hostname node1 / node2, as Slurm expects its node
name), and `ip netns exec` gives each namespace its own /etc/hosts (/etc/netns/<ns>/hosts) naming the
three machines: so a job's gethostname() resolves to its node's own address, as gloo needs, and the
host's network, hostname and /etc/hosts are never touched. One munged (with a key made for this
cluster) serves all three through a socket file: file sockets cross network namespaces.

Everything else lives in one directory (slurm.conf, state, spool, logs); SLURM_CONF names the config
for the clients. Debian 12 packages: slurmctld slurmd slurm-client munge. Needs root (netns, bridge).

    python tests/slurmcluster.py        start one, print how to reach it, stop it on Ctrl-C or SIGTERM
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

SUBNET = "10.201.0"
CONTROLLER = ("ctl", f"{SUBNET}.1")
NODES = (("node1", f"{SUBNET}.11"), ("node2", f"{SUBNET}.12"))
NODE_CPUS = 2  # each node offers two CPUs (2 x 2 CPU processes); both share this machine's cores
PACKAGES = "slurmctld slurmd slurm-client munge"
START_BOUND_S = 60
_clusters = itertools.count()

# KillWait 30: what a stopped job gets between SIGTERM and SIGKILL, as torchrun gives its workers 30 s.
# cred_expire 5 (default 120): how long a requeued job waits before it may start again; the default
# would make every requeue test wait two minutes; bf_interval 1 and sched_interval 2 (defaults 30 and
# 60): the schedulers look for a job that may start (a requeued one, once it may) every second or two. The two partitions are for preemption: a job in
# `urgent` requeues a job in `batch`, which gets GraceTime seconds after its SIGTERM.
SLURM_CONF = """\
ClusterName=ddptest
SlurmctldHost=ctl({controller_addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
ReturnToService=2
KillWait=30
MinJobAge=3600
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the cluster (no packages, not root): the message says what is missing."""


def missing_requirements() -> str | None:
    tools = ["slurmctld", "slurmd", "sbatch", "munged", "mungekey", "ip", "nsenter", "unshare"]
    absent = [tool for tool in tools if shutil.which(tool) is None]
    if absent:
        return f"{', '.join(absent)} not installed (apt-get install {PACKAGES})"
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, a bridge, slurmd as root)"
    return None


def _run(command: Sequence[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{what}: `{' '.join(command)}` failed: {done.stderr.strip()}")


class SlurmCluster:
    """Start with `with SlurmCluster() as cluster:`; cluster.run([...]) runs a client command on the login node."""

    def __init__(self, root: Path | None = None):
        tag = f"{os.getpid() % 100000}{next(_clusters)}"
        self.name = f"ddps{tag}"
        self.root = root or Path(tempfile.mkdtemp(prefix="ddp-slurm-"))
        self.root.chmod(0o755)  # job scripts are executed from the spool below it
        self.conf = self.root / "slurm.conf"
        self.login_netns = f"{self.name}c"
        self.node_netns = {node: f"{self.name}{i}" for i, (node, _) in enumerate(NODES, 1)}
        self._netns_made: list[str] = []
        self._daemons: dict[str, subprocess.Popen] = {}

    # ---------------------------------------------------------------- clients
    def env(self, extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv as run on the login node (the controller's namespace)."""
        return ["ip", "netns", "exec", self.login_netns, *argv]

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(self.command(argv), env=self.env(base=env), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}\n{self.logs()}")
        return done

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "SlurmCluster":
        reason = missing_requirements()
        if reason:
            raise SlurmUnavailable(reason)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        for sub in ("state", "log", "munge", "spool"):
            (self.root / sub).mkdir(exist_ok=True)
        self._start_munge()
        self._write_conf()
        self._make_network()
        self._daemons["slurmctld"] = self._daemon(
            "slurmctld", self._on_host(self.login_netns, CONTROLLER[0], ["slurmctld", "-D", "-i", "-f", str(self.conf)]))
        for node, netns in self.node_netns.items():
            (self.root / "spool" / node).mkdir(mode=0o755)
            self._daemons[node] = self._daemon(node, self._on_host(netns, node, ["slurmd", "-D", "-f", str(self.conf)]))
        self.wait_idle()

    def _on_host(self, netns: str, hostname: str, argv: list[str]) -> list[str]:
        """argv on one machine of the cluster: its network namespace, its own hostname and /etc/hosts.
        Not `ip netns exec`: that mounts a fresh /sys, which hides /sys/fs/cgroup, and slurmd 22.05 will
        not start without its cgroup plugin (even with proctrack/linuxproc and task/none)."""
        return ["nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "--mount", "--", "sh", "-c",
                'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"', "sh", hostname,
                str(self.root / "hosts"), *argv]

    def _daemon(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.root / "log" / f"{name}.stdout", "ab")  # noqa: SIM115 (the with below closes it)
        with log:
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                    start_new_session=True)

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        munge.chmod(0o755)
        key = munge / "munge.key"
        _run(["mungekey", "--create", "--keyfile", str(key)], "a munge key for this cluster")
        key.chmod(0o400)
        self.munge_socket = munge / "munge.socket"
        # --force: munged refuses to run as root without it; this one serves only this cluster's socket.
        self._daemons["munged"] = self._daemon("munged", [
            "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
            f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}",
            f"--log-file={self.root / 'log' / 'munged.log'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")

    def _write_conf(self) -> None:
        nodes = "\n".join(f"NodeName={node} NodeAddr={addr} CPUs={NODE_CPUS} RealMemory=1000 State=UNKNOWN"
                          for node, addr in NODES)
        self.conf.write_text(SLURM_CONF.format(controller_addr=CONTROLLER[1], munge_socket=self.munge_socket,
                                               root=self.root, nodes=nodes))

    def _make_network(self) -> None:
        hosts = "127.0.0.1 localhost\n" + "".join(f"{addr} {name}\n" for name, addr in (CONTROLLER, *NODES))
        (self.root / "hosts").write_text(hosts)
        bridge = "br0"
        for netns in (self.login_netns, *self.node_netns.values()):
            _run(["ip", "netns", "add", netns], "a network namespace")
            self._netns_made.append(netns)
            if netns == self.login_netns:  # `ip netns exec` (the clients) reads /etc/netns/<ns>/hosts
                etc = Path("/etc/netns") / netns
                etc.mkdir(parents=True, exist_ok=True)
                (etc / "hosts").write_text(hosts)
            _run(["ip", "-n", netns, "link", "set", "lo", "up"], "loopback up")
        login = self.login_netns
        for step in (["link", "add", bridge, "type", "bridge"], ["addr", "add", f"{CONTROLLER[1]}/24", "dev", bridge],
                     ["link", "set", bridge, "up"]):
            _run(["ip", "-n", login, *step], "the cluster's bridge")
        for i, (node, addr) in enumerate(NODES, 1):
            netns, inside, outside = self.node_netns[node], "eth0", f"veth{i}"
            _run(["ip", "-n", login, "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", netns],
                 f"{node}'s link")
            _run(["ip", "-n", login, "link", "set", outside, "master", bridge, "up"], f"{node}'s link")
            _run(["ip", "-n", netns, "addr", "add", f"{addr}/24", "dev", inside], f"{node}'s address")
            _run(["ip", "-n", netns, "link", "set", inside, "up"], f"{node}'s link")

    def _wait(self, condition, what: str, bound_s: float = START_BOUND_S) -> None:
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            if condition():
                return
            dead = [name for name, proc in self._daemons.items() if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n{self.logs()}")
            time.sleep(0.2)
        raise RuntimeError(f"not within {bound_s:.0f} s: {what}\n{self.logs()}")

    def node_states(self) -> dict[str, str]:
        done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], check=False)
        return dict(line.split() for line in done.stdout.splitlines() if line.strip()) if done.returncode == 0 else {}

    def wait_idle(self, bound_s: float = START_BOUND_S) -> None:
        """Every node idle: registered with the controller and running nothing."""
        self._wait(lambda: set(self.node_states().values()) == {"idle"} and len(self.node_states()) == len(NODES),
                   "both nodes idle", bound_s)

    def stop(self) -> None:
        """Cancel what runs, stop the daemons (each by its PID), and remove the namespaces and files."""
        if "slurmctld" in self._daemons and self._daemons["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--quiet", "--user=root"], check=False)
        for proc in self._daemons.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._daemons.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._daemons.clear()
        for netns in self._netns_made:
            # Whatever is left in a namespace of ours (slurmstepd, job processes) was started there by us.
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for netns in self._netns_made:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        self._netns_made.clear()


FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
JOB_BOUND_S = 240  # a hang becomes a failure; the jobs of the tests take 20-90 s on a loaded 2-core runner


def user_shell() -> dict[str, str]:
    """The environment of a user who activated this Python's venv (its bin first on PATH), clean of any
    topology or training settings (helpers.clean_env). sbatch and srun hand it to the job."""
    from helpers import clean_env

    return clean_env({"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])})


class SlurmJob:
    """`sbatch ARGS` run in `root` from the user's shell (user_shell() plus `env`).
    Its output is root/<job name>-<id>.out (the scripts' --output=%x-%j.out)."""

    def __init__(self, cluster: SlurmCluster, root: Path, sbatch_args: Sequence[str], name: str = "ddp-train",
                 **env: str):
        self.cluster, self.root, self.name = cluster, root, name
        root.mkdir(exist_ok=True)
        shell = {**user_shell(), **env}
        done = cluster.run(["sbatch", "--parsable", *sbatch_args], env=shell, cwd=root)
        self.id = done.stdout.strip().split(";")[0]

    def info(self) -> dict[str, str]:
        done = self.cluster.run(["scontrol", "show", "job", "--oneliner", self.id])
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def output(self) -> str:
        path = self.root / f"{self.name}-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, bound_s: float = JOB_BOUND_S) -> dict[str, str]:
        """The job's final state (scontrol's fields), once it has one."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            info = self.info()
            if info["JobState"] in FINISHED:
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {self.id} not finished within {bound_s:.0f} s: {self.info()}\n"
                             f"{self.output()[-4000:]}\n{self.cluster.logs()}")

    def assert_completed_on_both_nodes(self, summary_dir: Path, checkpoint_dir: Path, steps: int) -> dict:
        """Completed, on node1 and node2, as one world of 4 gloo ranks that took `steps` steps."""
        from helpers import checkpoint_steps, read_summary

        info = self.wait()
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{self.output()[-4000:]}"
        assert info["NodeList"] == "node[1-2]" and info["NumNodes"] == "2", info
        summary = read_summary(summary_dir)
        assert summary["status"] == "completed" and summary["world_size"] == 4 and summary["backend"] == "gloo"
        assert summary["global_step"] == steps and checkpoint_steps(checkpoint_dir)[-1] == steps
        return summary


def main() -> int:
    reason = missing_requirements()
    if reason:
        print(f"error: slurm: {reason}", file=sys.stderr)
        return 2
    with SlurmCluster() as cluster:
        print(f"cluster up; files in {cluster.root}\n"
              f"  SLURM_CONF={cluster.conf} ip netns exec {cluster.login_netns} sbatch ...   (login node)\n"
              f"  nodes: {', '.join(f'{n} (netns {ns})' for n, ns in cluster.node_netns.items())}\n"
              "Ctrl-C or SIGTERM stops it.", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):  # a background job of a script ignores SIGINT
            signal.signal(sig, lambda *_: sys.exit(0))
        signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
