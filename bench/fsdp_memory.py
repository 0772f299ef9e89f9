"""`python -m bench.fsdp_memory`: per-rank training state under --strategy ddp and fsdp, on CPU processes.

For each model, strategy and process count (interleaved, --rounds times) a torchrun of CPU processes
builds the model the trainer's way (trainer.parallel.strategy wraps it, trainer.engine.optim builds SGD with
momentum), trains --steps steps on synthetic images and then counts, per rank, the bytes of what
that rank holds of the parameters, their gradients and the optimizer state (fsdp: its shards; ddp:
everything), and its peak resident memory. Reported: the medians, and fsdp/ddp at each count
(goal: at most 0.30 at 4 processes for ResNet-50 and a ViT). The state bytes do not vary between
rounds; the peak RSS does a little.

    python -m bench.fsdp_memory --models resnet50 vit_b_16 --nproc 1 2 4 --out bench/results

On a GPU (bench/gpu.sh section 6) the same runs use CUDA and nccl, --trainer-args pass settings such
as '--amp bf16 --activation-checkpointing' to both strategies and --fsdp-args to fsdp alone, and
--keep-going records a run that fails (out of memory) instead of stopping: the largest model that
trains under fsdp and not under ddp.

Throughput fsdp/ddp is the main harness's job, side by side and interleaved:

    python -m bench --nproc 2 --stacks trainer baseline --model resnet50 --batch-size 32 --steps 30 \\
        --trainer-args '--strategy fsdp' --baseline-args '--strategy ddp'      # trainer/baseline = fsdp/ddp
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.results import RESULTS, ran_as_worker, worker_env

STRATEGIES = ("ddp", "fsdp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from trainer.core.errors import OneLineErrorParser

    parser = OneLineErrorParser(prog="python -m bench.fsdp_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--image-size", type=int, default=32, help="synthetic image side (ViTs: a multiple of 16)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=2, help="training steps before counting (optimizer state "
                        "exists after the first)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--trainer-args", default="", help="trainer settings for both strategies")
    parser.add_argument("--fsdp-args", default="", help="trainer settings for fsdp alone, e.g. --fsdp-cpu-offload")
    parser.add_argument("--keep-going", action="store_true", help="record a failed run and go on")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)  # one run, under torchrun
    parser.add_argument("--strategy", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    """One run: rank 0 writes every rank's numbers to args.worker."""
    import time

    import torch

    from trainer.cluster.topology import WORKER, resolve
    from trainer.config.settings import load_config
    from trainer.data.images import synthetic_spec
    from trainer.parallel import collectives
    from trainer.parallel.context import setup, teardown
    from trainer.parallel.strategy import for_run
    from trainer.engine.models import build_model
    from trainer.engine.optim import build_optimizer

    ctx = setup(resolve(os.environ, WORKER), "auto", 600)
    extra = shlex.split(args.trainer_args) + (shlex.split(args.fsdp_args) if args.strategy == "fsdp" else [])
    cfg = load_config(["--model", args.model, "--strategy", args.strategy, "--env-file", "/dev/null",
                       "--synthetic-image-size", str(args.image_size), "--shm-allreduce", "false", *extra],
                      {}, ctx.world_size)
    torch.manual_seed(0)
    model = build_model(args.model, synthetic_spec(args.image_size))
    forward = for_run(cfg, ctx, model).wrap(model)
    optimizer = build_optimizer(cfg, model)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=ctx.device)
    labels = torch.randint(0, 10, (args.batch_size,), device=ctx.device)
    bf16 = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16")
    started = 0.0
    for step in range(args.steps):
        if step == 1:  # the first step (allocation, compilation) is not timed
            torch.cuda.synchronize() if ctx.device.type == "cuda" else None
            started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with bf16:
            loss = torch.nn.functional.cross_entropy(forward(images).float(), labels)
        loss.backward()
        optimizer.step()  # gradients kept: they are part of the state counted
    torch.cuda.synchronize() if ctx.device.type == "cuda" else None
    seconds = time.perf_counter() - started
    state = [t for per_param in optimizer.state.values() for t in per_param.values() if torch.is_tensor(t)]
    row = {"params": local_bytes(model.parameters()), "grads": local_bytes(p.grad for p in model.parameters()),
           "optimizer": local_bytes(state), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "peak_gpu": torch.cuda.max_memory_allocated() if ctx.device.type == "cuda" else 0,
           "samples_per_second": (args.steps - 1) * args.batch_size * ctx.world_size / seconds if seconds else 0.0,
           "loss": loss.item()}
    rows = collectives.all_gather_objects(ctx, row)
    if ctx.is_main:
        Path(args.worker).write_text(json.dumps(rows) + "\n")
    teardown(ctx)


def run_once(model: str, strategy: str, nproc: int, args: argparse.Namespace, workdir: Path) -> dict:
    result = workdir / f"{model}-{strategy}-{nproc}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "bench.fsdp_memory", "--worker", str(result), "--model", model, "--strategy", strategy,
               "--image-size", str(args.image_size), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               f"--trainer-args={args.trainer_args}", f"--fsdp-args={args.fsdp_args}"]
    print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, cwd=workdir, env=worker_env(os.environ.get("OMP_NUM_THREADS", "1")),
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        if args.keep_going:
            print(f"failed: {model} {strategy} at {nproc} (exit {done.returncode})", flush=True)
            return {"model": model, "strategy": strategy, "nproc": nproc, "failed": True}
        raise SystemExit(done.returncode if done.returncode > 0 else 1)
    rows = json.loads(result.read_text())
    state = [r["params"] + r["grads"] + r["optimizer"] for r in rows]
    return {"model": model, "strategy": strategy, "nproc": nproc, "state_bytes": max(state),
            "peak_rss": max(r["peak_rss"] for r in rows), "peak_gpu": max(r["peak_gpu"] for r in rows),
            "samples_per_second": rows[0]["samples_per_second"], "ranks": rows, "failed": False}


def summarise(runs: list[dict], args: argparse.Namespace) -> tuple[dict, str]:
    table = {}
    keys = ("state_bytes", "peak_rss", "peak_gpu", "samples_per_second")
    lines = ["| model | processes | ddp state/rank (MiB) | fsdp state/rank (MiB) | fsdp/ddp state | "
             "ddp peak RSS (MiB) | fsdp peak RSS (MiB) | ddp peak GPU (MiB) | fsdp peak GPU (MiB) | "
             "fsdp/ddp samples/s |", "|" + "---|" * 10]
    mib = 2 ** 20

    def shown(cell: dict | None, key: str, scale: float = mib, digits: int = 1) -> str:
        return "failed" if cell is None else f"{cell[key] / scale:.{digits}f}"

    for model in args.models:
        for nproc in args.nproc:
            cell: dict[str, dict | None] = {}
            for strategy in STRATEGIES:
                mine = [r for r in runs if (r["model"], r["strategy"], r["nproc"]) == (model, strategy, nproc)]
                good = [r for r in mine if not r["failed"]]
                cell[strategy] = {key: statistics.median(r[key] for r in good) for key in keys} if good else None
            ratios = {key: cell["fsdp"][key] / cell["ddp"][key] if cell["ddp"] and cell["fsdp"] and cell["ddp"][key]
                      else None for key in keys}
            table[f"{model}@{nproc}"] = {**cell, "fsdp/ddp": ratios}
            ratio = lambda key, ratios=ratios: "-" if ratios[key] is None else f"{ratios[key]:.3f}"  # noqa: E731
            lines.append(f"| {model} | {nproc} | {shown(cell['ddp'], 'state_bytes')} | "
                         f"{shown(cell['fsdp'], 'state_bytes')} | {ratio('state_bytes')} | "
                         f"{shown(cell['ddp'], 'peak_rss', digits=0)} | {shown(cell['fsdp'], 'peak_rss', digits=0)} | "
                         f"{shown(cell['ddp'], 'peak_gpu', digits=0)} | {shown(cell['fsdp'], 'peak_gpu', digits=0)} | "
                         f"{ratio('samples_per_second')} |")
    return table, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if ran_as_worker(args, worker):
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.rounds):  # interleaved: a noisy neighbour weighs on every cell alike
            for model in args.models:
                for nproc in args.nproc:
                    for strategy in STRATEGIES:
                        runs.append(run_once(model, strategy, nproc, args, Path(workdir)))
    table, markdown = summarise(runs, args)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    command = shlex.join(["python", "-m", "bench.fsdp_memory", *(sys.argv[1:] if argv is None else argv)])
    (args.out / f"fsdp-memory-{stamp}.md").write_text(f"`{command}`\n\n{markdown}")
    (args.out / f"fsdp-memory-{stamp}.json").write_text(json.dumps({"command": command, "table": table,
                                                                    "runs": runs}, indent=1) + "\n")
    print(markdown, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
