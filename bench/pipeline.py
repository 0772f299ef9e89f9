"""`python -m bench.pipeline`: pipeline stages' step time and idle share (the bubble) against GPipe's formula, and
the training state each rank holds against ddp's.

The bubble: P processes (default 2) run a model of P x --layers equal blocks (Linear and ReLU, --width wide) cut
into P equal stages, through trainer.parallel.pipeline's Stage, for each schedule (gpipe, 1f1b) and each micro-batch
count M (--microbatches, default 2 4 8), each micro-batch --microbatch-size samples. Every step is timed, and right
after it each rank times its own stage's work alone: the same M forwards and backwards on the same shapes, in the
schedule's order (gpipe's forwards all before its backwards), with nothing to wait for. The measured bubble of a step
is 1 - (the busiest stage's time alone) / (the step's time): the share of the step in which even the busiest stage
waited. It is set against (P - 1) / (M + P - 1), which assumes equal stages
and free messages. Cells run interleaved (--rounds), medians reported.

The memory: --memory-model (ResNet-50) built and wrapped the trainer's way (trainer.parallel.strategy.for_run,
trainer.engine.optim.build_optimizer: SGD with momentum) at P processes, once under ddp and once cut into P stages;
after --memory-steps steps each rank counts the bytes of its parameters, gradients and optimizer state. The largest
rank's over ddp's is the reason to use stages (issue 42's goal: at most 0.6 at P = 2).

    python -m bench.pipeline                                 # the table, written to bench/results/pipeline-*.md
    python -m bench.pipeline --rounds 5 --steps 8                 # docs/benchmarks.md's run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.results import RESULTS, describe_machine, now, ran_as_worker, worker_env, write_results

SCHEDULES = ("gpipe", "1f1b")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from trainer.core.errors import OneLineErrorParser

    parser = OneLineErrorParser(prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=2, help="P: processes, one stage each")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8], help="M: micro-batches per step")
    parser.add_argument("--microbatch-size", type=int, default=128, help="samples per micro-batch")
    parser.add_argument("--width", type=int, default=1024, help="the blocks' width")
    parser.add_argument("--layers", type=int, default=4, help="blocks per stage")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per cell and round (after one untimed)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of every cell")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process")
    parser.add_argument("--memory-model", default="resnet50", help="the model whose state per rank is counted "
                        "('' to skip)")
    parser.add_argument("--memory-image-size", type=int, default=32)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)  # one run, under torchrun
    parser.add_argument("--kind", choices=("bubble", "memory"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("stages", "microbatch_size", "width", "layers", "steps", "rounds", "threads", "memory_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.stages < 2:
        parser.error("--stages must be at least 2 (one stage is no pipeline)")
    if any(m < 1 for m in args.microbatches):
        parser.error("--microbatches must be at least 1 each")
    return args


def blocks_model(width: int, count: int):
    from torch import nn

    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(count)])


def bubble_worker(args: argparse.Namespace, ctx) -> dict:
    """One round: every cell in turn."""
    return {f"{schedule}@{m}": bubble_cell(args, ctx, schedule, m) for schedule in args.schedules
            for m in args.microbatches}


def bubble_cell(args: argparse.Namespace, ctx, schedule: str, m: int) -> dict:
    """One cell: (step time, busiest stage alone) per timed step, the busiest over the ranks."""
    import torch

    from trainer.parallel import collectives
    from trainer.parallel.pipeline import Layout, Stage, cut, groups

    layout = Layout.of(ctx.rank, ctx.world_size, args.stages)
    torch.manual_seed(0)
    model = blocks_model(args.width, args.layers * args.stages)
    b = args.microbatch_size
    example = torch.randn(b, args.width)
    points = [str(args.layers * stage) for stage in range(1, args.stages)]
    piece = cut(model, example, points)[layout.stage]
    loss_fn = torch.nn.MSELoss()
    stage = Stage([piece], layout, schedule, m, lambda out, target: loss_fn(out, target) / m, ctx.device,
                  *groups(layout))
    inputs, targets = torch.randn(b * m, args.width), torch.randn(b * m, args.width)
    # A later stage's input arrives wanting its gradient (which the stage computes and sends back): alone too.
    alone_inputs = torch.randn(b, args.width, requires_grad=not layout.first)

    def forward():
        out = piece(alone_inputs)
        return out[0] if isinstance(out, tuple) else out

    def backward(out) -> None:
        if layout.last:
            (loss_fn(out, targets[:b]) / m).backward()
        else:
            out.backward(torch.ones_like(out))

    def alone() -> float:
        """This stage's M forwards and backwards with nothing to wait for, in the schedule's order: gpipe's every
        forward (their activations all held), then every backward; 1f1b's each forward followed by its backward
        (the steady state, which holds at most P)."""
        started = time.perf_counter()
        if schedule == "gpipe":
            for out in [forward() for _ in range(m)]:
                backward(out)
        else:
            for _ in range(m):
                backward(forward())
        return time.perf_counter() - started

    times = []
    for step in range(args.steps + 1):
        torch.distributed.barrier()
        started = time.perf_counter()
        stage.step(inputs if layout.first else None, targets if layout.last else None)
        took = time.perf_counter() - started
        piece.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        by_itself = alone()
        piece.zero_grad(set_to_none=True)
        if step:  # the first step (allocation, the schedule's set-up) is not timed
            times.append((took, by_itself))
    rows = collectives.all_gather_objects(ctx, times)
    steps = [(max(rank[i][0] for rank in rows), max(rank[i][1] for rank in rows)) for i in range(len(times))]
    return {"step_s": [s for s, _ in steps], "alone_s": [a for _, a in steps],
            "bubble": [1 - a / s for s, a in steps]}


def memory_worker(args: argparse.Namespace, ctx) -> dict:
    """The memory model under ddp, then cut into stages: each rank's state bytes."""
    return {kind: memory_layout(args, ctx, kind == "pipeline") for kind in ("ddp", "pipeline")}


def memory_layout(args: argparse.Namespace, ctx, staged: bool) -> list[dict]:
    """The memory model trained --memory-steps steps under ddp or cut into stages; each rank's state bytes."""
    import torch

    from bench.fsdp_memory import local_bytes
    from trainer.config.settings import load_config
    from trainer.data.images import synthetic_spec
    from trainer.engine.models import build_model
    from trainer.engine.optim import build_optimizer
    from trainer.parallel import collectives
    from trainer.parallel.strategy import for_run

    batch, m = 8, 4
    extra = ["--pipeline-stages", str(ctx.world_size), "--pipeline-microbatches", str(m)] if staged else []
    cfg = load_config(["--model", args.memory_model, "--env-file", "/dev/null", "--batch-size", str(batch),
                       "--synthetic-image-size", str(args.memory_image_size), "--shm-allreduce", "false", *extra],
                      {}, ctx.world_size)
    torch.manual_seed(0)
    model = build_model(args.memory_model, synthetic_spec(args.memory_image_size))
    images = torch.randn(batch, 3, args.memory_image_size, args.memory_image_size, device=ctx.device)
    labels = torch.randint(0, 10, (batch,), device=ctx.device)
    strategy = for_run(cfg, ctx, model)
    if staged:
        strategy.wrap(model, example=images)
        strategy.loss_fn = lambda out, target: torch.nn.functional.cross_entropy(out, target) / m
    else:
        forward = strategy.wrap(model)
    optimizer = build_optimizer(cfg, model)
    for _ in range(args.memory_steps):
        optimizer.zero_grad(set_to_none=True)
        if staged:
            strategy.stage.step(images, labels)
        else:
            torch.nn.functional.cross_entropy(forward(images), labels).backward()
        optimizer.step()  # gradients kept: they are part of the state counted
    state = [t for per_param in optimizer.state.values() for t in per_param.values() if torch.is_tensor(t)]
    params = [p for p in model.parameters()]
    row = {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params),
           "optimizer": local_bytes(state)}
    return collectives.all_gather_objects(ctx, row)


def worker(args: argparse.Namespace) -> None:
    from trainer.cluster.topology import WORKER, resolve
    from trainer.parallel.context import setup, teardown

    ctx = setup(resolve(os.environ, WORKER), "auto", 600)
    result = bubble_worker(args, ctx) if args.kind == "bubble" else memory_worker(args, ctx)
    if ctx.is_main:
        Path(args.worker).write_text(json.dumps(result) + "\n")
    teardown(ctx)


def run_once(args: argparse.Namespace, workdir: Path, kind: str, round_: int) -> dict:
    """One torchrun of P processes: a round of every bubble cell, or the memory counts."""
    result = workdir / f"{kind}-{round_}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.stages}",
               "-m", "bench.pipeline", "--worker", str(result), "--kind", kind, "--stages", str(args.stages),
               "--microbatch-size", str(args.microbatch_size), "--width", str(args.width), "--layers",
               str(args.layers), "--steps", str(args.steps), "--memory-model", args.memory_model,
               "--memory-image-size", str(args.memory_image_size), "--memory-steps", str(args.memory_steps),
               "--schedules", *args.schedules, "--microbatches", *map(str, args.microbatches)]
    print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=workdir, env=worker_env(str(args.threads)), capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"error: bench.pipeline: the {kind} run exited {done.returncode}")
    return {"kind": kind, "round": round_, **json.loads(result.read_text())}


def summarise(args: argparse.Namespace, runs: list[dict]) -> tuple[dict, str]:
    p = args.stages
    lines = [f"Bubble: P = {p}, {args.layers * p} blocks of {args.width} cut into {p} equal stages, micro-batches "
             f"of {args.microbatch_size}; medians over {args.rounds} rounds x {args.steps} steps.", "",
             "| schedule | M | step (ms) | busiest stage alone (ms) | bubble measured | (P - 1) / (M + P - 1) | "
             "measured / formula |", "|" + "---|" * 7]
    summary: dict = {"bubble": {}, "memory": {}}
    for schedule in args.schedules:
        for m in args.microbatches:
            cells = [r[f"{schedule}@{m}"] for r in runs if r["kind"] == "bubble"]
            step = statistics.median(s for r in cells for s in r["step_s"])
            by_itself = statistics.median(a for r in cells for a in r["alone_s"])
            bubble = statistics.median(b for r in cells for b in r["bubble"])
            formula = (p - 1) / (m + p - 1)
            summary["bubble"][f"{schedule}@{m}"] = {"step_s": step, "alone_s": by_itself, "bubble": bubble,
                                                   "formula": formula}
            lines.append(f"| {schedule} | {m} | {step * 1e3:.1f} | {by_itself * 1e3:.1f} | {bubble:.3f} | "
                         f"{formula:.3f} | {bubble / formula:.2f} |")
    memory = next((r for r in runs if r["kind"] == "memory"), None)
    if memory:
        mib = 2 ** 20
        lines += ["", f"Training state per rank: {args.memory_model}, {p} processes, SGD with momentum (MiB).", "",
                  "| layout | rank | parameters | gradients | optimizer state | total | of ddp's |", "|" + "---|" * 7]
        ddp = max(sum(row.values()) for row in memory["ddp"])
        for kind in ("ddp", "pipeline"):
            for rank, row in enumerate(memory[kind]):
                total = sum(row.values())
                lines.append(f"| {'ddp' if kind == 'ddp' else f'{p} stages'} | {rank} | {row['params'] / mib:.1f} | "
                             f"{row['grads'] / mib:.1f} | {row['optimizer'] / mib:.1f} | {total / mib:.1f} | "
                             f"{total / ddp:.2f} |")
        summary["memory"] = {"ddp": memory["ddp"], "pipeline": memory["pipeline"],
                             "largest_stage_over_ddp": max(sum(row.values()) for row in memory["pipeline"]) / ddp}
    return summary, "\n".join(lines) + "\n"


def measured(args: argparse.Namespace) -> list[dict]:
    """Every round's bubble cells (interleaved: a noisy neighbour weighs on every cell alike), then the memory counts
    once (the bytes do not vary between rounds)."""
    with tempfile.TemporaryDirectory() as workdir:
        runs = [run_once(args, Path(workdir), "bubble", round_) for round_ in range(1, args.rounds + 1)]
        return runs + ([run_once(args, Path(workdir), "memory", 1)] if args.memory_model else [])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if ran_as_worker(args, worker):
        return 0
    runs = measured(args)
    summary, table = summarise(args, runs)
    command = shlex.join(["python", "-m", "bench.pipeline", *(sys.argv[1:] if argv is None else argv)])
    header = {"command": command, "machine": describe_machine(), "date": now()}
    write_results(args.out, "pipeline", header, runs, summary,
                  f"`{command}` ({header['date']}; {header['machine']})\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
