"""`python -m bench.regroup_prototype`: a home-made in-place regroup beside torchft's, on one schedule.

The question it answers (issue 35): is torchft's Manager, which trainer/engine/inplace.py is built on, measurably
slower to regroup than what this project would write itself? Both run the same replica loop: two replica processes
on this machine (ResNet-18 at 32 px, a global batch of 32 in two shares of 16, the shares of a lost replica trained
by the one left, gradients summed over the replicas each step, SGD), replica 1 SIGKILLed after its step --kill-at and
started again --down-for seconds later. Each prints a time-stamped line per committed step; from them, per event:

- loss: the survivor's gap (its last step before the kill to its first step after), its abandoned step's seconds,
  and the wait for agreement (the membership decided);
- return: the running replica's longest gap while the returning one joined, the joiner's state transfer.

Engines:
  torchft   torchft's Manager and reconfigurable gloo group, a lighthouse (as trainer-launch runs it), the state of a
            host behind sent over the new group (the engine's transport)
  homemade  no torchft: a TCPStore as the coordinator. Each replica bumps a heartbeat counter there every 100 ms. A
            failed all-reduce abandons the step; the survivors post that they are alive, and the first to see every
            other member either posted or silent for --liveness seconds writes the next generation's members with
            compare_set (so there is one answer). A new gloo group per generation under its own key prefix. A
            returning replica asks to join; the first member writes the next generation at the next step's start
            and sends it the state over the new group. No split-brain guard beyond the one store.

    python -m bench.regroup_prototype --rounds 3 --engines torchft homemade
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

from bench.results import RESULTS, describe_machine, now, write_results

SHARES, SHARE_BATCH = 2, 16
STEP_LINE = re.compile(r"^(\d+\.\d+) step (\d+) world (\d+)")


# ---------------------------------------------------------------------------------------------- the replica loop

def model_and_data(seed: int = 0):
    import torch
    import torchvision

    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=10)
    gen = torch.Generator().manual_seed(1)
    return model, torch.randn(4096, 3, 32, 32, generator=gen), torch.randint(0, 10, (4096,), generator=gen)


def train_shares(model, data, labels, step: int, shares: list[int]) -> None:
    """Forward and backward of this replica's shares of step `step` (gradients accumulate)."""
    import torch

    for share in shares:
        first = ((step * SHARES + share) * SHARE_BATCH) % len(labels)
        loss = torch.nn.functional.cross_entropy(model(data[first:first + SHARE_BATCH]),
                                                 labels[first:first + SHARE_BATCH])
        (loss / SHARES).backward()


def flat_grads(model):
    import torch

    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def put_grads(model, flat) -> None:
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def say(line: str) -> None:
    print(f"{time.time():.3f} {line}", flush=True)


def replica_torchft(args) -> None:
    import torch
    from torch.distributed import ReduceOp

    from trainer.engine.inplace import _replica_group, _StateOverGroup
    from torchft import Manager

    model, data, labels = model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    store = torch.distributed.TCPStore("127.0.0.1", args.store_port, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=30)
    group = _replica_group(timeout)
    state_transport = _StateOverGroup(group)
    moved, healed = [0.0], False

    def load(state) -> None:
        nonlocal healed
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        healed, moved[0] = True, state_transport.moved_s
    manager = Manager(pg=group, min_replica_size=1, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timedelta(seconds=10), rank=0, world_size=1,
                      load_state_dict=load,
                      state_dict=lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                      store_addr="127.0.0.1", store_port=args.store_port, lighthouse_addr=args.coordinator,
                      replica_id=f"replica{args.replica}", hostname="127.0.0.1",
                      checkpoint_transport=state_transport)
    while manager.current_step() < args.steps:
        began = time.time()
        group.configured_s = 0.0
        manager.start_quorum()
        quorum_s = time.time() - began
        if manager.current_step() and not getattr(replica_torchft, "said", False) and healed:
            say(f"joined at step {manager.current_step()}: state {moved[0]:.3f}")
            replica_torchft.said = True
        replicas, rank = manager.num_participants(), manager.participating_rank() or 0
        optimizer.zero_grad(set_to_none=False)
        train_shares(model, data, labels, manager.current_step(), list(range(rank, SHARES, replicas)))
        flat = flat_grads(model)
        manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        if manager.should_commit():
            put_grads(model, flat)
            optimizer.step()
            say(f"step {manager.current_step()} world {replicas} quorum {quorum_s:.3f}")
        else:
            say(f"abandoned after {time.time() - began:.3f} quorum {quorum_s:.3f}")
    manager.shutdown(wait=False)
    del store  # the replica group's store lives as long as the replica


class LeaderLost(RuntimeError):
    """The member that decides each step's start went silent."""


class Coordinated:
    """The home-made membership: generations of members in one TCPStore (see the module's docstring)."""

    def __init__(self, name: str, port: int, liveness: float):
        import torch.distributed as dist

        self.dist, self.name, self.liveness = dist, name, liveness
        self.store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        self.beat_store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        self.generation, self.members, self.group = 0, [], None
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while True:
            self.beat_store.add(f"hb/{self.name}", 1)
            time.sleep(0.1)

    def make_group(self):
        import torch.distributed as dist

        prefix = dist.PrefixStore(f"gen{self.generation}", self.store)
        self.group = dist.ProcessGroupGloo(prefix, self.members.index(self.name), len(self.members),
                                           timedelta(seconds=30))

    def join(self) -> bool:
        """At start: the first member founds generation 1; a later one asks and waits; True: it needs the state."""
        if self.store.compare_set("gen/1/members", "", self.name).decode() == self.name:
            self.generation, self.members = 1, [self.name]
            self.make_group()
            return False
        self.store.set(f"want/{int(self.store.add('wants', 1))}", self.name)
        while True:  # the generation that takes this replica in
            newest = int(self.store.add("newest", 0))
            if newest and self.name in self.store.get(f"gen/{newest}/members").decode().split(","):
                self.generation, self.members = newest, self.store.get(f"gen/{newest}/members").decode().split(",")
                self.make_group()
                return True
            time.sleep(0.02)

    def step_start(self, step: int) -> list[str]:
        """Every member meets the first one's decision for this step; the joiners it takes in (to send the state)."""
        key = f"gen/{self.generation}/step/{step}"
        if self.members[0] == self.name:
            waiting = int(self.store.add("wants", 0))
            taken = int(self.store.add("taken", 0))
            decision = "go"
            if waiting > taken:
                joiners = [self.store.get(f"want/{i}").decode() for i in range(taken + 1, waiting + 1)]
                nxt = self.generation + 1
                self.store.set(f"gen/{nxt}/members", ",".join(self.members + joiners))
                self.store.add("taken", len(joiners))
                decision = str(nxt)
                self.store.add("newest", nxt - int(self.store.add("newest", 0)))
            self.store.set(key, decision)
        else:  # the first member decides; a first member gone silent is a lost host like any other
            leader, seen = self.members[0], (int(self.store.add(f"hb/{self.members[0]}", 0)), time.time())
            while not self.store.check([key]):
                count = int(self.store.add(f"hb/{leader}", 0))
                if count != seen[0]:
                    seen = (count, time.time())
                elif time.time() - seen[1] >= self.liveness:
                    raise LeaderLost(leader)
                time.sleep(0.01)
        decision = self.store.get(key).decode()
        if decision == "go":
            return []
        before = set(self.members)
        self.generation = int(decision)
        self.members = self.store.get(f"gen/{self.generation}/members").decode().split(",")
        self.make_group()
        return [m for m in self.members if m not in before]

    def lost(self, gone: tuple[str, ...] = ()) -> float:
        """After a failed all-reduce: agree on who is left (`gone`: members already known silent); the seconds the
        agreement took."""
        began = time.time()
        nxt = self.generation + 1
        self.store.set(f"gen/{nxt}/alive/{self.name}", "1")
        others = [m for m in self.members if m != self.name and m not in gone]
        seen = {m: (int(self.store.add(f"hb/{m}", 0)), time.time()) for m in others}
        alive, gone = [self.name], []
        while others:
            for m in list(others):
                count = int(self.store.add(f"hb/{m}", 0))
                if self.store.check([f"gen/{nxt}/alive/{m}"]):
                    alive.append(m)
                    others.remove(m)
                elif count != seen[m][0]:
                    seen[m] = (count, time.time())
                elif time.time() - seen[m][1] >= self.liveness:
                    gone.append(m)
                    others.remove(m)
            if self.store.check([f"gen/{nxt}/members"]):
                break
            time.sleep(0.02)
        mine = ",".join(sorted(alive, key=self.members.index))
        members = self.store.compare_set(f"gen/{nxt}/members", "", mine).decode()
        self.generation, self.members = nxt, members.split(",")
        self.store.add("newest", nxt - int(self.store.add("newest", 0)))
        self.make_group()
        return time.time() - began


def replica_homemade(args) -> None:
    import torch

    model, data, labels = model_and_data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    me = Coordinated(f"replica{args.replica}-{os.getpid()}", args.coordinator_port, args.liveness)
    step, decided = 0, False
    if me.join():  # the state from the first member over the new group (its step's start is decided)
        began = time.time()
        header = torch.zeros(2, dtype=torch.int64)
        me.group.recv([header], 0, 1).wait()
        payload = torch.empty(int(header[0]), dtype=torch.uint8)
        me.group.recv([payload], 0, 2).wait()
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, decided = int(header[1]), True
        say(f"joined at step {step}: state {time.time() - began:.3f}")
    while step < args.steps:
        began = time.time()
        try:
            joiners, decided = ([] if decided else me.step_start(step)), False
        except LeaderLost as err:
            agreed = me.lost(gone=(str(err),))
            say(f"abandoned after {time.time() - began:.3f} agreement {agreed:.3f}")
            continue
        for joiner in joiners:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
            payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
            me.group.send([torch.tensor([payload.numel(), step])], me.members.index(joiner), 1).wait()
            me.group.send([payload], me.members.index(joiner), 2).wait()
        quorum_s = time.time() - began
        optimizer.zero_grad(set_to_none=False)
        rank, replicas = me.members.index(me.name), len(me.members)
        train_shares(model, data, labels, step, list(range(rank, SHARES, replicas)))
        flat = flat_grads(model)
        try:
            me.group.allreduce([flat]).wait()
        except RuntimeError:
            abandoned = time.time() - began
            agreed = me.lost()
            say(f"abandoned after {abandoned:.3f} agreement {agreed:.3f}")
            continue
        put_grads(model, flat)
        optimizer.step()
        step += 1
        say(f"step {step} world {replicas} quorum {quorum_s:.3f}")


# ---------------------------------------------------------------------------------------------- the orchestra

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def one_round(engine: str, args, work: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    port = free_port()
    if engine == "torchft":
        lighthouse = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
        coordinator = start([lighthouse, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms",
                             "60000", "--heartbeat_timeout_ms", str(int(args.liveness * 1000)), "--bind",
                             f"[::]:{port}"], work / f"{engine}-coordinator.log", env)
        where = [f"--coordinator=http://127.0.0.1:{port}"]
    else:
        coordinator = start([sys.executable, "-c", "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', "
                             f"{port}, is_master=True, wait_for_workers=False); time.sleep(86400)"],
                            work / f"{engine}-coordinator.log", env)
        where = [f"--coordinator-port={port}"]
    time.sleep(1.0)

    def replica(index: int, name: str) -> subprocess.Popen:
        return start([sys.executable, "-m", "bench.regroup_prototype", "--replica", str(index), "--engine", engine,
                      "--steps", str(args.steps), "--store-port", str(free_port()), "--liveness", str(args.liveness),
                      *where], work / f"{engine}-{name}.log", env)

    first, second = replica(0, "r0"), replica(1, "r1")
    log1 = work / f"{engine}-r1.log"
    deadline = time.monotonic() + 600
    while not any(f"step {args.kill_at} " in line for line in log1.read_text().splitlines()):
        if time.monotonic() > deadline or second.poll() is not None:
            raise SystemExit(f"error: replica 1 did not reach step {args.kill_at}: {log1.read_text()[-2000:]}")
        time.sleep(0.02)
    os.killpg(second.pid, signal.SIGKILL)
    killed = time.time()
    second.wait()
    time.sleep(args.down_for)
    back_at = time.time()
    third = replica(1, "r1b")
    for proc in (first, third):
        proc.wait(timeout=900)
    coordinator.kill()
    coordinator.wait()
    return measure(engine, work, killed, back_at)


def steps_of(log: Path) -> list[tuple[float, int, int]]:
    return [(float(m.group(1)), int(m.group(2)), int(m.group(3))) for line in log.read_text().splitlines()
            if (m := STEP_LINE.match(line))]


def measure(engine: str, work: Path, killed: float, back_at: float) -> dict:
    """Lost progress as issue 35 counts it: from the kill until the job logs a step beyond the newest it had logged
    before (by either replica)."""
    survivor = steps_of(work / f"{engine}-r0.log")
    lost = steps_of(work / f"{engine}-r1.log")
    text = (work / f"{engine}-r0.log").read_text().splitlines()
    newest = max(step for t, step, _ in survivor + lost if t <= killed)
    after = min(t for t, step, _ in survivor if step > newest)
    abandoned = [float(line.split("abandoned after ")[1].split()[0]) for line in text if "abandoned after" in line]
    agreement = [float(line.split("agreement ")[1].split()[0]) for line in text if " agreement " in line]
    quorums = [(float(line.split()[0]), float(line.rsplit("quorum ", 1)[1])) for line in text if
               STEP_LINE.match(line)]
    joined = min(t for t, _, world in survivor if t > back_at and world == 2)
    around = [t for t, _, _ in survivor if back_at <= t <= joined]
    gaps = [b - a for a, b in zip(around, around[1:])] or [0.0]
    joiner = (work / f"{engine}-r1b.log").read_text()
    transfer = re.search(r"state (\d+\.\d+)", joiner)
    step_times = [b - a for (a, _, _), (b, _, _) in zip(survivor, survivor[1:])]
    loss_quorum = next((q for t, q in quorums if t >= after), None)  # the quorum of the first step beyond
    return {"engine": engine, "loss_gap_s": after - killed, "abandoned_step_s": abandoned[0] if abandoned else 0.0,
            "loss_agreement_s": agreement[0] if agreement else loss_quorum,
            "return_gap_s": max(gaps), "joiner_state_s": float(transfer.group(1)) if transfer else None,
            "median_step_s": statistics.median(step_times)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.regroup_prototype", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", choices=("torchft", "homemade"), default=["torchft", "homemade"])
    parser.add_argument("--rounds", type=int, default=3, help="each engine this many times, interleaved")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-at", type=int, default=60)
    parser.add_argument("--down-for", type=float, default=5.0)
    parser.add_argument("--liveness", type=float, default=2.0, help="seconds of silence before a replica is gone "
                        "(torchft: the lighthouse's --heartbeat_timeout_ms)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica is not None:
        (replica_torchft if args.engine == "torchft" else replica_homemade)(args)
        return 0
    from trainer.cli.scale import busy_cpu_seconds, own_children_cpu_seconds

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="regroup-"))
    runs = []
    for round_ in range(1, args.rounds + 1):
        for engine in args.engines:
            busy, own, began = busy_cpu_seconds(), own_children_cpu_seconds(), time.monotonic()
            result = one_round(engine, args, work)
            others = (busy_cpu_seconds() - busy - (own_children_cpu_seconds() - own)) / (time.monotonic() - began)
            runs.append({**result, "round": round_, "other_cores_busy": max(0.0, others)})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    keys = ("loss_gap_s", "abandoned_step_s", "loss_agreement_s", "return_gap_s", "joiner_state_s", "median_step_s",
            "other_cores_busy")

    def median(engine: str, key: str) -> str:
        values = [r[key] for r in runs if r["engine"] == engine and r[key] is not None]
        return f"{statistics.median(values):.2f}" if values else "-"
    header = {"command": " ".join(["python", "-m", "bench.regroup_prototype", *argv]), "date": now(),
              "machine": describe_machine()}
    table = (f"`{header['command']}`  \n{header['date']}, {header['machine']}\n\n"
             "| engine | lost: survivor's gap s | abandoned step s | agreement s | returned: running one's longest "
             "gap s | joiner's state transfer s | median step s | other work (cores) |\n|---|---|---|---|---|---|---|---|\n"
             + "\n".join(f"| {engine} | " + " | ".join(median(engine, k) for k in keys) + " |" for engine in args.engines)
             + f"\n\n(medians of {args.rounds} rounds each, interleaved)\n")
    write_results(args.out, "regroup-prototype", header, runs, {}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
