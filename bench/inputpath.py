"""`python -m bench --input`: the input path alone (no model, no training), in images per second per core.

Each path reads the same files with the same augmentation through the trainer's own Batches (workers,
collation, the device copy and normalisation included): `pil` is the reference (PIL + torchvision
transforms, --decode pil), `cpu` the fast CPU path (--decode cpu), `packed` the same folder packed by
trainer-pack (--dataset packed), `gpu` nvJPEG on the GPU (--decode gpu; CUDA only). Runs are interleaved
(pil, cpu, packed, pil, ...) and each run times a window of batches after a warm-up; per core is images
over the CPU seconds the run's process and its DataLoader workers spent in that window, which other work
on a shared machine disturbs far less than wall-clock rates. Every path's median is reported with its
ratio to the median of pil, and the wall-clock images/s beside it. Without --data, an ImageNet-like folder
(500x375 JPEGs of about 80 KiB, 10 classes) is generated once under --out and reused.
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

from bench.results import RESULTS, describe_machine, now, write_results
from trainer.cli.scale import prepare_out
from trainer.core.errors import OneLineErrorParser, UsageError, exit_on_usage_error

REPO = Path(__file__).resolve().parents[1]
PATHS = ("pil", "cpu", "packed", "gpu")
BASELINE = "pil"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m bench --input", description=__doc__.split("\n\n")[0])
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=None,
                        help="input paths (default: pil cpu packed, and gpu where CUDA is available)")
    parser.add_argument("--data", type=Path, default=None, help="an image folder (train/<class>/*); default: "
                        "an ImageNet-like folder generated under --out")
    parser.add_argument("--images", type=int, default=1000, help="training images of the generated folder")
    parser.add_argument("--max-side", type=int, default=256, help="trainer-pack --max-side for the packed path")
    parser.add_argument("--split", choices=("train", "val"), default="train",
                        help="train: random-resized crops + flips; val: resize + centre crop")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (--num-workers)")
    parser.add_argument("--batches", type=int, default=12, help="timed batches per run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches first (workers start, queues fill)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of every path (at least 3)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--make-data", type=Path, metavar="DIR", help="only generate the ImageNet-like folder "
                        "(--images of them) in DIR, then exit (bench/gpu.sh trains on it)")
    parser.add_argument("--one", choices=PATHS, help=argparse.SUPPRESS)  # a single run, in a child process
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--gpu-share", type=float, default=1.0, help=argparse.SUPPRESS)  # --decode-gpu-share
    args = parser.parse_args(argv)
    if args.one or args.make_data:
        return args
    if args.rounds < 3:
        raise UsageError("--rounds", f"{args.rounds} is too few for a median", "give 3 or more")
    for setting, value in (("--images", args.images), ("--batch-size", args.batch_size), ("--batches", args.batches),
                           ("--image-size", args.image_size), ("--warmup", args.warmup)):  # warm-up: the window's start
        if value < 1:
            raise UsageError(setting, f"{value} is below 1", "give 1 or more")
    if args.workers < 0:
        raise UsageError("--workers", f"{args.workers} is below 0", "give 0 or more")
    if args.data is not None and not (args.data / "train").is_dir():
        raise UsageError("--data", f"'{args.data}' has no train/ folder", "give an image folder's root")
    if args.paths is None:
        import torch

        args.paths = ["pil", "cpu", "packed"] + (["gpu"] if torch.cuda.is_available() else [])
    if "gpu" in args.paths:
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--paths", "gpu needs CUDA, and torch sees no GPU here", "leave gpu out")
    return args


# ------------------------------------------------------------------------------------------ one run

def cpu_ticks() -> int:
    """CPU clock ticks of this process, its live descendants and its reaped children."""
    me = os.getpid()
    parents, ticks = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            parents[int(entry.name)] = int(fields[1])
            ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    family, grew = {me}, True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in family and pid not in family:
                family.add(pid)
                grew = True
    times = os.times()
    reaped = round((times.children_user + times.children_system) * os.sysconf("SC_CLK_TCK"))
    return sum(ticks.get(pid, 0) for pid in family) + reaped


def run_one(args: argparse.Namespace) -> dict:
    """One path's window of batches, in this process (a child of the harness)."""
    import torch

    from trainer.cluster.topology import WORKER, resolve
    from trainer.config.settings import load_config
    from trainer.data.datasets import Batches, build_datasets
    from trainer.parallel.context import DistContext

    device = torch.device("cuda" if args.one == "gpu" else "cpu")
    dataset = ["--dataset", "packed"] if args.one == "packed" else ["--dataset", "imagefolder", "--decode", args.one]
    if args.one == "gpu":
        dataset += ["--decode-gpu-share", str(args.gpu_share)]
    cfg = load_config(["--env-file", os.devnull, *dataset, "--data-dir", str(args.root), "--image-size",
                       str(args.image_size), "--batch-size", str(args.batch_size), "--num-workers",
                       str(args.workers)], {}, world_size=1)
    ctx = DistContext(resolve({}, WORKER), "none", device)  # one process, no process group
    train, val, spec = build_datasets(cfg, ctx)
    # The dataset decides the transforms (its split's); Batches' training mode keeps the workers alive
    # between epochs, so a small validation split times decoding, not worker start-up.
    batches = Batches(train if args.split == "train" else val, spec, cfg, ctx, train=True)
    wanted, seen, epoch = args.warmup + args.batches, 0, 0
    start_ticks, start_wall, images = 0, 0.0, 0
    while seen < wanted:
        for inputs, _ in batches.epoch(epoch):
            seen += 1
            if seen > args.warmup:
                images += len(inputs)
            if seen == args.warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start_ticks, start_wall = cpu_ticks(), time.perf_counter()
            if seen == wanted:
                break
        epoch += 1
        if epoch > 1000:
            raise UsageError("--batches", "the folder holds too few images for one batch", "use more images")
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall, ticks = time.perf_counter() - start_wall, cpu_ticks() - start_ticks
    cpu_seconds = max(ticks, 1) / os.sysconf("SC_CLK_TCK")
    return {"path": args.one, "images": images, "wall_seconds": wall, "cpu_seconds": cpu_seconds,
            "images_per_core_second": images / cpu_seconds, "images_per_second": images / wall}


# ---------------------------------------------------------------------------------------- harness

def prepare_data(args: argparse.Namespace) -> tuple[Path, Path | None, dict]:
    """The folder (generated once) and its pack (made once, timed: packing's CPU time per image)."""
    from bench.common import imagenet_like_folder
    from trainer.data.pack import pack, shrink

    facts: dict = {}
    root = args.data
    if root is None:
        root = args.out / f"input-data-{args.images}"
        if not (root / "done").exists():
            print(f"generating {args.images} ImageNet-like JPEGs in {root} (once)", file=sys.stderr, flush=True)
            import shutil

            shutil.rmtree(root, ignore_errors=True)
            imagenet_like_folder(root, args.images, workers=os.cpu_count() or 1)
            (root / "done").write_text("")
    files = [p for p in (root / "train").rglob("*") if p.is_file()]
    facts["train_files"] = len(files)
    facts["mean_file_kib"] = sum(p.stat().st_size for p in files) / len(files) / 1024
    packed = None
    if "packed" in args.paths:
        packed = Path(str(root).rstrip("/") + f".packed-{args.max_side}")
        if not (packed / "pack.json").exists():
            print(f"packing {root} into {packed} (once)", file=sys.stderr, flush=True)
            pack(root, packed, args.max_side, workers=os.cpu_count() or 1, progress=False)
        header = json.loads((packed / "pack.json").read_text())
        count = sum(s["images"] for s in header["splits"].values())
        size = sum(s["pixels_bytes"] + s["index_bytes"] for s in header["splits"].values())
        facts["packed_bytes_per_image"] = size / count
        # Packing's cost per image and core: trainer-pack's decode + shrink of one file, in this process.
        sample = sorted(files)[:100]
        started = time.process_time()
        for path in sample:
            shrink(str(path), args.max_side)
        facts["pack_cpu_ms_per_image"] = 1000 * (time.process_time() - started) / len(sample)
    return root, packed, facts


def run_child(path: str, root: Path, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-input-") as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "bench.inputpath", "--one", path, "--root", str(root), "--result",
                   str(result), "--split", args.split, "--image-size", str(args.image_size), "--batch-size",
                   str(args.batch_size), "--workers", str(args.workers), "--batches", str(args.batches),
                   "--warmup", str(args.warmup)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_")}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
        done = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            print(f"+ {shlex.join(command)}  # the {path} run that failed", file=sys.stderr)
            raise SystemExit(done.returncode)
        return json.loads(result.read_text())


def summarise(runs: list[dict], paths: list[str]) -> dict:
    summary: dict = {"paths": {}, "ratios": {}}
    for path in paths:
        mine = [r for r in runs if r["path"] == path]
        per_core = [r["images_per_core_second"] for r in mine]
        summary["paths"][path] = {"median_per_core": statistics.median(per_core), "min": min(per_core),
                                  "max": max(per_core), "median_wall": statistics.median(r["images_per_second"]
                                                                                         for r in mine),
                                  "runs": per_core}
    if BASELINE in summary["paths"]:
        base = summary["paths"][BASELINE]
        for path, s in summary["paths"].items():
            if path != BASELINE:
                summary["ratios"][f"{path}/{BASELINE}"] = {
                    "per_core": s["median_per_core"] / base["median_per_core"],
                    "wall": s["median_wall"] / base["median_wall"]}
    return summary


def markdown(summary: dict, header: dict) -> str:
    facts = header["data"]
    lines = [f"`{header['command']}`  ", f"{header['date']}, {header['machine']}  ",
             f"{facts['train_files']} files of {facts['mean_file_kib']:.0f} KiB on average; {header['settings']}", "",
             "| path | median images/s per core | min-max | median images/s (wall) | per core vs pil | wall vs pil |",
             "|---|---|---|---|---|---|"]
    for path, s in summary["paths"].items():
        ratio = summary["ratios"].get(f"{path}/{BASELINE}")
        shown = (f"{ratio['per_core']:.2f}x", f"{ratio['wall']:.2f}x") if ratio else ("1", "1")
        lines.append(f"| {path} | {s['median_per_core']:.1f} | {s['min']:.1f}-{s['max']:.1f} | "
                     f"{s['median_wall']:.1f} | {shown[0]} | {shown[1]} |")
    if "packed_bytes_per_image" in facts:
        lines += ["", f"- packed: {facts['packed_bytes_per_image'] / 1024:.1f} KiB per image"
                  + (f", packing {facts['pack_cpu_ms_per_image']:.2f} ms of CPU per image"
                     if "pack_cpu_ms_per_image" in facts else "")]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    with exit_on_usage_error():
        args = parse_args(argv)
        if args.one:
            result = run_one(args)
            args.result.write_text(json.dumps(result) + "\n")
            return 0
        if args.make_data:
            from bench.common import imagenet_like_folder

            imagenet_like_folder(args.make_data, args.images, workers=os.cpu_count() or 1)
            return 0
        prepare_out(args.out)

    root, packed, facts = prepare_data(args)
    settings = (f"{args.split}, {args.image_size} px, batch {args.batch_size}, {args.workers} workers, "
                f"{args.batches} timed batches after {args.warmup}")
    header = {"command": shlex.join(["python", "-m", "bench", "--input", *argv]),
              "date": now(), "machine": describe_machine(),
              "settings": settings, "data": facts}
    runs = []
    for round_number in range(1, args.rounds + 1):
        for path in args.paths:
            result = run_child(path, packed if path == "packed" else root, args)
            runs.append({"round": round_number, **result})
            print(f"round {round_number}/{args.rounds}  {path:<7} {result['images_per_core_second']:8.1f} images/s "
                  f"per core  {result['images_per_second']:8.1f} images/s", file=sys.stderr, flush=True)
    summary = summarise(runs, args.paths)
    table = markdown(summary, header)
    write_results(args.out, "input", header, runs, summary, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
