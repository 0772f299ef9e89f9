"""Start-up through Slurm: `sbatch` accepted -> the first training step, on the two-node CPU test cluster
(tests/slurmcluster.py: slurmctld and two slurmd on this machine, each in its own network namespace).

    sudo python -m bench.slurm_startup [--rounds 5] [--out bench/results]

Each round submits slurm/train-per-gpu.sbatch (one task per GPU: srun python -m trainer, 2 x 2 tasks)
and slurm/train-per-node.sbatch (one task per node: srun trainer-launch, torchrun's 2 workers per
node), interleaved, overriding only what a CPU site would (--gres=none, tasks and CPUs). The clock
starts when sbatch returns a job id and stops when the job's output shows the trainer's "first step
done" line (polled every 0.1 s); the job's start (Slurm's StartTime, whole seconds) splits the two.
Prints a markdown table of medians and writes it with the raw times as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from slurmcluster import SlurmCluster, SlurmJob  # noqa: E402 (tests/ is not a package)

MODES = {
    "per-gpu (srun python -m trainer)": ("train-per-gpu.sbatch", ["--gres=none", "--ntasks-per-node=2",
                                                                  "--cpus-per-task=1"]),
    "per-node (srun trainer-launch)": ("train-per-node.sbatch", ["--gres=none", "--cpus-per-task=2"]),
}
TRAINING = ["--model", "cnn", "--synthetic-size", "640", "--batch-size", "16", "--epochs", "1"]
FIRST_STEP = "INFO first step done"


def one_run(cluster: SlurmCluster, root: Path, script: str, site: list[str]) -> dict:
    job = SlurmJob(cluster, root, [*site, str(REPO / "slurm" / script), *TRAINING])
    accepted = time.time()
    while FIRST_STEP not in job.output():
        if job.info()["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING"):
            raise SystemExit(f"job {job.id} ended before its first step:\n{job.output()[-3000:]}")
        time.sleep(0.1)
    first_step = time.time()
    info = job.wait()
    started = datetime.fromisoformat(info["StartTime"]).timestamp()  # Slurm's local time, like ours
    return {"job": job.id, "to_first_step_s": first_step - accepted, "to_job_start_s": max(0.0, started - accepted),
            "state": info["JobState"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with SlurmCluster() as cluster, tempfile.TemporaryDirectory(prefix="slurm-startup-") as tmp:
        for round_ in range(args.rounds):
            for mode, (script, site) in MODES.items():
                run = one_run(cluster, Path(tmp) / f"{round_}-{script}", script, site)
                runs[mode].append(run)
                print(f"round {round_ + 1} {mode}: first step {run['to_first_step_s']:.1f} s after sbatch "
                      f"(job started after {run['to_job_start_s']:.0f} s)", flush=True)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"Slurm start-up, 2 nodes x 2 CPU processes, {args.rounds} rounds interleaved, {when}, "
             f"{platform.node()} ({platform.processor() or platform.machine()}, {len(__import__('os').sched_getaffinity(0))} CPUs)",
             "", "| mode | sbatch -> first step, median (min-max) | sbatch -> job start, median |", "|---|---|---|"]
    for mode, results in runs.items():
        steps = [r["to_first_step_s"] for r in results]
        starts = [r["to_job_start_s"] for r in results]
        lines.append(f"| {mode} | {statistics.median(steps):.1f} s ({min(steps):.1f}-{max(steps):.1f}) "
                     f"| {statistics.median(starts):.0f} s |")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    (out / f"slurm-startup-{stamp}.md").write_text("\n".join(lines) + "\n")
    (out / f"slurm-startup-{stamp}.json").write_text(json.dumps({"when": when, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
