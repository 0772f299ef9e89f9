"""`python -m bench.torchft_step_cost`: what torchft's per-step contract costs by itself, the floor of in place's.

In place (trainer/engine/inplace.py) does per step what the restart path's DistributedDataParallel does (the gradients
summed over the hosts, overlapped with the backward), plus what torchft's Manager asks of every step: a quorum before
it (start_quorum: a round trip to the host's ManagerServer and from there to the lighthouse, answered once every host
asked), a tiny sum over the hosts (the trainer's flag of a host that read a newer checkpoint: one float), and
should_commit after the backward (a round trip to the ManagerServer). Those three are a fixed cost per step, whatever
the model: their share of a step shrinks as the step grows. This bench measures them alone, with nothing of this
project's engine, so that the fault-free goals of issue 46 can be read against them, and a torchft upgrade measured:

  - a torchft lighthouse (`python -m trainer.cluster.lighthouse`, as trainer-launch starts it);
  - two replica groups of one process each (two "hosts" on this machine, each with its own store, as the trainer's
    hosts of one process), in lockstep: per step, start_quorum(), allreduce of one float and its wait(),
    should_commit(), then --step-ms of work (a busy loop: the step's compute, which the real step has between them);
  - --busy N processes spinning beside them, each a core's worth of load (0: an idle machine; on a machine of 2
    cores, 2 is the load of a two-host training run such as bench.step_cost's).

Prints one JSON line per replica per load, and a summary line per load: the medians (ms) of the quorum, the flag's
sum and should_commit, their total, and that total as a share of --step-ms plus itself. Beside them, not in the
total: `direct`, the same float summed right after on the same group, called directly rather than through the
Manager's allreduce: `flag` minus `direct` is what torchft's wrapper (its timeout's registration, the managed work's
chain of callbacks) adds to each sum the trainer launches through it.

    python -m bench.torchft_step_cost --steps 300 --busy 0 2 --step-ms 150
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from bench.goodput import free_port, stop_on_sigterm

PARTS = ("quorum", "flag", "commit")  # torchft's contract, summed in the total
BESIDE = ("direct",)  # the flag's sum on the same group without the Manager's wrapper: not part of the contract


def replica(args) -> int:
    """One replica group of one process: --steps steps of torchft's contract; its timings as one JSON line."""
    import torch
    from torch.distributed import AllreduceOptions, ReduceOp, TCPStore

    from torchft import Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    _store = TCPStore("127.0.0.1", args.store_port, is_master=True, wait_for_workers=False)  # the host's own
    timeout = timedelta(seconds=30)
    group = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg=group, load_state_dict=lambda state: None,
                      state_dict=lambda: {}, min_replica_size=2, use_async_quorum=False,  # as the trainer asks
                      timeout=timeout, quorum_timeout=timeout, connect_timeout=timedelta(seconds=30), rank=0,
                      world_size=1, store_addr="127.0.0.1", store_port=args.store_port,
                      lighthouse_addr=args.lighthouse, replica_id=f"bench_{args.replica}", hostname="127.0.0.1")
    flag = torch.zeros(1)
    options = AllreduceOptions()
    options.reduceOp = ReduceOp.SUM
    spent: dict[str, list[float]] = {part: [] for part in (*PARTS, *BESIDE)}
    for step in range(args.steps):
        began = time.perf_counter()
        manager.start_quorum()
        quorum = time.perf_counter()
        manager.allreduce(flag, reduce_op=ReduceOp.SUM).wait()
        summed = time.perf_counter()
        group.allreduce([flag], options).wait()  # the same sum, the group called directly
        direct = time.perf_counter()
        committed = manager.should_commit()
        done = time.perf_counter()
        if not committed:
            print(f"error: replica {args.replica}: step {step} did not commit", file=sys.stderr)
            return 1
        if step >= args.warmup:
            for part, seconds in zip((*PARTS, *BESIDE), (quorum - began, summed - quorum, done - direct,
                                                          direct - summed)):
                spent[part].append(seconds * 1e3)
        until = done + args.step_ms / 1e3
        while time.perf_counter() < until:  # the step's compute, on a core
            pass
    print(json.dumps({"replica": args.replica, **{part: round(statistics.median(values), 3)
                                                  for part, values in spent.items()},
                      **{f"{part}_p90": round(sorted(values)[int(0.9 * len(values))], 3)
                         for part, values in spent.items()}}), flush=True)
    return 0


def spin() -> None:
    while True:
        pass


def one_load(args, busy: int, work: Path) -> dict:
    """The lighthouse, the two replicas and `busy` spinning processes; the replicas' lines and the summary."""
    port = free_port()
    lighthouse = subprocess.Popen([sys.executable, "-m", "trainer.cluster.lighthouse", "--port", str(port),
                                   "--min-hosts", "2", "--join-timeout", "30"], stdin=subprocess.DEVNULL)
    spinners = [subprocess.Popen([sys.executable, "-c", "from bench.torchft_step_cost import spin; spin()"])
                for _ in range(busy)]
    replicas = []
    try:
        deadline = time.monotonic() + 30
        while True:  # the lighthouse answers before the replicas ask it
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or lighthouse.poll() is not None:
                    raise SystemExit("error: the lighthouse did not start (python -m trainer.cluster.lighthouse)") from None
                time.sleep(0.2)
        for number in range(2):
            out = (work / f"replica-{busy}-{number}.log").open("w")
            replicas.append(subprocess.Popen(
                [sys.executable, "-m", "bench.torchft_step_cost", "--replica", str(number), "--store-port",
                 str(free_port()), "--lighthouse", f"http://127.0.0.1:{port}", "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--step-ms", str(args.step_ms)],
                stdout=subprocess.PIPE, stderr=out, text=True))
        lines = []
        for proc in replicas:
            stdout, _ = proc.communicate(timeout=args.steps * (args.step_ms / 1e3 + 1.0) + 60)
            if proc.returncode != 0:
                raise SystemExit(f"error: a replica exited {proc.returncode} (its log: {work})")
            lines.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in [*replicas, *spinners, lighthouse]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for line in lines:
        print(json.dumps({"busy": busy, **line}), flush=True)
    medians = {part: round(statistics.median(line[part] for line in lines), 2) for part in (*PARTS, *BESIDE)}
    total = round(sum(medians[part] for part in PARTS), 2)
    from importlib.metadata import version

    return {"torchft": version("torchft"), "busy": busy, "step_ms": args.step_ms, **medians, "total": total,
            "share_of_the_step": round(total / (args.step_ms + total), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.torchft_step_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20, help="first steps left out (the first quorum forms the group)")
    parser.add_argument("--step-ms", type=float, default=150.0, help="the work between two steps' contracts")
    parser.add_argument("--busy", type=int, nargs="+", default=[0], help="spinning processes beside the replicas")
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica is not None:
        return replica(args)
    if args.steps <= args.warmup:
        print(f"error: --steps: {args.steps} is not more than --warmup {args.warmup} (ask for more steps)",
              file=sys.stderr)
        return 2
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        print(f"error: torchft: it does not import here ({err}) (pip install -e . installs it)", file=sys.stderr)
        return 1
    stop_on_sigterm()
    os.environ.setdefault("RUST_LOG", "warn")
    with tempfile.TemporaryDirectory(prefix="torchft-step-cost-") as work:
        for busy in args.busy:
            print(json.dumps({"summary": one_load(args, busy, Path(work))}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
