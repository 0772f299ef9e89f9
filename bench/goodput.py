"""`python -m bench.goodput`: how much of a two-host job's time trains when one host keeps getting lost.

Two local launcher "hosts" of one process each (the same machine, one shared checkpoint directory, as hosts
share a network file system) train ResNet-18 on synthetic data for --steps steps. Every --fault-every seconds
of training the second host is lost (SIGKILL to its launcher's whole process group) and comes back
--down-for seconds later with the same settings. Goodput = the fault-free wall time for the same steps / the
faulted wall time. Each fault's cost is split from the first host's log, which the bench time-stamps line by
line: detection (kill -> the restart line), restart (-> the checkpoint it resumes from is named), load and
first step (-> the first step at the new size), and the steps recomputed since that checkpoint.

Modes, the same schedule each:
  elastic   trainer-launch with NNODES=1:2 (c10d; the survivors go on at world size 1)
  static    trainer-launch with NNODES=2 and MAX_RESTARTS=10 (the survivor restarts and waits for the host)
  torchrun  plain `torchrun --nnodes 1:2 --rdzv-backend c10d` running the built-in trainer (no launcher)

    python -m bench.goodput --steps 600 --fault-every 60 --down-for 20 --modes elastic static torchrun
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

MODES = ("elastic", "static", "torchrun")
RESUMED = re.compile(r"resuming from .*step-(\d+)\.pt \(step (\d+)")
STEP = re.compile(r"epoch \d+ step (\d+)/")
WORLD = re.compile(r"training .* world size (\d+)")


class Host:
    """One launcher host: its process group, its output lines with the bench's clock."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path):
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_command(mode: str, args, work: Path) -> list[str]:
    train = ["--model", args.model, "--synthetic-size", str(args.steps * args.batch_size * 2), "--synthetic-image-size",
             str(args.image_size), "--image-size", str(args.image_size),  # the batch: TRAIN_GLOBAL_BATCH_SIZE
             "--epochs", "1", "--checkpoint-every", str(args.checkpoint_every), "--log-every", "1",
             "--warmup-steps", "5", "--checkpoint-dir", str(work / "checkpoints"), "--log-dir", str(work / "runs")]
    if mode == "torchrun":
        return ["torchrun", "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{args.port}", "--rdzv-id=bench", "--max-restarts=10",
                "--rdzv-conf=last_call_timeout=5", "-m", "trainer", *train]
    return [sys.executable, "-m", "trainer.cli.launch", *train]


def host_env(mode: str, args, node: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "NNODES", "NODE_RANK", "MASTER_"))}
    env.update(PREFLIGHT="0", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port),
               OMP_NUM_THREADS=str(args.threads), TRAIN_GLOBAL_BATCH_SIZE=str(args.batch_size * 2))
    if mode == "elastic":
        env["NNODES"] = "1:2"
    elif mode == "static":
        env.update(NNODES="2", NODE_RANK=str(node), MAX_RESTARTS="10")
    return env


def one_run(mode: str, args, faults: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"goodput-{mode}-"))
    args.port = free_port()
    first = Host(host_command(mode, args, work), host_env(mode, args, 0), work)
    time.sleep(2)  # the first host hosts the rendezvous store
    second = Host(host_command(mode, args, work), host_env(mode, args, 1), work)
    began = time.monotonic()
    kills, returns, hosts = [], [], [first, second]
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
        if second.proc.poll() is None and trained_since and time.monotonic() - trained_since >= args.fault_every:
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
    for host in hosts:
        host.kill() if host.proc.poll() is None else None
    summary = {}
    try:
        summary = json.loads((work / "runs" / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    result = {"mode": mode, "faults": faults, "wall_s": ended - began, "hung": hung, "code": first.proc.returncode,
              "global_step": summary.get("global_step"), "status": summary.get("status"),
              "kills": len(kills), "per_fault": split_faults(sorted(line for host in hosts for line in host.lines),
                                                             kills, returns, began)}
    if hung or summary.get("global_step") != args.steps:
        result["tail"] = [line for _, line in first.lines[-15:]]
    shutil.rmtree(work, ignore_errors=True)
    return result


def split_faults(lines: list[tuple[float, str]], kills: list[float], returns: list[float], began: float) -> list[dict]:
    """Each loss's cost from the first host's time-stamped log."""
    out = []
    for k, killed in enumerate(kills):
        after = [(t, line) for t, line in lines if t >= killed]
        detected = next((t for t, line in after if line.startswith("restart ") or "exited with" in line), None)
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
                    "host_back_after_s": round(returns[k] - killed, 1) if k < len(returns) else None})
    return out


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
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="seconds before a run is called hung (0: three times the fault-free run, at least 300)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    baseline = one_run("elastic", args, faults=False)
    if baseline["global_step"] != args.steps:
        print(f"error: the fault-free run did not finish: {json.dumps(baseline)[:2000]}", file=sys.stderr)
        return 1
    args.timeout = args.timeout or max(300.0, 3 * baseline["wall_s"])
    runs = [baseline] + [one_run(mode, args, faults=True) for mode in args.modes]
    rows = []
    for run in runs[1:]:
        done = run["global_step"] == args.steps and not run["hung"]
        goodput = baseline["wall_s"] / run["wall_s"] if done else 0.0
        run["goodput"] = round(goodput, 3)
        costs = run["per_fault"]

        def median(key, costs=costs):
            values = sorted(c[key] for c in costs if c[key] is not None)
            return values[len(values) // 2] if values else None
        rows.append(f"| {run['mode']} | {run['kills']} | {run['wall_s']:.0f} s | "
                    f"{'%.2f' % goodput if done else 'did not finish: ' + ('hung' if run['hung'] else 'exit %s' % run['code'])} | "
                    f"{median('detect_s')} | {median('restart_s')} | {median('load_and_first_step_s')} | "
                    f"{median('recomputed_steps')} |")
    header = {"command": " ".join(["python", "-m", "bench.goodput", *argv]), "date": now(), "machine": describe_machine()}
    table = (f"`{header['command']}`  \n{header['date']}, {header['machine']}\n\n"
             f"fault-free: {baseline['wall_s']:.0f} s for {args.steps} steps (elastic, 2 hosts)\n\n"
             "| mode | losses | wall | goodput | detect s | restart s | load + first step s | recomputed steps |\n"
             "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    write_results(args.out, "goodput", header, runs, {"baseline_s": baseline["wall_s"]}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
