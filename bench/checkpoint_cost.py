"""`python -m bench.checkpoint_cost`: what checkpointing every N steps costs the step, synchronous against
`--checkpoint-async`.

Whole runs of the built-in trainer through trainer-launch (ResNet-18 on synthetic data, 2 processes, gloo on
the CPU), three variants run in interleaved rounds (the order rotates each round):

  none    --checkpoint-every 0 (only the final checkpoint, after the timed window)
  sync    --checkpoint-every N: rank 0 writes each checkpoint in the step
  async   --checkpoint-every N --checkpoint-async: rank 0 copies the state to CPU memory, a thread writes it

The step time is the wall time between two step lines of rank 0's log (--log-every 1, time-stamped by the bench
as they arrive), from step --skip to the last, divided by the steps between: the throughput clock in the log
pauses while a checkpoint commits, the wall clock does not. Reported: each variant's median step time and the
paired ratios none / sync and none / async per round (1.0: checkpoints cost nothing), with their medians.

    python -m bench.checkpoint_cost --rounds 3 --steps 80 --every 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import RESULTS, describe_machine, now, write_results

VARIANTS = ("none", "sync", "async")
STEP = re.compile(r"epoch \d+ step (\d+)[/ ]")


def command(variant: str, args, work: Path) -> list[str]:
    every = {"none": ["--checkpoint-every", "0"], "sync": ["--checkpoint-every", str(args.every)],
             "async": ["--checkpoint-every", str(args.every), "--checkpoint-async"]}[variant]
    return [sys.executable, "-m", "trainer.cli.launch", "--model", args.model, "--synthetic-size",
            str((args.steps + 10) * args.batch_size * 2), "--synthetic-image-size", str(args.image_size),
            "--image-size", str(args.image_size), "--batch-size", str(args.batch_size), "--epochs", "1",
            "--max-steps", str(args.steps), "--log-every", "1", "--warmup-steps", "0", "--checkpoint-dir",
            str(work / "checkpoints"), "--log-dir", str(work / "runs"), *every]


def one_run(variant: str, args) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"ckpt-cost-{variant}-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "NNODES", "NODE_RANK", "MASTER_"))}
    env.update(PREFLIGHT="0", NPROC_PER_NODE="2", OMP_NUM_THREADS=str(args.threads))
    stamps: dict[int, float] = {}
    proc = subprocess.Popen(command(variant, args, work), env=env, cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    for line in proc.stdout:
        found = STEP.search(line)
        if found:
            stamps.setdefault(int(found.group(1)), time.monotonic())
        tail = (tail + [line.rstrip("\n")])[-15:]
    code = proc.wait()
    checkpoints = len(list((work / "checkpoints").glob("step-*")))
    shutil.rmtree(work, ignore_errors=True)
    first, last = args.skip, max(stamps, default=0)
    if code != 0 or first not in stamps or last <= first:
        raise SystemExit(f"error: the {variant} run failed (exit {code}, steps logged {sorted(stamps)[-3:]}):\n"
                         + "\n".join(tail))
    return {"variant": variant, "step_s": (stamps[last] - stamps[first]) / (last - first), "steps": last - first,
            "checkpoints_kept": checkpoints}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoint_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three variants")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=10, help="the timed window starts at this step")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps (sync and async)")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per process")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.steps <= args.skip + args.every:
        parser.error(f"--steps {args.steps}: the timed window needs more than --skip + --every steps")
    runs = []
    for round_ in range(args.rounds):
        order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]
        for variant in order:
            run = one_run(variant, args)
            run["round"] = round_ + 1
            runs.append(run)
            print(json.dumps(run), flush=True)
    step = {v: statistics.median(r["step_s"] for r in runs if r["variant"] == v) for v in VARIANTS}
    ratios = {v: [next(r["step_s"] for r in runs if r["round"] == k and r["variant"] == "none") / r["step_s"]
                  for k in range(1, args.rounds + 1) for r in runs if r["round"] == k and r["variant"] == v]
              for v in ("sync", "async")}
    summary = {"step_s": step, "ratio_to_none": {v: statistics.median(x) for v, x in ratios.items()},
               "ratios_per_round": ratios}
    header = {"command": " ".join(["python", "-m", "bench.checkpoint_cost", *argv]), "date": now(),
              "machine": describe_machine()}
    table = (f"`{header['command']}`  \n{header['date']}, {header['machine']}\n\n"
             "| variant | median step | step time of none / this (median of rounds) | per round |\n|---|---|---|---|\n"
             + "\n".join(f"| {v} | {step[v] * 1000:.0f} ms | "
                         + ("1.00 | |" if v == "none" else
                            f"{summary['ratio_to_none'][v]:.3f} | {', '.join(f'{x:.3f}' for x in ratios[v])} |")
                         for v in VARIANTS) + "\n")
    write_results(args.out, "checkpoint-cost", header, runs, summary, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
