"""Preflight checks for distributed training in containers (`trainer-doctor`).

Reads the topology with the launcher's own resolver (trainer/cluster/topology.py: NNODES, ..., Slurm, Kubeflow,
SkyPilot), *_SOCKET_IFNAME, and the training options the way the trainer does (flags, TRAIN_*
variables, .env), and reports problems that otherwise show up as bus errors or silent hangs.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

from trainer.cluster.gpus import visible_gpu_count
from trainer.cluster.launch import with_launch_port
from trainer.cluster.topology import LAUNCHER, Topology, resolve
from trainer.cluster.versions import cpu_versions, version_fingerprint
from trainer.config import catalog, launcher
from trainer.config.settings import TrainConfig, build_parser, load_config, read_env_file
from trainer.core.errors import OneLineErrorParser, UsageError, exit_on_usage_error

MIB, GIB = 1 << 20, 1 << 30
SHM_DIR = "/dev/shm"
SHM_FIX = "run with ipc: host or shm_size: 8gb (compose), --shm-size / --ipc=host (docker run)"
IFACE_FIX = "other nodes cannot reach it: name the host's routable interface (network_mode: host)"


@dataclass
class Check:
    name: str
    status: str  # 'pass' | 'warn' | 'fail'
    value: str
    fix: str = ""


def _check(name: str, status: str, value: str, fix: str = "") -> Check:
    return Check(name, status, value, "" if status == "pass" else fix)


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / MIB:.{0 if n >= 10 * MIB else 1}f} MiB"


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


# What the shared-memory need depends on, read off the training options and the catalogue (torch-free:
# trainer.data and trainer.engine.models import torch, seconds the doctor avoids on hosts without GPUs).
# tests/test_doctor.py pins these against the datasets and models those modules build.
PREFETCH_FACTOR = 4  # batches in flight per DataLoader worker (data.Batches)


def data_shape(training: TrainConfig) -> tuple[int, int, int] | None:
    """(channels, image side, classes) of the uint8 training images; None for a user's dataset (known only
    once its factory runs, in the workers)."""
    entry = catalog.DATASETS.get(training.dataset)
    if entry is None:
        return None
    side = catalog.dataset_image_size(training.dataset, training.synthetic_image_size, training.image_size)
    classes = entry.num_classes
    if classes is None and training.dataset == "packed":  # trainer-pack's header names them
        try:
            classes = len(json.loads((Path(training.data_dir) / "pack.json").read_text())["classes"])
        except (OSError, ValueError, KeyError, TypeError):  # the trainer names the damaged file, in one line
            return None
    elif classes is None:  # ImageFolder's classes are the folders in train/
        with os.scandir(Path(training.data_dir) / "train") as entries:
            classes = sum(entry.is_dir() for entry in entries)
    return entry.channels, side, classes


def dataloader_workers(training: TrainConfig) -> int:
    """Worker processes per training process: only the dataloader input path starts any."""
    in_memory = catalog.in_memory(training.dataset)
    dataloader = training.loader == "dataloader" or (training.loader == "auto" and not in_memory)
    return training.num_workers if dataloader else 0


def parameter_count(model: str, channels: int, side: int, classes: int) -> int | None:
    """Parameters of the model the trainer builds for this data: the catalogue's formula for a built-in model,
    torchvision's model built on the meta device (no memory, no weights) for one of its names, None for a
    user's model (the doctor runs no user code)."""
    if model in catalog.MODELS:
        return catalog.MODELS[model].parameters(channels, side, classes)
    if catalog.is_import_path(model):
        return None
    import torch

    try:
        with torch.device("meta"):
            built = catalog.torchvision_model(model, catalog.DataSpec(channels, side, classes))
    except Exception:  # noqa: BLE001 (the workers build it for real and say what is wrong)
        return None
    return sum(p.numel() for p in built.parameters() if p.requires_grad)


def shm_uses(training: TrainConfig, plan: Topology, gpus: int) -> tuple[int, int, list[str]]:
    """Bytes of /dev/shm the DataLoader workers and the gradient all-reduce need, and what they are."""
    shape = data_shape(training)
    procs, uses = plan.nproc_per_node, []
    workers = dataloader_workers(training)
    loader = 0
    if workers and shape is None:
        uses.append(f"DataLoader {workers} workers x {procs} procs (sample size of {training.dataset} unknown)")
    elif workers:
        channels, side, _ = shape
        loader = workers * training.batch_size * channels * side * side * PREFETCH_FACTOR * procs
        uses.append(f"DataLoader {workers} workers x {procs} procs, {_size(loader)}")
    allreduce = 0
    if training.shm_allreduce and gpus == 0 and training.backend != "nccl" and plan.nnodes == 1:
        parameters = parameter_count(training.model, *shape) if shape is not None else None
        if parameters is None:
            uses.append("all-reduce of gradients (size unknown until the model is built)")
        else:
            gradients = 4 * parameters  # float32
            allreduce = 2 * procs * gradients  # every process's buckets, twice while DDP rebuilds them
            uses.append(f"all-reduce 2 x {procs} procs x {_size(gradients)} of gradients, {_size(allreduce)}")
    return loader, allreduce, uses


def check_shm(training: TrainConfig | None, plan: Topology, gpus: int) -> Check:
    # DataLoader workers hand batches over through /dev/shm: Docker's 64 MiB default kills them with
    # "bus error". CPU processes all on one host all-reduce gradients there (trainer/parallel/shm_allreduce.py);
    # without the room they fall back to gloo's slower TCP, so that shortfall only warns.
    # A user's script (training None) may start DataLoader workers of unknown need: below 1 GiB warns.
    loader, allreduce, uses = shm_uses(training, plan, gpus) if training else (0, 0, [])
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return Check("shared memory", "warn", f"{SHM_DIR} not found", SHM_FIX)
    size, free, need = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail, loader + allreduce
    low = free < need or size < 2 * need or ((loader > 0 or training is None) and size < GIB)
    what = ("a script's DataLoader workers pass batches here (1 GiB or more)" if training is None else
            f"need ~{_size(need)}: " + ("; ".join(uses) or "no DataLoader workers, no shared-memory all-reduce"))
    return _check("shared memory", "fail" if free < loader else "warn" if low else "pass",
                  f"{SHM_DIR} {_size(size)} ({_size(free)} free), {what}", SHM_FIX)


RDMA_DEVICES = "/sys/class/infiniband"  # InfiniBand and RoCE adapters, the transports that lock memory
STACK_BYTES = 64 * MIB  # NVIDIA's recommended container stack size for CUDA workloads


def container_runtime(env: Mapping[str, str], root: str = "/") -> str | None:
    """What runs this process: 'docker', 'podman', 'kubernetes', 'apptainer', or None (bare metal). A fix for a
    resource limit is the engine's `--ulimit` inside a container, but the shell's `ulimit` on a host (and under
    Apptainer, which inherits the limits of the shell that starts it)."""
    if env.get("APPTAINER_CONTAINER") or env.get("SINGULARITY_CONTAINER"):
        return "apptainer"
    if env.get("KUBERNETES_SERVICE_HOST"):
        return "kubernetes"
    if os.path.exists(os.path.join(root, "run/.containerenv")) or env.get("container") == "podman":
        return "podman"
    if os.path.exists(os.path.join(root, ".dockerenv")):
        return "docker"
    return None


def limit_fixes(runtime: str | None) -> tuple[str, str]:
    """(memlock fix, stack fix) in the syntax of where the process runs."""
    if runtime in ("docker", "podman"):
        return ("unlimited memlock: compose's default ULIMIT_MEMLOCK=-1 / docker run --ulimit memlock=-1, on an engine "
                "that may raise it; else NCCL_IB_DISABLE=1 (sockets)",
                f"compose: ulimits: stack: {STACK_BYTES} / {runtime} run --ulimit stack={STACK_BYTES}")
    if runtime == "kubernetes":
        return ("the node's container runtime sets it (e.g. dockerd --default-ulimit memlock=-1); else NCCL_IB_DISABLE=1 "
                "(sockets)", f"the node's container runtime sets it (e.g. dockerd --default-ulimit stack={STACK_BYTES})")
    before = " before apptainer exec" if runtime == "apptainer" else " in the shell that starts the job"
    return (f"ulimit -l unlimited{before} (a hard limit below it: a memlock line in /etc/security/limits.conf); else "
            "NCCL_IB_DISABLE=1 (sockets)",
            f"ulimit -s {STACK_BYTES // 1024}{before} (a hard limit below it: a stack line in /etc/security/limits.conf)")


def check_ulimits(gpus: int, env: Mapping[str, str]) -> list[Check]:
    import resource

    inf = resource.RLIM_INFINITY
    memlock = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
    shown = {v: "unlimited" if v == inf else _size(v) for v in (memlock, stack)}
    # Only NCCL's InfiniBand/RoCE transport registers (locks) host memory; gloo, NCCL's sockets and
    # its shared-memory transport lock none. So a limited memlock (ULIMIT_MEMLOCK, for engines that
    # may not raise it: rootless Docker, Podman) is fine unless NCCL would use an RDMA device.
    try:
        rdma = sorted(os.listdir(RDMA_DEVICES))
    except OSError:
        rdma = []
    needs_memlock = gpus > 0 and bool(rdma) and env.get("NCCL_IB_DISABLE", "").strip() != "1"
    why = ("" if memlock == inf else f" (NCCL over {', '.join(rdma)} locks memory)" if needs_memlock
           else " (enough: gloo and NCCL without InfiniBand/RoCE lock none)" if gpus
           else " (enough: gloo on the CPU locks none)")
    memlock_fix, stack_fix = limit_fixes(container_runtime(env))
    # NVIDIA's containers run CUDA with a 64 MiB stack; on the CPU the default 8 MiB trains (the whole test suite
    # runs there). A bare "WARN 8.0 MiB" on a CPU host was read as the cause of an unrelated failure.
    low_stack = stack != inf and stack < STACK_BYTES
    stack_why = ("" if not low_stack else f" (below the {_size(STACK_BYTES)} NVIDIA's containers run CUDA with)" if gpus
                 else f" (enough on the CPU; NVIDIA's containers run CUDA with {_size(STACK_BYTES)})")
    return [
        _check("ulimit memlock", "warn" if needs_memlock and memlock != inf else "pass", shown[memlock] + why,
               memlock_fix),
        _check("ulimit stack", "warn" if low_stack and gpus else "pass", shown[stack] + stack_why, stack_fix)]


def check_gpus(gpus: int, nproc: int) -> Check:
    # More processes than GPUs is a topology failure: the launcher's parser refuses it.
    return Check("GPUs", "pass", f"{gpus} visible, NPROC_PER_NODE={nproc}" if gpus else "no GPU: gloo on CPU")


def _iface_addrs() -> dict[str, list[str]] | None:
    """Addresses per interface from `ip -o addr`; None when `ip` is unavailable."""
    try:
        out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True,
                             timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    addrs: dict[str, list[str]] = {}
    for f in (line.split() for line in out.splitlines()):
        if len(f) >= 4 and f[2] in ("inet", "inet6"):  # names may read "eth0@if12" in containers
            addrs.setdefault(f[1].split("@")[0], []).append(f[3].split("/")[0])
    return addrs


def _ipv4_ioctl(name: str) -> list[str]:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:  # SIOCGIFADDR
            res = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return []
    return [socket.inet_ntoa(res[20:24])]


def _unusable(name: str, addrs: dict[str, list[str]] | None) -> str | None:
    """Why other nodes could not reach us through `name`; None if it looks fine or is unknown."""
    if name == "lo":
        return "loopback"
    found = addrs.get(name, []) if addrs is not None else _ipv4_ioctl(name)
    if found and all(_is_loopback(a) for a in found):
        return "loopback address only"
    # The ioctl sees IPv4 only, so trust "no address" only when `ip` listed everything.
    return "no address" if addrs is not None and not found else None


def check_ifname(var: str, env: Mapping[str, str], nnodes: int, existing: list[str],
                 addrs: dict[str, list[str]] | None) -> Check | None:
    raw = env.get(var, "").strip()
    if not raw:
        return None
    nccl = var.startswith("NCCL")
    if nccl and raw.startswith("^"):  # an exclusion list may name interfaces that do not exist
        return Check(var, "pass", f"{raw} (exclusion list, not checked)")
    prefix = nccl and not raw.startswith("=")  # NCCL matches prefixes unless '='; gloo is exact
    missing, matched = [], []
    for n in filter(None, (n.strip() for n in raw.lstrip("=").split(","))):
        hits = [i for i in existing if i == n or (prefix and i.startswith(n))]
        matched += [i for i in hits if i not in matched]
        missing += [] if hits else [n]
    if missing:
        return Check(var, "fail", f"{raw}: no interface {', '.join(missing)}",
                     f"existing interfaces: {', '.join(existing)}")
    bad = [f"{i} ({why})" for i in matched if (why := _unusable(i, addrs))] if nnodes > 1 else []
    # Fail only when nothing reachable is left for NCCL/gloo to use.
    status = "pass" if not bad else "fail" if len(bad) == len(matched) else "warn"
    value = f"{raw}: {', '.join(bad)}" if bad else f"{raw} -> {', '.join(matched)}"
    return _check(var, status, value, IFACE_FIX)


def check_interfaces(env: Mapping[str, str], nnodes: int) -> list[Check]:
    existing = [name for _, name in socket.if_nameindex()]
    addrs = _iface_addrs()
    rows = [c for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
            if (c := check_ifname(var, env, nnodes, existing, addrs))]
    if rows or nnodes == 1:
        return rows or [Check("socket interface", "pass", "auto (single node)")]
    usable = [i for i in existing if not _unusable(i, addrs)]
    return [Check("socket interface", "warn", "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME unset",
                  f"set both to the interface that routes between nodes ({', '.join(usable)}); "
                  "otherwise NCCL/gloo may pick docker0 or lo")]


def check_master(plan: Topology) -> list[Check]:
    addr, port = plan.master_addr, plan.master_port
    given = plan.sources.get("master_addr", "default")
    where = "" if given.startswith(("default", "MASTER_ADDR")) else f" (from {given})"  # a controller's
    try:
        ips = sorted({i[4][0] for i in socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)})
    except (OSError, UnicodeError) as e:
        return [Check("MASTER_ADDR", "fail", f"{addr}{where} does not resolve ({e})",
                      "use node 0's IP, or a hostname every node resolves "
                      "(extra_hosts (compose) / --add-host (docker run))")]
    loop = plan.world_size > plan.local_world_size and plan.rank == 0 and all(_is_loopback(ip) for ip in ips)
    rows = [_check("MASTER_ADDR", "warn" if loop else "pass", f"{addr}{where} -> {', '.join(ips)}",
                   "loopback: other hosts cannot reach it; use this host's routable IP/hostname")]
    if plan.rank == 0:  # node 0 (rank 0) hosts the rendezvous store; everyone else must reach it
        return rows
    try:
        socket.create_connection((addr, port), timeout=2).close()
        return rows + [Check("MASTER_PORT", "pass", f"{addr}:{port} reachable")]
    except OSError as e:
        # A warning, not a failure: hosts start in any order and torchrun waits RDZV_TIMEOUT for node 0.
        return rows + [Check("MASTER_PORT", "warn", f"{addr}:{port} not reachable yet ({e})",
                             "start node 0 first / open the port in the firewall")]


def check_dir(name: str, var: str, path: str) -> Check:
    # Never create the directory (a typo would leave litter): probe its nearest existing parent.
    target = probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    fix = f"mount a writable volume there (not :ro) or set {var} to a writable path"
    if not os.path.isdir(probe):
        return Check(name, "fail", f"{path}: {probe} is not a directory", fix)
    try:
        fd, tmp = tempfile.mkstemp(dir=probe, prefix=".trainer-doctor-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return Check(name, "fail", f"{path}: not writable ({e.strerror})", fix)
    free = shutil.disk_usage(probe).free
    value = f"{path}: writable, {_size(free)} free" + (" (to be created)" * (probe != target))
    return _check(name, "warn" if free < GIB else "pass", value,
                  "free some space or use a bigger volume")


def run_checks(env: Mapping[str, str], training: TrainConfig | None = None, own_script: bool = False) -> list[Check]:
    """`training`: the options the run will use (the launcher's, validated); default: the environment's.
    own_script: the run is a user's script, whose options and folders are its own: only the checks of
    the host, the topology and the network apply."""
    training = None if own_script else training or load_config([], env, world_size=1)
    gpus = visible_gpu_count()
    fp = version_fingerprint() if gpus else cpu_versions()
    dirs = [] if training is None else [
        check_dir("checkpoint dir", "--checkpoint-dir (TRAIN_CHECKPOINT_DIR)", training.checkpoint_dir),
        check_dir("log dir", "--log-dir (TRAIN_LOG_DIR)", training.log_dir)]
    host = [
        *check_ulimits(gpus, env),
        *dirs,
        Check("versions", "pass", f"torch {fp['torch']}, CUDA {fp['cuda'] or 'none'}, "
              f"NCCL {fp['nccl'] or 'n/a'}, Python {fp['python']}"),
    ]
    try:
        plan = resolve(env, LAUNCHER, lambda: gpus)
    except UsageError as err:  # the launcher's own message; the other rows need a topology
        setting, problem, fix = err.parts
        return [Check("topology", "fail", f"{setting}: {problem}", fix), *host]
    plan = with_launch_port(plan)  # one host, MASTER_PORT unset: what a launch meets on (each takes its own)
    topology = Check("topology", "pass", plan.summary().removeprefix("topology: "))
    return [topology, check_shm(training, plan, gpus), check_gpus(gpus, plan.nproc_per_node),
            *check_interfaces(env, plan.nnodes), *check_master(plan), *host]


def format_table(checks: list[Check]) -> str:
    rows = [("check", "result", "value", "fix")]
    rows += [(c.name, c.status.upper(), c.value, c.fix) for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    rows.insert(1, tuple("-" * w for w in widths) + ("---",))
    return "\n".join("  ".join([*(r[i].ljust(widths[i]) for i in range(3)), r[3]]).rstrip()
                     for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    """The checks; with --data DIR, every image file of DIR decoded as training would (trainer.data.check, loaded
    only then: the checks import no torch)."""
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--json", action="store_true", help="print JSON instead of a table")
    own.add_argument("--data", metavar="DIR", help="instead of the checks: decode every image file of DIR (an image "
                     "folder, one split of it, or a pack) as training would, and list those that do not decode and "
                     "the class folders without an image; exits 1 if there are any")
    with exit_on_usage_error():
        # The whole command line, so that a mistake (or --help) names trainer-doctor and its options; --help shows
        # the values of the environment and the dotenv file (--env-file) as the trainer's does.
        env_file, _, dotenv = read_env_file(own.parse_known_args(argv)[1])
        parser = OneLineErrorParser(
            prog="trainer-doctor", usage="trainer-doctor [--json] [training options]", add_help=False,
            parents=[own, build_parser(os.environ, dotenv, env_file)],
            description="Preflight checks for distributed training; exits 1 if any check fails. The training "
                        "options are read as the trainer reads them.")
        parser.parse_args(argv)
        args, training_args = own.parse_known_args(argv)
        training = load_config(training_args, os.environ, world_size=1)
        if args.data is not None:
            from trainer.data.check import main as data_check

            return data_check(args.data, training, args.json)
        env = launcher.with_dotenv(os.environ, *launcher.dotenv_file(training_args))  # the launcher's settings too
    checks = run_checks(env, training)
    failed = any(c.status == "fail" for c in checks)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        n = {s: sum(c.status == s for c in checks) for s in ("pass", "warn", "fail")}
        print(format_table(checks))
        print(f"\n{n['pass']} passed, {n['warn']} warnings, {n['fail']} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
