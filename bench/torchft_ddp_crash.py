"""`python -m bench.torchft_ddp_crash`: does torchft's own DistributedDataParallel survive a peer's loss?

trainer/engine/inplace.py sums the gradients over the hosts by hand, after the backward, over torchft's managed
process group, instead of wrapping the model in torchft.ddp.DistributedDataParallel (whose comm hook would overlap
the sum with the backward). The reason: with torchft 0.2.0 (torch 2.14, gloo) the wrapper's comm hook failed an
assertion in the survivor when a peer was lost mid-sum (ManagedWork.wait() catches the gloo error, reports it to
the Manager, and leaves the work's future unset; the hook then asserts on it). This probe is the minimal
reproduction, to be run again when torchft is upgraded (upstream's meta-pytorch/torchft#287 handles an exception in
a work's wait, after 0.2.0): if the survivor goes on, the wrapper may replace the hand-made sum.

What it runs, on this machine, all on the CPU (nothing of this project's engine; the lighthouse is torchft's Rust
server, started as trainer-launch starts it):
  - a torchft lighthouse (`python -m trainer.cluster.lighthouse`: torchft's LighthouseServer with a quorum tick of
    100 ms and a heartbeat timeout of 2 s, the same as `torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
    --heartbeat_timeout_ms 2000`);
  - two replica groups of one process each, training a small MLP as torchft's train_ddp example trains its model:
    torchft's Manager, its reconfigurable ProcessGroupGloo, torchft.ddp.DistributedDataParallel and
    torchft.optim.OptimizerWrapper (zero_grad() starts the quorum, step() commits only if should_commit());
  - replica 1, once both train together (a quorum of two) at step --kill-at or later, stops after its forward pass
    and says so; the probe SIGKILLs it --hold seconds later, while replica 0, the survivor, waits in the wrapper's
    comm hook for the sum (the place a lost peer is met most often in a real job, whose steps are mostly backward
    and sum).

It then watches the survivor for up to --after-s seconds: its exit status (or signal) and stderr's last lines if it
ended, or the steps it committed after the loss. One verdict line, and exit 0 whichever it is (a probe, not a test):

    torchft 0.2.0: the survivor crashed at the peer's loss (exit 1, ...): AssertionError in torchft/ddp.py:76 ...
    torchft 0.X.Y: the survivor went on, 5 steps after the peer's loss (...): the wrapper may replace the hand-made sum
    torchft 0.X.Y: the survivor neither crashed nor went on: 0 steps in 30 s after the peer's loss (...)

Exit 1 (`error: ...`) only when the probe could not run (torchft missing, a replica that never trained with the
other, the lighthouse silent). --keep DIR keeps the processes' logs there.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

STEP = re.compile(r"^(?P<at>\d+\.\d+) step (?P<step>\d+) participants (?P<participants>\d+)$")
ABANDONED = re.compile(r"^(?P<at>\d+\.\d+) abandoned step \d+$")
HELD = "held after the forward pass"
IN = 16  # the MLP's input width; its classes: 4


# ------------------------------------------------------------------------------------------------- a replica

def say(line: str) -> None:
    print(f"{time.time():.3f} {line}", flush=True)


def replica(args) -> int:
    """One replica group of one process, as torchft's train_ddp example: Manager, ProcessGroupGloo, the DDP wrapper,
    the optimizer wrapper. Prints a line per committed step; replica 1 holds still at --kill-at (see the module)."""
    import torch
    from torch import nn

    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    # torchft's Manager needs a store for its replica group (torchrun's, in a real job): this group's own
    _store = torch.distributed.TCPStore("127.0.0.1", args.store_port, is_master=True, wait_for_workers=False)
    # The collective timeout exceeds --hold: the survivor must meet the peer's death, not a timeout of its own.
    timeout = timedelta(seconds=30)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       optimizer.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timedelta(seconds=30), rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=args.store_port, lighthouse_addr=args.lighthouse,
        replica_id=f"probe_{args.replica}", hostname="127.0.0.1")
    ddp = DistributedDataParallel(manager, model)
    optim = OptimizerWrapper(manager, optimizer)
    data = torch.Generator().manual_seed(1 + args.replica)
    while True:  # until the probe ends it (the survivor) or kills it (replica 1)
        inputs, labels = torch.randn(32, IN, generator=data), torch.randint(0, 4, (32,), generator=data)
        optim.zero_grad()  # the quorum (async: it completes during the forward)
        loss = nn.functional.cross_entropy(ddp(inputs), labels)
        if args.replica == 1 and manager.current_step() >= args.kill_at and manager.num_participants() == 2:
            say(HELD)  # the survivor goes on into its backward and waits in the comm hook for this replica's part
            time.sleep(3600)
        loss.backward()  # the wrapper's comm hook sums each bucket over the replica groups
        began = manager.current_step()
        optim.step()  # commits only if every part of the step succeeded (should_commit): the step count goes up
        if manager.current_step() > began:
            say(f"step {manager.current_step()} participants {manager.num_participants()}")
        else:
            say(f"abandoned step {began + 1}")
        time.sleep(args.pause)


# ------------------------------------------------------------------------------------------------- the probe

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def steps(log: Path) -> list[tuple[float, int, int]]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [(float(m["at"]), int(m["step"]), int(m["participants"])) for line in lines if (m := STEP.match(line))]


def tail(log: Path, lines: int) -> list[str]:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line for line in text if line.strip()][-lines:]


def ended(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')
CAUGHT = "got exception waiting for work "  # torchft 0.2.0's ManagedWork.wait() logs the error it catches so


def cause(stderr: list[str]) -> str:
    """The survivor's error in one line, from its stderr: the exception (with the frame that raised it, where it has
    no message of its own, as a bare assert) and the error torchft caught before it, if it logged one."""
    lines = [line.rstrip() for line in stderr if line.strip()]
    named = [i for i, line in enumerate(lines) if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    if not named:
        return (lines or ["(nothing on stderr)"])[-1].strip()[:300]
    at = named[-1]
    said = lines[at].strip()
    frames = [i for i in range(at) if FRAME.match(lines[i])]
    if frames and ":" not in said:  # a bare AssertionError: where, and the assert's own text
        frame = FRAME.match(lines[frames[-1]])
        path = frame["path"]
        path = path[path.index("torchft/"):] if "torchft/" in path else Path(path).name
        code = lines[frames[-1] + 1].strip() if frames[-1] + 1 < at else ""
        said += f" in {path}:{frame['line']} {frame['function']}" + (f" ({code})" if code else "")
    caught = [line.split(CAUGHT, 1)[1] for line in lines[:at] if CAUGHT in line]
    if caught:
        # gloo's message starts with its source file in brackets: the words after it
        words = re.sub(r"^\[[^]]*\] ", "", caught[-1]).split(". ")[0]
        said += f", after torchft caught: {words[:160]}"
    return said[:400]


def probe(args, work: Path) -> tuple[str, int]:
    """Runs the lighthouse and the two replicas in `work`; (the verdict line, the exit status)."""
    from trainer.cluster.lighthouse import _die_with_parent, answers, torchft_version

    version = torchft_version()
    if version is None:
        return "error: torchft is not installed in this Python (pip install torchft)", 1
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
    started: list[subprocess.Popen] = []

    def start(command: list[str], name: str) -> subprocess.Popen:
        with open(work / f"{name}.out", "w") as out, open(work / f"{name}.err", "w") as err:
            # Each in a session of its own (a SIGKILL of replica 1 reaches all of it), ended with the probe's process
            proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, preexec_fn=_die_with_parent)
        started.append(proc)
        return proc

    try:
        port = free_port()
        lighthouse = start([sys.executable, "-m", "trainer.cluster.lighthouse", "--port", str(port), "--min-hosts",
                            "1", "--join-timeout", "60"], "lighthouse")
        deadline = time.monotonic() + args.start_s
        while answers("127.0.0.1", port) is not None:
            if lighthouse.poll() is not None or time.monotonic() > deadline:
                return (f"error: the lighthouse did not answer at 127.0.0.1:{port} "
                        f"({cause(tail(work / 'lighthouse.err', 20))})"), 1
            time.sleep(0.1)

        def one(index: int) -> subprocess.Popen:
            return start([sys.executable, "-m", "bench.torchft_ddp_crash", "--replica", str(index), "--lighthouse",
                          f"http://127.0.0.1:{port}", "--store-port", str(free_port()), "--kill-at",
                          str(args.kill_at), "--pause", str(args.pause)], f"replica{index}")

        survivor, victim = one(0), one(1)
        survivor_out, victim_out = work / "replica0.out", work / "replica1.out"
        while HELD not in (victim_out.read_text(errors="replace") if victim_out.exists() else ""):
            for index, proc in enumerate((survivor, victim)):
                if proc.poll() is not None:
                    why = cause(tail(work / f"replica{index}.err", 20))
                    return (f"error: replica {index} ended ({ended(proc.returncode)}) before the two trained together to step "
                            f"{args.kill_at}: {why}"), 1
            if time.monotonic() > deadline:
                return (f"error: the replicas did not train together to step {args.kill_at} in {args.start_s:g} s "
                        f"(replica 0's last step: {(steps(survivor_out) or [(0, 'none', 0)])[-1][1]}, replica 1's: "
                        f"{(steps(victim_out) or [(0, 'none', 0)])[-1][1]}; --start-s gives them longer)"), 1
            time.sleep(0.05)
        time.sleep(args.hold)
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.time()
        victim.wait()
        before = [step for at, step, _ in steps(survivor_out) if at <= killed]
        last = before[-1] if before else 0
        watch_until = time.monotonic() + args.after_s
        while time.monotonic() < watch_until and survivor.poll() is None:
            if len([1 for at, _, _ in steps(survivor_out) if at > killed]) >= args.steps_after:
                break
            time.sleep(0.1)
        after = [(step, participants) for at, step, participants in steps(survivor_out) if at > killed]
        committed = f"{len(after)} step{'s' * (len(after) != 1)}"
        abandoned = sum(1 for line in survivor_out.read_text(errors="replace").splitlines()
                        if (m := ABANDONED.match(line)) and float(m["at"]) > killed)
        if survivor.poll() is not None and survivor.returncode != 0:
            return (f"torchft {version}: the survivor crashed at the peer's loss ({ended(survivor.returncode)}, "
                    f"{committed} after it; its last before it: {last}): {cause(tail(work / 'replica0.err', 60))}"), 0
        if len(after) >= args.steps_after:
            return (f"torchft {version}: the survivor went on, {committed} after the peer's loss (steps "
                    f"{after[0][0]}-{after[-1][0]}, {after[-1][1]} participant(s); {abandoned} abandoned at the loss): "
                    "the wrapper may replace the hand-made sum"), 0
        state = "still running: it hangs" if survivor.poll() is None else ended(survivor.returncode)
        return (f"torchft {version}: the survivor neither crashed nor went on: {committed} in {args.after_s:g} s "
                f"after the peer's loss (its last before it: {last}), {state}"), 0
    finally:
        for proc in started:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from trainer.core.errors import OneLineErrorParser, UsageError

    parser = OneLineErrorParser(prog="python -m bench.torchft_ddp_crash", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--kill-at", type=int, default=3, help="replica 1 holds still (and is SIGKILLed) at the first "
                        "step at or after this one that both replicas train (default 3)")
    parser.add_argument("--hold", type=float, default=1.0, help="seconds between replica 1 holding still and its "
                        "SIGKILL: the survivor's time to reach the comm hook (default 1)")
    parser.add_argument("--steps-after", type=int, default=5, help="the survivor's steps after the loss that count as "
                        "going on (default 5)")
    parser.add_argument("--after-s", type=float, default=30.0, help="seconds to watch the survivor after the loss "
                        "(default 30; torchft's lighthouse drops the lost peer after 2 s)")
    parser.add_argument("--start-s", type=float, default=120.0, help="seconds for the lighthouse and the replicas to "
                        "start and train together to --kill-at (default 120)")
    parser.add_argument("--pause", type=float, default=0.05, help="seconds each replica sleeps between its steps "
                        "(default 0.05)")
    parser.add_argument("--keep", metavar="DIR", help="keep the processes' logs in DIR (default: a temporary folder, "
                        "removed)")
    # a replica's own flags (the probe starts them)
    parser.add_argument("--replica", type=int, choices=(0, 1), help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("kill_at", "steps_after"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}", f"{getattr(args, name)} is not a step", "1 or more")
    for name in ("hold", "after_s", "start_s", "pause"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')}", f"{getattr(args, name):g} is not seconds", "0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    from trainer.core.errors import exit_on_usage_error

    with exit_on_usage_error():
        args = parse_args(argv)
    if args.replica is not None:
        return replica(args)
    if args.keep:
        work = Path(args.keep)
        work.mkdir(parents=True, exist_ok=True)
        line, code = probe(args, work)
    else:
        with tempfile.TemporaryDirectory(prefix="torchft-ddp-crash-") as folder:
            line, code = probe(args, Path(folder))
    print(line, file=sys.stderr if code else sys.stdout, flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
