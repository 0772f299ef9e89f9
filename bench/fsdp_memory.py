"""`python -m bench.fsdp_memory`: per-rank training state under --strategy ddp and fsdp, on CPU processes.

For each model, strategy and process count (interleaved, --rounds times) a torchrun of CPU processes
builds the model the trainer's way (trainer.strategy wraps it, trainer.optim builds SGD with
momentum), trains --steps steps on synthetic images and then counts, per rank, the bytes of what
that rank holds of the parameters, their gradients and the optimizer state (fsdp: its shards; ddp:
everything), and its peak resident memory. Reported: the medians, and fsdp/ddp at each count
(goal: at most 0.30 at 4 processes for ResNet-50 and a ViT). The state bytes do not vary between
rounds; the peak RSS does a little.

    python -m bench.fsdp_memory --models resnet50 vit_b_16 --nproc 1 2 4 --out bench/results

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

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "fsdp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from trainer.errors import OneLineErrorParser

    parser = OneLineErrorParser(prog="python -m bench.fsdp_memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--image-size", type=int, default=32, help="synthetic image side (ViTs: a multiple of 16)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=2, help="training steps before counting (optimizer state "
                        "exists after the first)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
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
    import torch

    from trainer import distributed
    from trainer.config import load_config
    from trainer.data import synthetic_spec
    from trainer.models import build_model
    from trainer.optim import build_optimizer
    from trainer.strategy import for_run

    ctx = distributed.setup(distributed.detect_topology(os.environ), "gloo", 600)
    cfg = load_config(["--model", args.model, "--strategy", args.strategy, "--env-file", "/dev/null",
                       "--synthetic-image-size", str(args.image_size), "--shm-allreduce", "false"],
                      {}, ctx.world_size)
    torch.manual_seed(0)
    model = build_model(args.model, synthetic_spec(args.image_size))
    forward = for_run(cfg, ctx, model).wrap(model)
    optimizer = build_optimizer(cfg, model)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 10, (args.batch_size,))
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(forward(images), labels).backward()
        optimizer.step()  # gradients kept: they are part of the state counted
    state = [t for per_param in optimizer.state.values() for t in per_param.values() if torch.is_tensor(t)]
    row = {"params": local_bytes(model.parameters()), "grads": local_bytes(p.grad for p in model.parameters()),
           "optimizer": local_bytes(state), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    rows = distributed.all_gather_objects(ctx, row)
    if ctx.is_main:
        Path(args.worker).write_text(json.dumps(rows) + "\n")
    distributed.teardown(ctx)


def run_once(model: str, strategy: str, nproc: int, args: argparse.Namespace, workdir: Path) -> dict:
    result = workdir / f"{model}-{strategy}-{nproc}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "bench.fsdp_memory", "--worker", str(result), "--model", model, "--strategy", strategy,
               "--image-size", str(args.image_size), "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(done.returncode if done.returncode > 0 else 1)
    rows = json.loads(result.read_text())
    state = [r["params"] + r["grads"] + r["optimizer"] for r in rows]
    return {"model": model, "strategy": strategy, "nproc": nproc, "state_bytes": max(state),
            "peak_rss": max(r["peak_rss"] for r in rows), "ranks": rows}


def summarise(runs: list[dict], args: argparse.Namespace) -> tuple[dict, str]:
    table = {}
    lines = ["| model | processes | ddp state/rank (MiB) | fsdp state/rank (MiB) | fsdp/ddp state | "
             "ddp peak RSS (MiB) | fsdp peak RSS (MiB) | fsdp/ddp RSS |", "|" + "---|" * 8]
    for model in args.models:
        for nproc in args.nproc:
            cell = {}
            for strategy in STRATEGIES:
                mine = [r for r in runs if (r["model"], r["strategy"], r["nproc"]) == (model, strategy, nproc)]
                cell[strategy] = {key: statistics.median(r[key] for r in mine) for key in ("state_bytes", "peak_rss")}
            ratios = {key: cell["fsdp"][key] / cell["ddp"][key] for key in ("state_bytes", "peak_rss")}
            table[f"{model}@{nproc}"] = {**cell, "fsdp/ddp": ratios}
            mib = 2 ** 20
            lines.append(f"| {model} | {nproc} | {cell['ddp']['state_bytes'] / mib:.1f} | "
                         f"{cell['fsdp']['state_bytes'] / mib:.1f} | {ratios['state_bytes']:.3f} | "
                         f"{cell['ddp']['peak_rss'] / mib:.0f} | {cell['fsdp']['peak_rss'] / mib:.0f} | "
                         f"{ratios['peak_rss']:.3f} |")
    return table, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from trainer.errors import exit_on_usage_error
    from trainer.scale import prepare_out

    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    with exit_on_usage_error():
        prepare_out(args.out)
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
