"""`trainer-report <log-dir>`: what a finished or running run did, where its time went, what to try.

Reads the log directory only (summary.json, params.json, metrics.csv or else the TensorBoard events)
and prints a short diagnosis: throughput over time, each rank's time split, the slowest rank, and
whether the run is input-bound, communication-bound or compute-bound, with the setting to try.
It also draws loss, accuracy and throughput curves into <log-dir>/report.png (with matplotlib).
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path
from typing import Any

from trainer.core.errors import OneLineErrorParser, UsageError, exit_on_usage_error
from trainer.observe.steptiming import FIELDS, STRAGGLER_THRESHOLD, describe, straggler as find_straggler

PNG_NAME = "report.png"
INPUT_BOUND = 0.20  # the median rank waits this share of its step for data
COMM_BOUND = 0.30  # ... or this share in collectives, with no single slow rank to blame
SEGMENTS = 6  # throughput over time, in this many stretches of the run
RANK_TAG = re.compile(r"^time/(\w+_ms)/rank(\d+)$")
Scalars = dict[str, list[tuple[int, float]]]


def read_scalars(log_dir: Path) -> Scalars:
    """tag -> [(step, value)], from metrics.csv when the run wrote one, else the TensorBoard events."""
    series: Scalars = {}
    table = log_dir / "metrics.csv"
    if table.exists():
        with table.open(newline="") as f:
            for row in csv.DictReader(f):
                series.setdefault(row["tag"], []).append((int(row["step"]), float(row["value"])))
        return series
    if not any(log_dir.glob("events.out.tfevents.*")):
        return series
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={SCALARS: 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()[SCALARS]}


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def ranks_from_scalars(scalars: Scalars) -> list[dict[str, Any]]:
    """A running run's per-rank table: the mean of its windows (but the first, start-up)."""
    rows: dict[int, dict[str, Any]] = {}
    for tag, points in scalars.items():
        match = RANK_TAG.match(tag)
        if match:
            values = [v for _, v in points[1:]] or [v for _, v in points]
            rows.setdefault(int(match.group(2)), {"rank": int(match.group(2)), "steps": len(points)})[
                match.group(1)] = statistics.fmean(values)
    return [rows[r] for r in sorted(rows)]


def throughput_line(scalars: Scalars) -> str | None:
    points = scalars.get("throughput/samples_per_s", [])[1:]  # the first window holds start-up
    if not points:
        return None
    size = max(1, -(-len(points) // SEGMENTS))
    parts = []
    for begin in range(0, len(points), size):
        chunk = points[begin:begin + size]
        parts.append(f"steps {chunk[0][0]}-{chunk[-1][0]}: {statistics.fmean(v for _, v in chunk):.1f}")
    values = [v for _, v in points]
    drift = ""
    quarter = len(values) // 4
    if quarter and statistics.fmean(values[-quarter:]) < 0.8 * statistics.fmean(values[:quarter]):
        drift = "  (it fell by more than 20% during the run: another job on the hosts, thermal throttling, "\
                "or slower data later in the epoch)"
    return "throughput (samples/s): " + ", ".join(parts) + drift


def verdict(ranks: list[dict[str, Any]], straggler: dict | None, config: dict[str, Any]) -> str:
    timed = [r for r in ranks if r.get("compute_ms") is not None]
    if not timed:
        return "verdict: no per-rank timing in this run (it ran with --step-timing false)"
    step = statistics.median(r["data_wait_ms"] + r["compute_ms"] + r["comm_wait_ms"] + r["optimizer_ms"]
                             for r in timed) or 1.0
    data = statistics.median(r["data_wait_ms"] for r in timed) / step
    comm = statistics.median(r["comm_wait_ms"] for r in timed) / step
    if straggler:
        where = f"rank {straggler['rank']} on {straggler.get('host', '?')}"
        if straggler["phase"] == "data_wait_ms":
            fix = (f"its input is slow: look at that host's disk and CPU load (other jobs), or raise --num-workers "
                   f"(now {config.get('num_workers', '?')})")
        else:
            fix = "it computes slowly: look at that host's GPU (nvidia-smi: clocks, temperature, other processes) " \
                  "or CPU load"
        return f"verdict: one slow rank, {where}; the others wait for it ({comm:.0%} of the median step): {fix}"
    if data >= INPUT_BOUND:
        loader = "" if config.get("loader") == "memory" else \
            ", or the GPU input path (--loader memory, for in-memory datasets: synthetic, cifar10, mnist)"
        workers = config.get("num_workers")
        more = f" --num-workers {max(2, 2 * workers)} (now {workers})" if isinstance(workers, int) else " --num-workers"
        return f"verdict: input-bound: the ranks wait {data:.0%} of each step for data; try{more}{loader}"
    if comm >= COMM_BOUND:
        batch = config.get("batch_size")
        return (f"verdict: communication-bound: the ranks wait {comm:.0%} of each step in collectives; try "
                f"--local-sgd-period 8 (changes numerics), a larger --batch-size (now {batch}) or --grad-accum, "
                "and on one CPU host --shm-allreduce true")
    return (f"verdict: compute-bound ({1 - data - comm:.0%} of each step is compute and the optimizer): "
            "try --amp bf16, --channels-last, --compile")


def rank_table(ranks: list[dict[str, Any]], slowest: int | None) -> list[str]:
    lines = ["time per step by rank (ms):",
             f"  {'rank':>4}  {'host':<16} {'data wait':>9} {'compute':>9} {'comm wait':>9} {'optimizer':>9}"]
    for r in ranks:
        if r.get("compute_ms") is None:
            continue
        mark = "  <- slowest" if r["rank"] == slowest else ""
        times = " ".join(f"{r[name]:>9.1f}" for name in FIELDS)
        lines.append(f"  {r['rank']:>4}  {str(r.get('host', '')):<16} {times}{mark}")
    return lines


def diagnose(log_dir: Path, summary: dict | None, params: dict | None, scalars: Scalars) -> str:

    config = (params or {}).get("config", {})
    lines = []
    if summary:
        rate = summary.get("samples_per_second")
        lines.append(f"run: {summary['status']} at step {summary['global_step']}, {summary['world_size']} ranks "
                     f"({summary['backend']}, {summary['device']}), {summary['model']} on {summary['dataset']}"
                     + (f"; {rate:.1f} samples/s steady state" if rate else ""))
    else:
        last = max((p[-1][0] for p in scalars.values() if p), default=0)
        lines.append(f"run: in progress (no summary.json yet), last logged step {last}")
    line = throughput_line(scalars)
    if line:
        lines.append(line)
    ranks = (summary or {}).get("ranks") or ranks_from_scalars(scalars)
    found = (summary or {}).get("straggler") if summary and "straggler" in summary else None
    if not summary and ranks:
        found = find_straggler(ranks, ["(host: in summary.json)"] * (max(r["rank"] for r in ranks) + 1))
    if ranks:
        lines += rank_table(ranks, found["rank"] if found else None)
        lines.append("slowest rank: " + (describe(found) if found else f"none stands out (none is "
                                         f"{STRAGGLER_THRESHOLD:.0%} slower than the others' median)"))
    lines.append(verdict(ranks, found, config))
    return "\n".join(lines)


def draw(scalars: Scalars, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install 'ddp-trainer[report]')"
    panels = [("loss", ("Loss/train", "Loss/val")), ("accuracy", ("acc1/val", "acc5/val")),
              ("samples/s", ("throughput/samples_per_s",))]
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 9), sharex=True)
    for axis, (label, tags) in zip(axes, panels):
        for tag in tags:
            if scalars.get(tag):
                steps, values = zip(*scalars[tag])
                axis.plot(steps, values, marker="." if len(steps) < 30 else None, label=tag)
        axis.set_ylabel(label)
        if axis.lines:
            axis.legend(loc="best")
        else:
            axis.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=axis.transAxes)
    axes[-1].set_xlabel("optimizer step")
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100)
    except OSError as err:
        return f"no PNG: cannot write {path} ({err.strerror or err})"
    finally:
        plt.close(figure)
    return f"curves: {path}"


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="trainer-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("log_dir", help="a run's --log-dir (finished or running)")
    parser.add_argument("--png", default=None, help=f"where to draw the curves (default <log-dir>/{PNG_NAME}; "
                                                    "none: no PNG)")
    with exit_on_usage_error():
        args = parser.parse_args(argv)
        log_dir = Path(args.log_dir)
        if not log_dir.is_dir():
            raise UsageError("log_dir", f"'{log_dir}' is not a directory", "give a run's --log-dir")
        summary, params = read_json(log_dir / "summary.json"), read_json(log_dir / "params.json")
        scalars = read_scalars(log_dir)
        if summary is None and not scalars:
            raise UsageError("log_dir", f"'{log_dir}' holds no summary.json, metrics.csv or TensorBoard events",
                             "give the --log-dir of a run that has logged at least once")
    print(diagnose(log_dir, summary, params, scalars))
    if args.png != "none":
        print(draw(scalars, Path(args.png) if args.png else log_dir / PNG_NAME))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
