"""What every bench command writes: the machine it ran on, and its table and runs under --out.

Shared by `python -m bench` (bench/run.py), its input-only mode (bench/inputpath.py) and
`python -m bench.timing_cost`, so all describe the machine the same way, their results files have one
layout, and paired runs are summarised alike.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # every bench command's default --out


def describe_machine() -> str:
    import torch  # lazily: the harness's argument checks run before torch is imported

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{os.cpu_count()} CPUs ({cpu}), {device}, torch {torch.__version__}, Python {platform.python_version()}"


def now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def worker_env(threads: str) -> dict[str, str]:
    """The environment of a bench command's own torchrun, started in a scratch folder: this checkout's bench/ on the
    path (it is not an installed package), OMP_NUM_THREADS as given."""
    repo = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "OMP_NUM_THREADS": threads,
            "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}


def ran_as_worker(args, worker) -> bool:
    """A bench command's start: under its own torchrun (args.worker set) run the one worker and say so; otherwise
    make --out ready before any run (a bad --out costs no measurement)."""
    from trainer.cli.scale import prepare_out
    from trainer.core.errors import exit_on_usage_error

    if args.worker:
        worker(args)
        return True
    with exit_on_usage_error():
        prepare_out(args.out)
    return False


def write_results(out: Path, prefix: str, header: dict, runs: list, summary: dict, table: str) -> None:
    """<out>/<prefix>-<time>.md (the table) and .json (header, every run, the summary), then say where."""
    out.mkdir(parents=True, exist_ok=True)  # made, not refused: the measurement is done by now
    stem = out / datetime.datetime.now().strftime(f"{prefix}-%Y%m%d-%H%M%S")
    stem.with_suffix(".md").write_text(table)
    stem.with_suffix(".json").write_text(json.dumps({**header, "runs": runs, **summary}, indent=2) + "\n")
    print(table + f"\nwritten: {stem}.md, {stem}.json")


def paired_ratios(runs: list[dict], nproc: int, a: str, b: str) -> dict:
    """a/b within each round (the two ran minutes apart at most, so a slow spell of the machine
    divides out), their median and its distribution-free 95% interval: the order statistics k and
    n + 1 - k, k the largest with P(Binomial(n, 1/2) < k) <= 2.5% (the whole range below 6 rounds)."""
    by_round = {(r["round"], r["stack"]): r["samples_per_second"] for r in runs if r["nproc"] == nproc}
    rounds = sorted({n for n, _ in by_round})
    values = sorted(by_round[n, a] / by_round[n, b] for n in rounds if (n, a) in by_round and (n, b) in by_round)
    count, k = len(values), 1

    def below(j: int) -> float:  # P(Binomial(count, 1/2) < j)
        return sum(math.comb(count, i) for i in range(j)) / 2 ** count

    while k + 1 <= count // 2 and below(k + 1) <= 0.025:
        k += 1
    return {"values": values, "median": statistics.median(values), "low": values[k - 1], "high": values[count - k]}


# ------------------------------------------------------------------ direct costs (bench.timing_cost, bench.engine_cost)

def cost_parser(prog: str, description: str, blocks_help: str):
    """The options of a direct cost measurement: alternating blocks of steps of two loops in one process."""
    from trainer.core.errors import OneLineErrorParser

    parser = OneLineErrorParser(prog=prog, description=description)
    parser.add_argument("--blocks", type=int, default=40, help=blocks_help)
    parser.add_argument("--steps", type=int, default=50, help="steps per block")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--step-ms", type=float, default=348.0,
                        help="a real step's time to express the cost against (default: the 2-process "
                             "ResNet-18 step of docs/benchmarks.md's interleaved run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the .md and .json results")
    return parser


def check_counts(args) -> None:
    from trainer.core.errors import UsageError

    for setting, value in (("--blocks", args.blocks), ("--steps", args.steps), ("--log-every", args.log_every)):
        if value < 1:
            raise UsageError(setting, f"{value} is below 1", "give 1 or more")


def cost_batches(steps: int) -> list:
    """The paired-cost benches' fixed data (torch on one thread, as the blocks run): `steps` batches of 8
    samples of 64 features and a label of 10 classes, the same every run."""
    import torch

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator))
            for _ in range(steps)]


def alternate(blocks: int, block_of: dict) -> list[dict]:
    """`blocks` rounds, each running every stack's block once in the given order; block_of[stack]() returns one
    block's seconds per step. The runs as block_cost and paired_ratios read them (steps per second)."""
    return [{"round": block, "nproc": 1, "stack": stack, "samples_per_second": 1.0 / run()}
            for block in range(1, blocks + 1) for stack, run in block_of.items()]


def write_cost(args, argv: list[str], module: str, runs: list[dict], costly: str, plain: str,
               shown: dict[str, str], what: str) -> None:
    """The paired-cost benches' report: block_cost of `costly` over `plain`, as json and markdown under args.out.
    shown: each stack as the sentence names it; what: whose cost it is."""
    summary = block_cost(runs, costly, plain, args.step_ms)
    step_us, cost_us, share = summary["step_us"], summary["cost_us"], summary["share_of_step"]
    header = {"command": shlex.join(["python", "-m", module, *argv]), "date": now(), "machine": describe_machine()}
    table = (f"`{header['command']}`  \n{header['date']}, {header['machine']}\n\n"
             f"- step time, median over {args.blocks} blocks of {args.steps} steps: {shown[costly]} "
             f"{step_us[costly]:.1f} us, {shown[plain]} {step_us[plain]:.1f} us\n"
             f"- {what} per step: {cost_us['median']:.1f} us (95% interval {cost_us['low']:.1f} to "
             f"{cost_us['high']:.1f} us)\n"
             f"- against a {args.step_ms:g} ms step: {share['median']:.4%} (interval {share['low']:.4%} to "
             f"{share['high']:.4%})\n")
    write_results(args.out, module.rsplit(".", 1)[1].replace("_", "-"), header, runs, summary, table)


def block_cost(runs: list[dict], costly: str, plain: str, step_ms: float) -> dict:
    """What `costly` adds to `plain`'s step, from their alternating blocks (samples_per_second holds steps per
    second): both median step times, the cost per step with its paired 95% interval, and its share of a
    step_ms step."""
    step_us = {stack: statistics.median(1e6 / r["samples_per_second"] for r in runs if r["stack"] == stack)
               for stack in (costly, plain)}
    paired = paired_ratios(runs, 1, plain, costly)  # plain's speed over costly's = their step times' ratio
    cost_us = {key: (paired[key] - 1.0) * step_us[plain] for key in ("median", "low", "high")}
    return {"step_us": step_us, "cost_us": cost_us, "paired": paired,
            "share_of_step": {key: value / (step_ms * 1000.0) for key, value in cost_us.items()}, "step_ms": step_ms}
