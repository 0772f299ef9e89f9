"""`trainer-scale`: does adding processes (GPUs, or CPU processes) make training faster?

    trainer-scale --max-procs 4 --out scaling -- --model resnet50 --amp bf16

Runs the trainer under torchrun at 1, 2, ... N processes with the same per-process batch, for
--steps steps each (the first few not timed: see --help), interleaving the process counts over
--repeats rounds and taking medians. Writes <out>/scaling.md (processes, samples/s, speed-up,
efficiency), scaling.png and scaling.json. Efficiency is speed-up / (processes / baseline
processes): near 1.0 more processes pay off; well below it (say 0.7) the run is
communication-bound and more GPUs mostly add cost. Everything after `--` goes to the trainer.

Across nodes: run the trainer with trainer-launch at NNODES=1, 2, 4 ... (same per-process batch),
then `trainer-scale --from-summaries run1/summary.json run2/summary.json ... --out scaling`.

A failed run stops the sweep with its own exit code and error: the runs go through trainer-launch (one host, no
preflight), which reports a failure as one line naming the rank.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer.cluster.gpus import visible_gpu_count
from trainer.config.settings import OPTIONS, flag_name, load_config
from trainer.core.errors import OneLineErrorParser, UsageError, exit_on_usage_error, first_line, os_reason
from trainer.observe.metrics import WARMUP_STEPS_EXCLUDED

# Shared with `python -m bench`, whose stacks leave the same first steps out of the timing.
STEPS_HELP = f"steps per run, the first {WARMUP_STEPS_EXCLUDED} not timed"


def check_timed_steps(steps: int) -> None:
    """Without a timed step the trainer reports no samples/s at all."""
    if steps <= WARMUP_STEPS_EXCLUDED:
        raise UsageError("--steps", f"{steps} leaves no step to time: the first {WARMUP_STEPS_EXCLUDED} are not timed",
                         f"use more than {WARMUP_STEPS_EXCLUDED}")


def reject_harness_flags(trainer_args: list[str], owned: dict[str, str], setting: str) -> None:
    """Trainer flags a harness sets for every run itself: given again, the user's would win and break the
    timing (--max-steps) or hide the results from the harness (--log-dir)."""
    for arg in trainer_args:
        flag = arg.split("=", 1)[0]
        if flag in owned:
            raise UsageError(setting, f"{flag} is set by the harness for every run", f"use its {owned[flag]} instead")


def torchrun_command(nproc: int) -> list[str]:
    """trainer-launch on this host alone with nproc workers (as torchrun --standalone): a failed run ends in one
    line naming the rank and exits with the worker's code, instead of torchrun's traceback."""
    return ["env", "-u", "NODE_RANK", "-u", "MASTER_ADDR", f"NPROC_PER_NODE={nproc}", "NNODES=1", "PREFLIGHT=0",
            sys.executable, "-m", "trainer.cli.launch"]


def exit_with_failed_run(done: subprocess.CompletedProcess) -> None:
    """Relay a failed run's stderr (the worker's own error, then the launcher's line) and exit with its code."""
    sys.stderr.write(done.stderr)
    raise SystemExit(done.returncode if done.returncode > 0 else 1)  # killed by a signal: still a failure


def unrecognized(unknown: list[str]) -> UsageError:
    """Trainer options before the `--` are the likely mistake: say where they go."""
    trainer_flags = {flag_name(f.name) for f in OPTIONS}
    flags = [arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")]
    fix = (f"trainer options go after `--`: trainer-scale [options] -- {shlex.join(unknown)}"
           if flags and all(flag in trainer_flags for flag in flags) else "see `trainer-scale --help`")
    return UsageError("arguments", f"unrecognized arguments: {shlex.join(unknown)}", fix)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, trainer_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = OneLineErrorParser(prog="trainer-scale", description=__doc__.split("\n\n")[0],
                                epilog="Details: docs/benchmarks.md")
    parser.add_argument("--max-procs", type=int, default=None, help="largest process count (default: visible GPUs, or 2)")
    parser.add_argument("--steps", type=int, default=40, help=STEPS_HELP)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median counts")
    parser.add_argument("--out", type=Path, default=Path("scaling"), help="output folder (default ./scaling)")
    parser.add_argument("--from-summaries", nargs="+", type=Path, metavar="SUMMARY_JSON",
                        help="build the report from finished runs' summary.json files instead of running")
    args, unknown = parser.parse_known_args(own)
    if unknown:
        raise unrecognized(unknown)
    check_timed_steps(args.steps)
    reject_harness_flags(trainer_args, {"--max-steps": "--steps", "--log-dir": "--out", "--checkpoint-dir": "--out"},
                         "trainer options")
    if args.repeats < 1 or (args.max_procs is not None and args.max_procs < 1):
        raise UsageError("--repeats/--max-procs", "must be at least 1", "give a positive number")
    return args, trainer_args


def prepare_out(out: Path) -> None:
    """Make the output folder before any run or report is written, so that a bad --out costs no run."""
    if out.exists() and not out.is_dir():
        raise UsageError("--out", f"{out} is a file, not a folder", "give a folder path, new or existing")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError("--out", f"cannot create {out} ({os_reason(err)})",
                         "give a folder you can write to") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError("--out", f"{out} is not writable", "give a folder you can write to")


def run_command(nproc: int, steps: int, trainer_args: list[str], run_dir: Path) -> list[str]:
    """Timing-friendly defaults first (no validation or checkpoints mid-window); the user's args win."""
    cfg = load_config(trainer_args, os.environ, world_size=nproc)  # a bad option fails here, in one line
    samples = steps * cfg.batch_size * cfg.grad_accum * nproc  # one epoch covers the run: no epoch-end work
    return [*torchrun_command(nproc), "-m", "trainer", "--max-steps", str(steps),
            "--synthetic-size", str(max(samples, 1)),
            "--val-every", "0", "--checkpoint-every", "0", "--log-every", str(steps), "--resume", "never",
            *trainer_args, "--log-dir", str(run_dir / "runs"), "--checkpoint-dir", str(run_dir / "checkpoints")]


def busy_cpu_seconds() -> float:
    """CPU seconds all processes of the machine have used since boot (Linux /proc/stat; 0 elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_counting_other_work(command: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, float]:
    """Run a child to completion, and say how many cores other work on the machine kept busy meanwhile:
    the noise every timing on a shared machine carries."""
    busy, own, start = busy_cpu_seconds(), own_children_cpu_seconds(), time.monotonic()
    done = subprocess.run(command, **kwargs)
    others = (busy_cpu_seconds() - busy - (own_children_cpu_seconds() - own)) / (time.monotonic() - start)
    return done, max(0.0, others)


def measure(nproc: int, command: list[str], run_dir: Path) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # the same threads per process at every count (torchrun sets 1 only for >1)
    print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
    done, others = run_counting_other_work(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           text=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # a model per run adds up; the summary is kept
    if done.returncode != 0:
        exit_with_failed_run(done)
    return {**read_summary(run_dir / "runs" / "summary.json", f"the {nproc}-process run"), "other_cores_busy": others}


def read_summary(path: Path, setting: str = "--from-summaries") -> dict:
    fix = f"give the summary.json of runs that completed more than {WARMUP_STEPS_EXCLUDED} steps"
    try:
        summary = json.loads(path.read_text())
        processes, speed = int(summary["world_size"]), float(summary["samples_per_second"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(setting, f"{path} is not a finished run's summary.json ({type(err).__name__}: "
                         f"{first_line(err)})", fix) from None
    # Speed-up and efficiency divide by both.
    for field, ok in (("world_size", processes >= 1), ("samples_per_second", math.isfinite(speed) and speed > 0)):
        if not ok:
            raise UsageError(setting, f"{path}: {field} is {summary[field]}, not a positive number", fix)
    return {"processes": processes, "samples_per_second": speed, "model": summary.get("model"),
            "device": summary.get("device"), "summary": str(path.resolve())}


def check_same_workload(runs: list[dict]) -> None:
    """Speed-ups compare one model on one device kind; summaries of different runs would mix them."""
    for field in ("model", "device"):
        kinds = {str(run[field]).split(":")[0] for run in runs}  # a device kind: cuda:0 and cuda:1 are one
        if len(kinds) > 1:
            raise UsageError("--from-summaries", f"the summaries mix {field}s ({', '.join(sorted(kinds))})",
                             "give the summaries of one workload")


def analyse(runs: list[dict]) -> list[dict]:
    """One row per process count: median samples/s, and speed-up and efficiency against the smallest count."""
    counts = sorted({r["processes"] for r in runs})
    rows = []
    for n in counts:
        values = [r["samples_per_second"] for r in runs if r["processes"] == n]
        rows.append({"processes": n, "samples_per_second": statistics.median(values),
                     "min": min(values), "max": max(values), "runs": len(values)})
    base = rows[0]
    for row in rows:
        row["speedup"] = row["samples_per_second"] / base["samples_per_second"]
        row["efficiency"] = row["speedup"] / (row["processes"] / base["processes"])
    return rows


def markdown(rows: list[dict], title: str) -> str:
    lines = [f"{title}", "", "| processes | samples/s (median) | min-max | runs | speed-up | efficiency |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['processes']} | {r['samples_per_second']:.1f} | {r['min']:.1f}-{r['max']:.1f} | {r['runs']} "
              f"| {r['speedup']:.2f}x | {r['efficiency']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], title: str, path: Path) -> bool:
    """The PNG; False (and a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'ddp-trainer[bench]'): "
              "wrote the table and JSON, no plot", file=sys.stderr)
        return False
    procs = [r["processes"] for r in rows]
    base = rows[0]
    ideal = [base["samples_per_second"] * n / base["processes"] for n in procs]
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    ax.plot(procs, ideal, "--", color="grey", label="ideal (linear)")
    ax.plot(procs, [r["samples_per_second"] for r in rows], "o-", label="measured (median)")
    for r in rows:
        ax.annotate(f"{r['efficiency']:.2f}", (r["processes"], r["samples_per_second"]),
                    textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    ax.set(xlabel="processes", ylabel="samples/s", xticks=procs, title=title)
    ax.title.set_fontsize(9)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_report(runs: list[dict], out: Path, command: str, trainer_args: list[str]) -> list[dict]:
    rows = analyse(runs)
    model = runs[0].get("model") or "model"
    title = f"{model}, {runs[0].get('device') or ''}: efficiency = speed-up / processes"
    title_line = f"`{command}`"
    if all("other_cores_busy" in r for r in runs):  # measured here, not read from summaries
        others = statistics.median(r["other_cores_busy"] for r in runs)
        title_line += f"  \nother work on the machine during the runs: median {others:.2f} cores busy"
    table = markdown(rows, title_line)
    (out / "scaling.md").write_text(table)
    payload = {"date": datetime.datetime.now().isoformat(timespec="minutes"), "command": command,
               "trainer_args": trainer_args, "rows": rows, "runs": runs}
    (out / "scaling.json").write_text(json.dumps(payload, indent=2) + "\n")
    plotted = plot(rows, title, out / "scaling.png")
    print(table + f"\nwritten: {out / 'scaling.md'}, {out / 'scaling.json'}" + (f", {out / 'scaling.png'}" if plotted else ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["trainer-scale", *argv])
    with exit_on_usage_error():
        args, trainer_args = parse_args(argv)
        if args.from_summaries:
            runs = [read_summary(p) for p in args.from_summaries]
            check_same_workload(runs)
            prepare_out(args.out)
            write_report(runs, args.out, command, trainer_args)
            return 0
        max_procs = args.max_procs or visible_gpu_count() or 2
        # Interleaved: a noisy neighbour slows every count alike.
        plan = [(nproc, args.out / "runs" / f"{nproc}p-{repeat + 1}")
                for repeat in range(args.repeats) for nproc in range(1, max_procs + 1)]
        # Every command up front: an option that is wrong only at some process count fails before any run.
        run_commands = [run_command(nproc, args.steps, trainer_args, run_dir) for nproc, run_dir in plan]
        prepare_out(args.out)
        runs = [measure(nproc, run, run_dir) for (nproc, run_dir), run in zip(plan, run_commands)]
        write_report(runs, args.out, command, trainer_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
