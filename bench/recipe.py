"""`python -m bench.recipe`: torchvision's reference recipe on real images, technique by technique.

The real MNIST test digits (../shared/data/mnist-t10k, 10,000 of them) split 8,000 for training and 2,000 for
validation, written as torchvision's MNIST files so that `--dataset mnist` reads them (the in-memory, GPU-resident
input path: mixup, cutmix and the per-sample policies run on the training device). The built-in loop trains the
same model for the same steps with each technique alone, then with all of them, the runs interleaved round by
round (plain, clip, smoothing, ..., all; plain, clip, ...): the validation accuracy of each (the model's, and the
EMA's where there is one), the step time of each over plain's (median samples/s, and the ratio within each round
with its distribution-free interval), and the CPU time of the whole run per step (torchrun and its workers, which
other work on a shared machine does not inflate as it does the wall time).

    python -m bench.recipe --rounds 3 --epochs 8            # 2 processes, cnn, 64 per process
    python -m bench.recipe --variants plain clip ema --rounds 5

The results (.md and .json) go to --out (bench/results by default).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.results import RESULTS, describe_machine, now, paired_ratios, write_results

MNIST_T10K = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist-t10k"
TRAIN_SIZE = 8000  # of the 10,000 test digits; the last 2,000 validate

# Each technique alone, by the reference's flags; "all": every one together (the recipe's values).
VARIANTS = {
    "plain": [],
    "clip": ["--clip-grad-norm", "1.0"],
    "smoothing": ["--label-smoothing", "0.1"],
    "mixup": ["--mixup-alpha", "0.2"],
    "cutmix": ["--cutmix-alpha", "1.0"],
    "ema": ["--model-ema"],
    "ta_wide": ["--auto-augment", "ta_wide"],
    "erase": ["--random-erase", "0.1"],
    "bias_decay": ["--bias-weight-decay", "0.0005"],
    "ra": ["--ra-sampler", "--ra-reps", "4"],
}
VARIANTS["all"] = [flag for name, flags in VARIANTS.items() if name != "plain" for flag in flags]
# Not the recipe's: an EMA for a short run (the reference's decay and cadence are tuned for 600 epochs).
VARIANTS["ema_every_step"] = ["--model-ema", "--model-ema-steps", "1", "--model-ema-decay", "0.999"]


def write_split(source: Path, root: Path) -> Path:
    """torchvision's MNIST layout (root/MNIST/raw, uncompressed IDX files): the first TRAIN_SIZE test digits as its
    training set, the rest as its test set."""
    raw = root / "MNIST" / "raw"
    if (raw / "t10k-labels-idx1-ubyte").is_file():
        return root
    raw.mkdir(parents=True, exist_ok=True)
    images = gzip.decompress((source / "t10k-images-idx3-ubyte.gz").read_bytes())
    labels = gzip.decompress((source / "t10k-labels-idx1-ubyte.gz").read_bytes())
    count = int.from_bytes(labels[4:8], "big")
    pixels = 28 * 28
    for prefix, first, last in (("train", 0, TRAIN_SIZE), ("t10k", TRAIN_SIZE, count)):
        n = last - first
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            (0x803).to_bytes(4, "big") + n.to_bytes(4, "big") + (28).to_bytes(4, "big") + (28).to_bytes(4, "big")
            + images[16 + first * pixels:16 + last * pixels])
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            (0x801).to_bytes(4, "big") + n.to_bytes(4, "big") + labels[8 + first:8 + last])
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_once(variant: str, args: argparse.Namespace, data: Path, workdir: Path) -> dict:
    workdir.mkdir(parents=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
               "--master-port", str(free_port()), "-m", "trainer", "--dataset", "mnist",
               "--data-dir", str(data), "--model", args.model, "--batch-size", str(args.batch_size),
               "--epochs", str(args.epochs), "--lr", str(args.lr), "--val-every", str(args.epochs),
               "--log-every", "50", "--checkpoint-every", "0", "--keep-checkpoints", "2", "--seed", str(args.seed),
               "--log-dir", str(workdir / "runs"), "--checkpoint-dir", str(workdir / "checkpoints"),
               *VARIANTS[variant], *shlex.split(args.extra)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    began, cpu_before = time.perf_counter(), children_cpu_s()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    cpu_s = children_cpu_s() - cpu_before
    if done.returncode:
        raise SystemExit(f"{variant} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((workdir / "runs" / "summary.json").read_text())
    return {"stack": variant, "nproc": args.nproc, "samples_per_second": summary["samples_per_second"],
            "global_step": summary["global_step"], "val_acc1": summary["val_acc1"], "val_loss": summary["val_loss"],
            "val_ema_acc1": summary["val_ema_acc1"], "train_loss": summary["train_loss"],
            "wall_s": round(time.perf_counter() - began, 1), "cpu_s": round(cpu_s, 2),
            "cpu_ms_per_step": 1000 * cpu_s / summary["global_step"], "flags": VARIANTS[variant]}


def children_cpu_s() -> float:
    """CPU seconds (user and system) of every finished child: torchrun and its workers, start-up to exit. On a
    machine whose cores other work shares, a run's wall time measures that work as much as this one; its CPU time
    does not (up to the caches the two share)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def table(runs: list[dict], variants: list[str], args: argparse.Namespace, header: dict) -> str:
    lines = [f"# bench.recipe, {header['date']}", "", f"{header['machine']}", "",
             f"`{header['command']}`", "",
             "| technique | flags | val acc@1 | EMA val acc@1 | val loss | median samples/s | step time / plain "
             "(ratio of medians) | within rounds: median (95% interval) | CPU ms per step (whole run, all processes) "
             "| CPU / plain, within rounds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    plain = statistics.median(r["samples_per_second"] for r in runs if r["stack"] == "plain")
    for variant in variants:
        mine = [r for r in runs if r["stack"] == variant]
        accs = sorted({round(r["val_acc1"], 4) for r in mine})
        emas = sorted({round(r["val_ema_acc1"], 4) for r in mine if r["val_ema_acc1"] is not None})
        speed = statistics.median(r["samples_per_second"] for r in mine)
        paired = paired_ratios(runs, args.nproc, "plain", variant) if variant != "plain" else None
        within = f"{paired['median']:.3f} ({paired['low']:.3f}-{paired['high']:.3f})" if paired else ""
        # paired_ratios reads samples_per_second: CPU time per step inverted, so that plain/variant is the ratio
        cpu_runs = [{**r, "samples_per_second": 1.0 / r["cpu_ms_per_step"]} for r in runs]
        cpu = paired_ratios(cpu_runs, args.nproc, "plain", variant) if variant != "plain" else None
        cpu_within = f"{cpu['median']:.3f} ({cpu['low']:.3f}-{cpu['high']:.3f})" if cpu else ""
        lines.append(f"| {variant} | `{' '.join(VARIANTS[variant]) or '(none)'}` | "
                     f"{'/'.join(f'{a:.4f}' for a in accs)} | {'/'.join(f'{a:.4f}' for a in emas) or '-'} | "
                     f"{statistics.median(r['val_loss'] for r in mine):.4f} | {speed:.1f} | {plain / speed:.3f} | "
                     f"{within} | {statistics.median(r['cpu_ms_per_step'] for r in mine):.1f} | {cpu_within} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recipe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS)[:-1])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of every variant")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per process per step")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process")
    parser.add_argument("--extra", default="", help="trainer options every variant gets")
    parser.add_argument("--data", type=Path, default=MNIST_T10K, help="the folder of t10k-*-idx*-ubyte.gz")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if "plain" not in args.variants:
        args.variants.insert(0, "plain")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = args.out / f"recipe-work-{stamp}"
    data = write_split(args.data, args.out / "mnist-8k-2k")
    header = {"date": now(), "machine": describe_machine(),
              "command": "python -m bench.recipe " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))}
    runs = []
    for number in range(1, args.rounds + 1):
        for variant in args.variants:
            run = run_once(variant, args, data, work / f"{number}-{variant}")
            run["round"] = number
            runs.append(run)
            ema = "" if run["val_ema_acc1"] is None else f" (EMA {run['val_ema_acc1']:.4f})"
            print(f"round {number} {variant}: acc1 {run['val_acc1']:.4f}{ema}, "
                  f"{run['samples_per_second']:.1f} samples/s, {run['wall_s']} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out, "recipe", header, runs, {}, table(runs, args.variants, args, header))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
