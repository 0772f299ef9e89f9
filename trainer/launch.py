"""`trainer-launch`: the container entrypoint. Topology from the environment -> torchrun.

    NNODES (1)  NODE_RANK (0)  NPROC_PER_NODE (visible GPUs, or 2 without GPUs)
    MASTER_ADDR (127.0.0.1 on one node; required on several)  MASTER_PORT (29500)
    MAX_RESTARTS (0)  RDZV_TIMEOUT (seconds, 900)  PREFLIGHT (1: run trainer-doctor first)

Arguments after the launcher's own pass through to `python -m trainer`. The training options are
validated here, before torchrun starts, so a mistake is one line and exit code 2, never a hang.
The launcher then replaces itself with torchrun (exec of trainer.supervisor, which is torchrun's own
code in the same process), so signals reach torchrun directly.
A container given RANK and WORLD_SIZE but no NNODES (one process per container) runs the worker itself.
"""

from __future__ import annotations

import glob
import os
import shlex
import socket
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from trainer.config import FALSE_WORDS, TRUE_WORDS, TrainConfig, load_config
from trainer.distributed import DEFAULT_MASTER_PORT, check_gpu_options, detect_topology
from trainer.errors import UsageError, env_int, exit_on_usage_error, print_error

DEFAULT_RDZV_TIMEOUT = 900


@dataclass(frozen=True)
class LaunchPlan:
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    max_restarts: int
    rdzv_timeout: int

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def nvidia_devices_present() -> bool:
    """Without NVIDIA device nodes torch can see no GPU: then skip its multi-second import."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def visible_gpu_count() -> int:
    if not nvidia_devices_present():
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # a broken driver should read as "no GPU", not crash the launcher or the doctor
        return 0


def plan_from_env(env: Mapping[str, str], gpu_count: Callable[[], int]) -> LaunchPlan:
    """gpu_count is called only when needed: importing torch to count GPUs takes seconds."""
    nnodes = env_int(env, "NNODES", 1, 1)
    node_rank = env_int(env, "NODE_RANK", 0, 0)
    if node_rank >= nnodes:
        raise UsageError("NODE_RANK", f"{node_rank} is not below NNODES {nnodes}",
                         f"give each host a distinct NODE_RANK from 0 to {nnodes - 1}")
    master_addr = env.get("MASTER_ADDR", "").strip()
    if not master_addr:
        if nnodes > 1:
            raise UsageError("MASTER_ADDR", f"is required when NNODES={nnodes}",
                             "set it to the address of the NODE_RANK=0 host, the same on every host")
        master_addr = "127.0.0.1"
    master_port = env_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT, 1, 65535)
    max_restarts = env_int(env, "MAX_RESTARTS", 0, 0)
    rdzv_timeout = env_int(env, "RDZV_TIMEOUT", DEFAULT_RDZV_TIMEOUT, 1)
    gpus = gpu_count()
    nproc = env_int(env, "NPROC_PER_NODE", gpus or 2, 1)
    if gpus and nproc > gpus:
        raise UsageError("NPROC_PER_NODE", f"{nproc} processes but only {gpus} GPUs are visible",
                         f"set NPROC_PER_NODE to at most {gpus} (one process per GPU)")
    return LaunchPlan(nnodes, node_rank, nproc, master_addr, master_port, max_restarts, rdzv_timeout)


def torchrun_command(plan: LaunchPlan, trainer_args: Sequence[str]) -> list[str]:
    """Static rendezvous at MASTER_ADDR:MASTER_PORT: NODE_RANK decides the ranks, so rank 0 is on host 0."""
    return [
        "torchrun",
        f"--nnodes={plan.nnodes}",
        f"--node-rank={plan.node_rank}",
        f"--nproc-per-node={plan.nproc_per_node}",
        f"--master-addr={plan.master_addr}",
        f"--master-port={plan.master_port}",
        f"--max-restarts={plan.max_restarts}",
        f"--rdzv-conf=timeout={plan.rdzv_timeout}",
        "-m", "trainer", *trainer_args,
    ]


def single_worker_command(trainer_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "trainer", *trainer_args]


def build_command(env: Mapping[str, str], trainer_args: Sequence[str],
                  gpu_count: Callable[[], int] = visible_gpu_count) -> tuple[list[str], TrainConfig, LaunchPlan | None]:
    """The command to exec, the training options it runs with and its topology (None when this process is
    the one worker), validated on the way."""
    if "RANK" in env and "WORLD_SIZE" in env and "NNODES" not in env:
        cfg = load_config(trainer_args, env, world_size=detect_topology(env).world_size)  # checks RANK too
        return single_worker_command(trainer_args), cfg, None
    # All but the world-size checks, before counting GPUs (which may import torch).
    options = load_config(trainer_args, env, world_size=1)
    plan = plan_from_env(env, gpu_count)
    # The worker's own check, before torchrun starts ranks that would each fail with it.
    check_gpu_options(options.backend, options.sync_bn, gpu_count() > 0, plan.world_size)
    return torchrun_command(plan, trainer_args), load_config(trainer_args, env, world_size=plan.world_size), plan


def preflight_enabled(env: Mapping[str, str]) -> bool:
    raw = env.get("PREFLIGHT", "").strip()
    if raw.lower() in ("", *TRUE_WORDS):  # unset or empty: the default, on
        return True
    if raw.lower() in FALSE_WORDS:
        return False
    raise UsageError("PREFLIGHT", f"'{raw}' is not a boolean", "use 1 to run trainer-doctor first or 0 to skip it")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        print("\nTraining options (python -m trainer --help):")
        os.execvp(sys.executable, [sys.executable, "-m", "trainer", "--help"])
    with exit_on_usage_error():
        command, cfg, plan = build_command(os.environ, args)
        preflight = preflight_enabled(os.environ)
        if plan is not None:
            ensure_master_port_free(plan)
    if preflight:
        run_preflight(cfg)
    print("+ " + shlex.join(command), file=sys.stderr, flush=True)
    if command[0] == "torchrun":  # the same torchrun, in-process, reporting failures in one line
        command = [sys.executable, "-m", "trainer.supervisor", *command[1:]]
    os.execvp(command[0], command)
    return 0  # not reached


def ensure_master_port_free(plan: LaunchPlan) -> None:
    """Node 0's torchrun hosts the rendezvous store on MASTER_PORT. A taken port would otherwise show
    only after the rendezvous timeout, as a C++ error about the store."""
    if plan.node_rank != 0:
        return
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is no conflict
        try:
            sock.bind(("", plan.master_port))
        except OSError as err:
            raise UsageError("MASTER_PORT", f"{plan.master_port} cannot be used on this host ({err.strerror})",
                             "stop what listens there (another NODE_RANK=0 launcher?) or choose a free "
                             "MASTER_PORT, the same on every host") from None


def run_preflight(cfg: TrainConfig) -> None:
    from trainer.doctor import format_table, run_checks

    checks = run_checks(os.environ, cfg)
    failed = [c for c in checks if c.status == "fail"]
    if failed or any(c.status == "warn" for c in checks):
        print(format_table([c for c in checks if c.status != "pass"]), file=sys.stderr, flush=True)
    if failed:
        first = failed[0]
        print_error(f"preflight: {first.name}: {first.value} ({first.fix}; PREFLIGHT=0 skips the checks)")
        raise SystemExit(2)


if __name__ == "__main__":
    raise SystemExit(main())
