"""`python -m bench.goodput`: how much of a two-host job's time trains when one host keeps getting lost.

Two local launcher "hosts" of one process each (the same machine, one shared checkpoint directory, as hosts
share a network file system) train ResNet-18 on synthetic data for --steps steps. Every --fault-every seconds
of training the second host is lost (SIGKILL to its launcher's whole process group) and comes back
--down-for seconds later with the same settings. Goodput = the fault-free wall time for the same steps / the
faulted wall time. Each fault's cost is split from the first host's log, which the bench time-stamps line by
line: detection (kill -> the restart line, or torch's agent stopping the workers), restart (-> the checkpoint it resumes from is named), load and
first step (-> the first step at the new size), and the steps recomputed since that checkpoint.

Modes, the same schedule each:
  inplace   trainer-launch with NNODES=1:2, in-place recovery (RECOVERY's default): the processes stay, the survivor
            goes on at world size 1 after the quorum drops the lost host, the returning one gets the state from it
  elastic   trainer-launch with NNODES=1:2 and RECOVERY=restart (c10d; the survivors restart at world size 1)
  static    trainer-launch with NNODES=2 and MAX_RESTARTS=10 (the survivor restarts and waits for the host)
  torchrun  plain `torchrun --nnodes 1:2 --rdzv-backend c10d` running the built-in trainer (no launcher)

In place, each loss is split from the survivor's own lines: detection (kill -> its abandoned step, or its next
generation when it was between steps), agreement (the quorum's wait: the lighthouse drops the lost host once its
heartbeats lapse), regroup (the new process group across the hosts), state transfer (none for a loss) and the abandoned
step's seconds; each return into the running host's pause (its longest gap between steps as the host joined) with
the same split, the state transfer being the running host's send. Lost progress is the issue's measure: from the
kill until the job logs a step beyond the newest it had logged before. Every run records the cores other work kept
busy meanwhile (this machine is shared): numbers beside a busy machine are worth repeating on a quiet one.

    python -m bench.goodput --steps 600 --fault-every 60 --down-for 20 --modes inplace elastic static torchrun
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.results import RESULTS, describe_machine, now, write_results

MODES = ("inplace", "elastic", "static", "torchrun")
RESUMED = re.compile(r"resuming from .*step-(\d+)\.pt \(step (\d+)")
STEP = re.compile(r"epoch \d+ step (\d+)/")
WORLD = re.compile(r"training .* world size (\d+)")
ABANDONED = re.compile(r"in place: step (\d+) abandoned after ([\d.]+) s")
REPLICA_GROUP = re.compile(r"in place: the replica group across the hosts is (\S+)")
END_GRACE_S = 60.0  # the hosts still running when the first ends: this long to end on their own
# In place, the first host's line of where a step's time went (inplace.StepTiming), every 100 steps and at the end.
SPLIT = re.compile(r"in place: per step over (\d+) steps \(ms\): (.*), wall ([\d.]+); (\d+) of (\d+) buckets")
GENERATION = re.compile(r"in place: generation (\d+), world size (\d+) .* the quorum took ([\d.]+) s \(agreement "
                        r"([\d.]+) s, new group ([\d.]+) s, state ([\d.]+) s")


class Host:
    """One launcher host: its process group, its output lines with the bench's clock."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path):
        self.lines: list[tuple[float, str]] = []
        self.killed_at = float("inf")
        self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def kill(self) -> None:
        self.killed_at = time.monotonic()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def stop_on_sigterm() -> None:
    """SIGTERM (a `kill`, a CI runner's timeout) stops the bench as Ctrl-C does: its hosts run in their own
    sessions (a loss is a SIGKILL to one host's group), so nothing else would stop them with it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_command(mode: str, args, work: Path) -> list[str]:
    train = ["--model", args.model, "--synthetic-size", str(args.steps * args.batch_size * 2), "--synthetic-image-size",
             str(args.image_size), "--image-size", str(args.image_size),  # the batch: TRAIN_GLOBAL_BATCH_SIZE
             "--epochs", "1", "--checkpoint-every", str(args.checkpoint_every), "--log-every", "1",
             "--warmup-steps", "5", *(["--lr", str(args.lr)] if args.lr else []), "--checkpoint-dir", str(work / "checkpoints"), "--log-dir", str(work / "runs")]
    if mode == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",  # torchrun
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{args.port}", "--rdzv-id=bench", "--max-restarts=10",
                "--rdzv-conf=last_call_timeout=5", "-m", "trainer", *train]
    return [sys.executable, "-m", "trainer.cli.launch", *train]


def host_env(mode: str, args, node: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "NNODES", "NODE_RANK", "MASTER_"))}
    env.update(PREFLIGHT="0", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
               OMP_NUM_THREADS=str(args.threads), TRAIN_GLOBAL_BATCH_SIZE=str(args.batch_size * 2),
               # Two hosts on one machine share its GPU 0: NCCL refuses two ranks of one GPU on one host, and
               # NCCL_HOSTID makes them two hosts to it (over its sockets), as torchft's own train_ddp.py does.
               NCCL_HOSTID=f"bench-goodput-host-{node}")
    if mode in ("elastic", "inplace"):
        env["NNODES"] = "1:2"
        env["RECOVERY"] = "restart" if mode == "elastic" else "in-place"
    elif mode == "static":
        env.update(NNODES="2", NODE_RANK=str(node), MAX_RESTARTS="10")
    return env


def _drive(mode: str, args, faults: bool, work: Path, hosts: list[Host]) -> tuple:
    """one_run's hosts started (each into `hosts` as it starts), lost and started again, and waited for."""
    first = Host(host_command(mode, args, work), host_env(mode, args, 0), work)
    hosts.append(first)
    time.sleep(2)  # the first host hosts the rendezvous store
    second = Host(host_command(mode, args, work), host_env(mode, args, 1), work)
    hosts.append(second)
    began = time.monotonic()
    kills, returns = [], []
    trained_since = None
    deadline = began + (args.timeout or 1800.0)
    while first.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
        if not faults:
            continue
        steps = [int(m.group(1)) for host in hosts for _, line in host.lines[-5:] if (m := STEP.search(line))]
        if steps and max(steps) >= args.steps:  # trained: a loss now would hit the job's exit, not its training
            continue
        if trained_since is None and steps:
            trained_since = time.monotonic()
        if second.proc.poll() is None and trained_since and time.monotonic() - trained_since >= args.fault_every \
                and (not args.faults or len(kills) < args.faults):
            second.kill()
            kills.append(time.monotonic())
        elif second.proc.poll() is not None and kills and time.monotonic() - kills[-1] >= args.down_for \
                and len(returns) < len(kills):
            second = Host(host_command(mode, args, work), host_env(mode, args, 1), work)
            hosts.append(second)
            returns.append(time.monotonic())
            trained_since = None
    ended = time.monotonic()
    hung = first.proc.poll() is None
    for host in hosts:  # the others end with the first (an in-place job's hosts confirm its end together)
        if not hung and host.killed_at == float("inf"):
            try:
                host.proc.wait(timeout=max(1.0, END_GRACE_S - (time.monotonic() - ended)))
            except subprocess.TimeoutExpired:
                pass
    # Each host that was not lost on purpose: its exit code (None: still running, killed now).
    codes = [host.proc.poll() for host in hosts if host.killed_at == float("inf")]
    for host in hosts:
        host.kill() if host.proc.poll() is None else None
    return began, ended, hung, kills, returns, codes


def one_run(mode: str, args, faults: bool) -> dict:
    from trainer.cli.scale import busy_cpu_seconds, own_children_cpu_seconds

    busy, own, began_all = busy_cpu_seconds(), own_children_cpu_seconds(), time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"goodput-{mode}-"))
    args.port = free_port()
    hosts: list[Host] = []
    try:
        began, ended, hung, kills, returns, codes = _drive(mode, args, faults, work, hosts)
    except BaseException:  # the bench stopped (Ctrl-C, SIGTERM: see stop_on_sigterm): its hosts stop with it
        for host in hosts:
            host.kill() if host.proc.poll() is None else None
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        raise
    first = hosts[0]
    summary = {}
    try:
        summary = json.loads((work / "runs" / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    # A killed host's pipe still holds lines it wrote before the kill: read afterwards, they would count as progress
    # after it (stamped when read). Nothing a killed host says after its kill is progress.
    lines = sorted(line for host in hosts for line in host.lines if line[0] < host.killed_at)
    split = split_inplace(first.lines, lines, kills, returns, began) if mode == "inplace" else \
        split_faults(lines, kills, returns, began)
    others = (busy_cpu_seconds() - busy - (own_children_cpu_seconds() - own)) / (time.monotonic() - began_all)
    result = {"mode": mode, "faults": faults, "wall_s": ended - began, "hung": hung, "code": first.proc.returncode,
              "global_step": summary.get("global_step"), "status": summary.get("status"),
              "samples_per_s": summary.get("samples_per_second"),
              # The writing rank's own split of a step (trainer.observe.steptiming; mean ms over its steps)
              "split_ms": {k: v for k, v in (summary.get("ranks") or [{}])[0].items() if k.endswith("_ms")},
              "kills": len(kills), "returns": len(returns), "per_fault": split, "codes": codes,
              "other_cores_busy": round(max(0.0, others), 2)}
    group = next((m.group(1) for _, line in first.lines if (m := REPLICA_GROUP.search(line))), None)
    if group is not None:
        result["replica_group"] = group
    if mode == "inplace":  # each host's: the host that waits for the other's checkpoint write has it in its quorum
        result["step_split_ms"] = [step_split(host.lines) for host in hosts]
    if hung or summary.get("global_step") != args.steps:
        result["tail"] = [line for _, line in first.lines[-15:]]
    if args.keep:  # each host's lines with the bench's clock, beside the run's checkpoints and logs
        for number, host in enumerate(hosts):
            (work / f"host-{number}.log").write_text("".join(f"{t - began:9.2f} {line}\n" for t, line in host.lines))
        result["kept"] = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return result


def step_split(lines: list[tuple[float, str]]) -> dict:
    """The mean of a step's parts (ms) over the in-place host's lines of them, weighted by their steps; with how many
    of the sum's buckets were launched during the backward (the rest at the commit)."""
    total: dict[str, float] = {}
    steps = early = buckets = 0
    for _, line in lines:
        found = SPLIT.search(line)
        if not found:
            continue
        count = int(found.group(1))
        steps, early, buckets = steps + count, early + int(found.group(4)), buckets + int(found.group(5))
        for part in [*found.group(2).split(", "), f"wall {found.group(3)}"]:
            name, value = part.rsplit(" ", 1)
            total[name] = total.get(name, 0.0) + float(value) * count
    split = {name: round(value / steps, 1) for name, value in total.items()} if steps else {}
    return {**split, "steps": steps, "buckets_launched_in_the_backward": f"{early} of {buckets}"} if steps else {}


def split_faults(lines: list[tuple[float, str]], kills: list[float], returns: list[float], began: float) -> list[dict]:
    """Each loss's cost from the first host's time-stamped log."""
    out = []
    for k, killed in enumerate(kills):
        after = [(t, line) for t, line in lines if t >= killed]
        lost = lost_progress(lines, killed)
        pause = return_pause(lines, returns[k]) if k < len(returns) else None
        detected = next((t for t, line in after if line.startswith("restart ") or "exited with" in line or
                         "closing signal" in line), None)  # the last: torch's agent stopping the workers (torchrun)
        resumed = next(((t, line) for t, line in after if RESUMED.search(line)), None)
        stepped = next((t for t, line in after if resumed and t > resumed[0] and STEP.search(line)), None)
        last_step = max((int(STEP.search(line).group(1)) for t, line in lines if t < killed and STEP.search(line)),
                        default=0)
        back_at = int(RESUMED.search(resumed[1]).group(2)) if resumed else None
        out.append({"at_s": round(killed - began, 1),
                    "detect_s": round(detected - killed, 1) if detected else None,
                    "restart_s": round(resumed[0] - detected, 1) if resumed and detected else None,
                    "load_and_first_step_s": round(stepped - resumed[0], 1) if stepped and resumed else None,
                    "recomputed_steps": last_step - back_at if back_at is not None else None,
                    "host_back_after_s": round(returns[k] - killed, 1) if k < len(returns) else None,
                    "lost_progress_s": lost, "return_pause_s": pause})
    return out


def split_inplace(survivor: list[tuple[float, str]], lines: list[tuple[float, str]], kills: list[float],
                  returns: list[float], began: float) -> list[dict]:
    """Each loss and return of an in-place run, from the survivor's (the first host's) time-stamped lines."""
    out = []
    for k, killed in enumerate(kills):
        after = [(t, line) for t, line in survivor if t >= killed]
        abandoned = next(((t, float(m.group(2))) for t, line in after if (m := ABANDONED.search(line))), None)
        regroup = next(((t, m) for t, line in after if (m := GENERATION.search(line)) and m.group(2) == "1"), None)
        seen = min((t for t, _ in filter(None, (abandoned, regroup))), default=None)
        event = {"at_s": round(killed - began, 1), "lost_progress_s": lost_progress(lines, killed, seen),
                 "detect_s": round(seen - killed, 2) if seen is not None else None,
                 "abandoned_step_s": abandoned[1] if abandoned else 0.0}
        if regroup is not None:
            _, m = regroup
            event.update(agreement_s=float(m.group(4)), regroup_s=float(m.group(5)), state_s=float(m.group(6)))
        if k < len(returns):
            event.update(split_return(survivor, returns[k]), return_pause_s=return_pause(lines, returns[k]))
        out.append(event)
    return out


def split_return(survivor: list[tuple[float, str]], back: float) -> dict:
    """The running host's pause while the returning one joined, and its quorum's split (the state: its send)."""
    joined = next(((t, m) for t, line in survivor if t >= back and (m := GENERATION.search(line)) and
                   m.group(2) == "2"), None)
    if joined is None:
        return {"host_back_after_s": None}
    at, m = joined
    return {"return_agreement_s": float(m.group(4)), "return_regroup_s": float(m.group(5)),
            "return_state_s": float(m.group(6)), "host_back_after_s": round(at - back, 1)}


def progress_times(lines: list[tuple[float, str]]) -> list[tuple[float, int]]:
    """(time, step) of every step line that goes beyond every step logged before it, by any host."""
    out, newest = [], 0
    for t, line in lines:
        m = STEP.search(line)
        if m and int(m.group(1)) > newest:
            newest = int(m.group(1))
            out.append((t, newest))
    return out


def lost_progress(lines: list[tuple[float, str]], killed: float, seen: float | None = None) -> float | None:
    """The issue's measure: from the kill until the job logs a step beyond the newest it had logged before. seen:
    when the survivor saw the loss (in place: its abandoned step, or its new group), where the bench knows it: the
    step counted is one after it. A step line the survivor wrote as the host died (a step whose sums were done) is
    read a few ms after the kill, and once made the loss cost 0.0 s (CI, tests/test_bench.py)."""
    after = next((t for t, _ in progress_times(lines) if t > max(killed, seen or killed)), None)
    return round(after - killed, 2) if after is not None else None


def return_pause(lines: list[tuple[float, str]], back: float, horizon: float = 90.0) -> float | None:
    """The hosts already training, at a return: their longest time without a new step, from the return until the
    first new step after the job trains at world size 2 again (within `horizon` seconds)."""
    joined = next((t for t, line in lines if back <= t <= back + horizon and
                   ((m := GENERATION.search(line)) and m.group(2) == "2" or (m := WORLD.search(line)) and
                    m.group(1) == "2")), None)
    if joined is None:
        return None
    times = [t for t, _ in progress_times(lines)]
    first_after = next((t for t in times if t > joined), None)
    if first_after is None:
        return None
    window = [t for t in times if t <= back][-1:] + [t for t in times if back < t <= first_after]
    return round(max(b - a for a, b in zip(window, window[1:])), 2) if len(window) > 1 else None


def one_loss_and_return(args) -> int:
    """--one: an in-place run of two hosts, the second lost once (SIGKILL) and started again; what it cost into
    args.one: the lost progress at the loss, the running host's pause at the return, whether both hosts ended with
    exit 0, and the replica group the hosts named (torchft-baby-nccl on GPUs, torchft-gloo on CPUs)."""
    args.faults, args.timeout = 1, args.timeout or 600.0
    run = one_run("inplace", args, faults=True)
    event = run["per_fault"][0] if run["per_fault"] else {}
    facts = {"replica_group": run.get("replica_group"), "steps": args.steps, "global_step": run["global_step"],
             "lost_and_returned": run["kills"] == run["returns"] == 1,
             "lost_progress_s": event.get("lost_progress_s"), "return_pause_s": event.get("return_pause_s"),
             "returned_joined_after_s": event.get("host_back_after_s"), "both_exit_0": run["codes"] == [0, 0],
             "exit_codes": run["codes"], "hung": run["hung"], "wall_s": round(run["wall_s"], 1), "run": run}
    args.one.parent.mkdir(parents=True, exist_ok=True)
    args.one.write_text(json.dumps(facts, indent=1) + "\n")
    print(json.dumps({k: v for k, v in facts.items() if k != "run"}), flush=True)
    return 0 if facts["both_exit_0"] and facts["lost_and_returned"] else 1


def median(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.goodput", description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of the job (global batch 2 x batch)")
    parser.add_argument("--fault-every", type=float, default=120.0, help="seconds of training between losses")
    parser.add_argument("--down-for", type=float, default=30.0, help="seconds a lost host stays away")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per process at world size 2")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.0, help="the trainer's --lr (0: its default; a VGG without "
                        "BatchNorm diverges at the default 0.1)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="seconds before a run is called hung (0: three times the fault-free run, at least 300)")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory and its hosts' lines")
    parser.add_argument("--faults", type=int, default=0, help="at most this many losses in a run (0: no limit)")
    parser.add_argument("--one", type=Path, metavar="RESULT.json",
                        help="one in-place run, one loss and one return, no fault-free runs: its facts into "
                        "RESULT.json (bench.quick's inplace-nccl part)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    stop_on_sigterm()
    if args.one is not None:
        return one_loss_and_return(args)
    args.out.mkdir(parents=True, exist_ok=True)
    # The fault-free runs: the restart path's (every mode's goodput is against it), and in place's own (its step
    # carries the quorum and the sum over the hosts).
    baselines = {}
    for mode in ("elastic", "inplace"):
        if mode == "elastic" or mode in args.modes:
            baselines[mode] = one_run(mode, args, faults=False)
            print(json.dumps(baselines[mode]), file=sys.stderr, flush=True)
    for mode, baseline in baselines.items():
        if baseline["global_step"] != args.steps:
            print(f"error: the fault-free {mode} run did not finish: {json.dumps(baseline)[:2000]}", file=sys.stderr)
            return 1
    reference = baselines["elastic"]["wall_s"]
    args.timeout = args.timeout or max(300.0, 3 * reference)
    runs = list(baselines.values())
    for mode in args.modes:  # each run on stderr as it ends: a long series is not lost to a later failure
        runs.append(one_run(mode, args, faults=True))
        print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    rows, splits = [], []
    for run in runs[len(baselines):]:
        done = run["global_step"] == args.steps and not run["hung"]
        run["goodput"] = round(reference / run["wall_s"], 3) if done else 0.0
        own = baselines.get(run["mode"], {}).get("wall_s")
        costs = run["per_fault"]
        ended = "%.2f" % run["goodput"] if done else "did not finish: " + ("hung" if run["hung"] else
                                                                          "exit %s" % run["code"])
        rows.append(f"| {run['mode']} | {run['kills']} | {run['wall_s']:.0f} s | {ended} | "
                    f"{'%.2f' % (own / run['wall_s']) if done and own else '-'} | "
                    f"{median([c.get('lost_progress_s') for c in costs])} | "
                    f"{median([c.get('return_pause_s') for c in costs])} | {run['other_cores_busy']} |")
        if run["mode"] == "inplace":
            splits.append("| in place | " + " | ".join(str(median([c.get(k) for c in costs])) for k in (
                "detect_s", "agreement_s", "regroup_s", "state_s", "abandoned_step_s", "return_agreement_s",
                "return_regroup_s", "return_state_s")) + " |")
        else:
            splits.append(f"| {run['mode']} | " + " | ".join(str(median([c.get(k) for c in costs])) for k in (
                "detect_s", "restart_s", "load_and_first_step_s", "recomputed_steps")) + " | | | | |")
    header = {"command": " ".join(["python", "-m", "bench.goodput", *argv]), "date": now(), "machine": describe_machine()}
    free = ", ".join(f"{mode} {b['wall_s']:.0f} s (other work {b['other_cores_busy']} cores)"
                     for mode, b in baselines.items())
    table = (f"`{header['command']}`  \n{header['date']}, {header['machine']}\n\n"
             f"fault-free, {args.steps} steps: {free}\n\n"
             "| mode | losses | wall | goodput (vs the restart path's fault-free) | goodput (vs its own) | lost "
             "progress per loss s | pause at a return s | other work (cores) |\n|---|---|---|---|---|---|---|---|\n"
             + "\n".join(rows) + "\n\nPer event (medians): in place: detection, agreement, regroup, state transfer, "
             "abandoned step; at a return: agreement, regroup, state sent. Restart: detection, restart, load + first "
             "step, recomputed steps.\n\n| mode | detect s | agreement / restart s | regroup / load + first step s | "
             "state s / recomputed | abandoned step s | return: agreement s | regroup s | state s |\n"
             "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(splits) + "\n")
    write_results(args.out, "goodput", header, runs, {"baseline_s": reference}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
