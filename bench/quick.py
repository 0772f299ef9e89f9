"""`python -m bench.quick` (`bash bench/gpu.sh quick`): the GPU measurements this stack owes, in one call that
fits a short GPU window, into one JSON file.

One round per run: on one GPU a round is as stable as three (ResNet-50's two rounds on an H200 read 6,349.2 and
6,348.1 samples/s, 2026-11-27), and every round starts fresh processes (imports, model build, torch.compile:
about 50 s for ResNet-50 there), so three rounds of every part did not fit (5 of 6 parts timed out). The parts
run in order of value, each within its budget plus whatever the earlier parts left (the whole within
TOTAL_BUDGET_S, start-up of every run included), so a window cut short still returns the first numbers. The
JSON is rewritten after every run: a part that runs out of time keeps the runs it finished, and the run it cut
short says how far it got (its last logged interval).

    python -m bench.quick              # on the GPU: writes $OUT/quick-<time>.json (or bench/results/)
    python -m bench.quick --dry-run    # the plan (commands, budgets), anywhere; starts nothing
    python -m bench.quick --rehearse   # the same machinery on this CPU at toy sizes (the tests run it)

Parts, in order:
  jpeg-set         a folder of ImageNet-like JPEGs (500x375, about 80 KiB; each file listed LINKS times by hard
                   links, so a run of STEPS steps crosses no epoch boundary), made once and timed
  input-compiled   ResNet-50, bf16 + channels_last + compile (the recommended settings): synthetic tensors, then
                   the JPEG folder with --decode gpu, then with --decode cpu (15 workers); ratios to synthetic,
                   over the whole window and over the last logged interval (after the loader's prefetched
                   batches are used up); per-rank step timing on CUDA events from the synthetic run's summary
  inplace-nccl     in place over NCCL on GPU 0 (bench.goodput --one): two hosts of one process each, RECOVERY=in-place,
                   the second SIGKILLed after 5 s of training and started again; the replica group named, the lost
                   progress, the pause at the return, both hosts' exit codes (not rehearsed: it needs CUDA)
  input-alone      the input path without a model (bench.inputpath): --decode cpu images/s per core (the CPU
                   path's ceiling), --decode gpu and --decode-gpu-share 0.65 images/s
  fsdp-vs-ddp      ResNet-50 bf16 + channels_last, eager, one GPU: ddp then fsdp, each with a torch.profiler
                   trace of one step, summarised (top kernels, GPU busy time, the gaps between kernels)
  user-model       (leftover time only) the factory door (bench.usermodel:build) with --compile against without
  handwritten      (leftover time only) the fp32 hand-written DDP loop (bench/handwritten.py), ResNet-50, for the record
  jpeg-gpu-hybrid  (leftover time only) the compiled JPEG run with --decode-gpu-share 0.65
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.results import RESULTS
from trainer.core.errors import OneLineErrorParser, UsageError, exit_on_usage_error
from trainer.core.files import write_json_atomic

REPO = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 420  # the GPU window's share for this check: a 15-minute lease less start-up and a rerun
HYBRID_SHARE = 0.65   # DALI's default hw_decoder_load: the share of each batch the GPU's decoder takes


@dataclass
class Run:
    name: str
    command: list[str]
    kind: str  # trainer: a run of the built-in loop (summary.json, metrics.csv); result: a script's result.json
    env: dict[str, str] = field(default_factory=dict)
    needs_cuda: bool = False


@dataclass
class Part:
    name: str
    budget_s: int
    runs: list[Run]
    ratios: list[tuple[str, str, str]] = field(default_factory=list)  # (name, run a, run b): a / b
    leftover_only: bool = False  # runs only on what the earlier parts left


@dataclass
class Scale:
    """Sizes of one plan: the GPU's, or the rehearsal's toy ones (this CPU, minutes)."""
    model: str
    image_size: int
    batch_size: int
    steps: int
    log_every: int
    profile_step: int
    eager_steps: int
    fast: list[str]  # the recommended settings
    compile: list[str]
    workers: int
    images: int
    links: int
    photo: tuple[int, int]
    threads: int
    usermodel: str
    handwritten_steps: int
    input_batches: int
    inplace: list[str]  # bench.goodput's flags for the inplace-nccl part


def gpu_scale(cpus: int) -> Scale:
    # 200 steps of 256: 51,200 images, 8 s at 6,349 img/s. The loader's workers prefetch 4 batches each (60 with
    # 15 workers) while the model compiles, so the last logged interval (steps 151-200) is the steady state.
    return Scale(model="resnet50", image_size=224, batch_size=256, steps=200, log_every=50, profile_step=25,
                 eager_steps=30, fast=["--amp", "bf16", "--channels-last"], compile=["--compile"],
                 workers=max(1, min(15, cpus - 1)), images=4000, links=13, photo=(500, 375), threads=4,
                 usermodel="bench.usermodel:build", handwritten_steps=25, input_batches=20,
                 # Guessed, no GPU having run it: the return's start (launcher, CUDA, model, NCCL's child) is
                 # about as long as the survivor's time alone, and the job must outlast it. A job that ends before
                 # the return joins has no pause at the return; one still training at the deadline has no exits:
                 # the JSON says which, and the first GPU run sizes the steps for the next.
                 inplace=["--model", "resnet18", "--image-size", "224", "--batch-size", "64", "--steps", "600",
                          "--fault-every", "5", "--down-for", "0", "--checkpoint-every", "100", "--threads", "4"])


def rehearsal_scale(cpus: int) -> Scale:
    return Scale(model="cnn", image_size=32, batch_size=8, steps=12, log_every=4, profile_step=7, eager_steps=8,
                 fast=[], compile=[], workers=1, images=24, links=4, photo=(80, 60), threads=1, usermodel="cnn",
                 handwritten_steps=8, input_batches=3,
                 inplace=["--model", "cnn", "--image-size", "32", "--batch-size", "8", "--steps", "300",
                          "--fault-every", "3", "--down-for", "0", "--checkpoint-every", "50"])


def plan(scale: Scale, work: Path, python: str) -> list[Part]:
    from trainer.cli.scale import torchrun_command

    jpegs = work / "jpegs"
    threads = {"OMP_NUM_THREADS": str(scale.threads)}

    def trainer(name: str, extra: list[str], steps: int | None = None, model: str | None = None,
                needs_cuda: bool = False) -> Run:
        steps = steps or scale.steps
        folder = work / "runs" / name
        flags = ["--model", model or scale.model, "--batch-size", str(scale.batch_size), "--max-steps", str(steps),
                 "--synthetic-size", str(steps * scale.batch_size), "--synthetic-image-size", str(scale.image_size),
                 "--val-every", "0", "--log-every", str(scale.log_every), "--checkpoint-every", "0",
                 "--resume", "never", "--tracker", "csv", "--log-dir", str(folder / "runs"),
                 "--checkpoint-dir", str(folder / "checkpoints"), "--env-file", os.devnull, *extra]
        return Run(name, [*torchrun_command(1), "-m", "trainer", *flags], "trainer", threads, needs_cuda=needs_cuda)

    jpeg = ["--dataset", "imagefolder", "--data-dir", str(jpegs), "--image-size", str(scale.image_size),
            "--num-workers", str(scale.workers)]
    recommended = [*scale.fast, *scale.compile]
    profiled = ["--profile-steps", f"{scale.profile_step}:{scale.profile_step}"]
    input_alone = [python, "-m", "bench.inputpath", "--root", str(jpegs), "--split", "train", "--image-size",
                   str(scale.image_size), "--batch-size", str(scale.batch_size), "--workers", str(scale.workers),
                   "--batches", str(scale.input_batches), "--warmup", "4"]
    handwritten = [*torchrun_command(1), "-m", "bench.handwritten", "--model", scale.model, "--batch-size",
                   str(scale.batch_size), "--steps", str(scale.handwritten_steps), "--image-size",
                   str(scale.image_size), "--result", str(work / "runs" / "handwritten" / "result.json")]
    inplace_budget = 90
    inplace = [python, "-m", "bench.goodput", "--one", str(work / "runs" / "inplace-nccl.json"), *scale.inplace,
               "--timeout", str(inplace_budget - 15)]  # its own deadline first: it writes what it measured
    make = [python, "-m", "bench.quick", "--make-jpegs", str(jpegs), "--images", str(scale.images), "--links",
            str(scale.links), "--photo", f"{scale.photo[0]}x{scale.photo[1]}"]
    return [
        Part("jpeg-set", 45, [Run("make", make, "make")]),
        Part("input-compiled", 170, [
            trainer("synthetic", recommended),
            trainer("jpeg-gpu", [*recommended, *jpeg, "--decode", "gpu"], needs_cuda=True),
            trainer("jpeg-cpu", [*recommended, *jpeg, "--decode", "cpu"]),
        ], [("jpeg-gpu/synthetic", "jpeg-gpu", "synthetic"), ("jpeg-cpu/synthetic", "jpeg-cpu", "synthetic")]),
        # In place on the GPU (RECOVERY=in-place asked explicitly: not the default on GPUs until this has run),
        # over NCCL (torchft's baby NCCL group): two hosts of one process each on GPU 0, one lost and started again.
        # Not rehearsed on the CPU (its gloo twin is tests/test_bench.py's bench.goodput --one test).
        Part("inplace-nccl", inplace_budget, [Run("two-replicas", inplace, "result", needs_cuda=True)]),
        Part("input-alone", 45, [
            Run("cpu", [*input_alone, "--one", "cpu", "--result", str(work / "runs" / "alone-cpu.json")], "input"),
            Run("gpu", [*input_alone, "--one", "gpu", "--result", str(work / "runs" / "alone-gpu.json")], "input",
                needs_cuda=True),
            Run("gpu-hybrid", [*input_alone, "--one", "gpu", "--gpu-share", str(HYBRID_SHARE), "--result",
                               str(work / "runs" / "alone-gpu-hybrid.json")], "input", needs_cuda=True),
        ]),
        Part("fsdp-vs-ddp", 70, [
            trainer("ddp", ["--strategy", "ddp", *scale.fast, *profiled], steps=scale.eager_steps),
            trainer("fsdp", ["--strategy", "fsdp", *scale.fast, *profiled], steps=scale.eager_steps),
        ], [("fsdp/ddp", "fsdp", "ddp")]),
        # On what the parts before left (inplace-nccl took their 70 s of budgets: 40 s and 30 s were theirs).
        Part("user-model", 0, [
            trainer("user-compiled", recommended, steps=scale.eager_steps, model=scale.usermodel),
            trainer("user-eager", scale.fast, steps=scale.eager_steps, model=scale.usermodel),
        ], [("compiled/eager", "user-compiled", "user-eager")], leftover_only=True),
        Part("handwritten", 0, [Run("handwritten", handwritten, "result", threads)],
             [("recommended/handwritten-fp32", "input-compiled:synthetic", "handwritten")], leftover_only=True),
        Part("jpeg-gpu-hybrid", 0, [trainer("jpeg-gpu-hybrid", [*recommended, *jpeg, "--decode", "gpu",
                                                                "--decode-gpu-share", str(HYBRID_SHARE)],
                                            needs_cuda=True)],
             [("jpeg-gpu-hybrid/synthetic", "jpeg-gpu-hybrid", "input-compiled:synthetic")], leftover_only=True),
    ]


# ------------------------------------------------------------------------------------------ reading results

def interval_rates(metrics_csv: Path) -> list[float]:
    """throughput/samples_per_s at each logged step, in order (the rate over the interval that ended there)."""
    if not metrics_csv.is_file():
        return []
    rows = [row for row in csv.DictReader(metrics_csv.open()) if row.get("tag") == "throughput/samples_per_s"]
    return [float(row["value"]) for row in sorted(rows, key=lambda row: int(row["step"]))]


def trace_summary(trace_file: Path, top: int = 8) -> dict:
    """One profiled step: the device's busiest kernels (CPU ops on a CPU run), how much of the step the device
    was busy, and the gaps between its kernels (launch overhead, syncs, the host's own work)."""
    events = json.loads(trace_file.read_text()).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    on = "kernel"
    if not kernels:
        kernels, on = [e for e in events if e.get("cat") == "cpu_op" and "dur" in e], "cpu_op"
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#") and "dur" in e]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(str(e["name"])[:120], []).append(float(e["dur"]))
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, gaps, end = 0.0, [], None
    for start, stop in spans:  # the union of the kernels' intervals, and the idle gaps between them
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    step_us = max((float(e["dur"]) for e in steps), default=window)
    return {"events": on, "count": len(kernels), "step_ms": step_us / 1000, "busy_ms": busy / 1000,
            "busy_of_window": busy / window if window else None, "gaps": len(gaps), "gap_ms": sum(gaps) / 1000,
            "largest_gaps_ms": [g / 1000 for g in sorted(gaps, reverse=True)[:5]],
            "top": [{"name": name, "calls": len(durs), "total_ms": sum(durs) / 1000} for name, durs in ranked]}


def read_run(run: Run, cwd: Path, work: Path) -> dict:
    facts: dict = {}
    if run.kind == "trainer":
        folder = work / "runs" / run.name / "runs"
        rates = interval_rates(folder / "metrics.csv")
        if rates:
            facts["interval_samples_per_second"] = rates
            facts["last_interval_samples_per_second"] = rates[-1]
        summary_file = folder / "summary.json"
        if summary_file.is_file():
            summary = json.loads(summary_file.read_text())
            facts["samples_per_second"] = summary.get("samples_per_second")
            if summary.get("ranks"):
                rank = summary["ranks"][0]
                facts["rank0"] = rank
                facts["timed_on_cuda"] = bool(rank.get("compute_ms") and rank.get("max_memory_mb"))
        traces = sorted((folder / "profile").glob("rank0.*.json")) if (folder / "profile").is_dir() else []
        if traces:
            facts["profile"] = trace_summary(traces[-1])
    elif run.kind == "make":
        made = Path(run.command[run.command.index("--make-jpegs") + 1]) / "made.json"
        if made.is_file():
            facts.update(json.loads(made.read_text()))
    elif run.kind in ("result", "input"):
        result = next((Path(a) for a in run.command if a.endswith(".json")), None)
        if result is not None and result.is_file():
            facts.update(json.loads(result.read_text()))
    return facts


def ratio(parts: dict, part: str, a: str, b: str) -> dict | None:
    def find(name: str) -> dict | None:
        where, _, run = name.rpartition(":")
        return parts.get(where or part, {}).get("runs", {}).get(run)

    first, second = find(a), find(b)
    if not first or not second or not second.get("samples_per_second") or not first.get("samples_per_second"):
        return None
    out = {"whole_window": first["samples_per_second"] / second["samples_per_second"]}
    if first.get("last_interval_samples_per_second") and second.get("last_interval_samples_per_second"):
        out["last_interval"] = first["last_interval_samples_per_second"] / second["last_interval_samples_per_second"]
    return out


# ------------------------------------------------------------------------------------------ running

def run_within(run: Run, seconds: float, cwd: Path, log: Path) -> tuple[str, float]:
    """Run it in a session of its own, killed with everything it started once `seconds` are up."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_")}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
               **run.env)
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(run.command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, seconds))
            status = "ok" if code == 0 else f"exit {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timed out"
    return status, time.monotonic() - started


def machine() -> dict:
    import torch

    facts = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts["gpu"] = f"{props.name}, {props.total_memory // 2**20} MiB"
    try:
        facts["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True, timeout=10).stdout.strip() or None
    except OSError:
        facts["commit"] = None
    return facts


def execute(parts: list[Part], work: Path, target: Path, total_s: float, cuda: bool) -> dict:
    report = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              **machine(), "total_budget_s": total_s, "parts": {}}
    began = time.monotonic()
    planned = 0.0
    for part in parts:
        planned += part.budget_s
        entry = report["parts"][part.name] = {"budget_s": part.budget_s, "runs": {}, "status": "ok"}
        part_began = time.monotonic()
        for run in part.runs:
            deadline = began + (total_s if part.leftover_only else min(total_s, planned))
            left = deadline - time.monotonic()
            record: dict = {"command": shlex.join(run.command)}
            if run.needs_cuda and not cuda:
                record["status"] = "skipped: no CUDA here"
            elif left < 5:
                record["status"] = "not started: the budget was spent"
                entry["status"] = "cut short"
            else:
                log = work / "logs" / f"{part.name}.{run.name}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                (work / "runs" / run.name).mkdir(parents=True, exist_ok=True)
                status, seconds = run_within(run, left, work, log)
                record.update(status=status, seconds=round(seconds, 1), **read_run(run, work, work))
                if status != "ok":
                    record["log_tail"] = log.read_text(errors="replace")[-2000:]
                    entry["status"] = "cut short" if status == "timed out" else "failed"
                print(f"  {part.name}/{run.name}: {status} in {seconds:.0f} s"
                      + (f", {record['samples_per_second']:.1f} samples/s" if record.get("samples_per_second") else ""),
                      file=sys.stderr, flush=True)
            entry["runs"][run.name] = record
            entry["seconds"] = round(time.monotonic() - part_began, 1)
            entry["ratios"] = {name: value for name, a, b in part.ratios
                               if (value := ratio(report["parts"], part.name, a, b)) is not None}
            report["elapsed_s"] = round(time.monotonic() - began, 1)
            write_json_atomic(target, report)  # after every run: a window cut short keeps what finished
    return report


# ------------------------------------------------------------------------------------------ the JPEG folder

def make_jpegs(root: Path, images: int, links: int, photo: tuple[int, int]) -> dict:
    """`images` training JPEGs (and a fifth as many for val), each training file listed `links` times more by
    hard links (no bytes copied): an epoch of images x (links + 1) samples without making that many files."""
    from bench.common import imagenet_like_folder

    started = time.monotonic()
    imagenet_like_folder(root, images, size=photo, workers=os.cpu_count() or 1)
    made = time.monotonic() - started
    for original in sorted((root / "train").rglob("*.jpg")):
        for copy in range(links):
            os.link(original, original.with_name(f"{original.stem}-l{copy}.jpg"))
    facts = {"images": images, "listed": images * (links + 1), "seconds_to_make": round(made, 1),
             "seconds_with_links": round(time.monotonic() - started, 1)}
    (root / "made.json").write_text(json.dumps(facts) + "\n")
    return facts


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m bench.quick", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan; start nothing")
    parser.add_argument("--rehearse", action="store_true", help="the same machinery at toy sizes on this CPU")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or RESULTS))
    parser.add_argument("--work", type=Path, default=None, help="where the runs write (default: a new temp folder)")
    parser.add_argument("--total", type=float, default=TOTAL_BUDGET_S, help="seconds for the whole check")
    parser.add_argument("--make-jpegs", type=Path, help=argparse.SUPPRESS)  # the jpeg-set part, in a child
    parser.add_argument("--images", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--links", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--photo", default="500x375", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.total <= 0:
        raise UsageError("--total", f"{args.total:g} is not a positive number of seconds", "give e.g. 420")
    return args


def main(argv: list[str] | None = None) -> int:
    with exit_on_usage_error():
        args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.make_jpegs:
        width, height = (int(v) for v in args.photo.split("x"))
        print(json.dumps(make_jpegs(args.make_jpegs, args.images, args.links, (width, height))))
        return 0
    cpus = os.cpu_count() or 1
    scale = rehearsal_scale(cpus) if args.rehearse else gpu_scale(cpus)
    work = args.work or Path("<a new temporary folder>" if args.dry_run else tempfile.mkdtemp(prefix="quick-"))
    parts = plan(scale, work, sys.executable)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    target = args.out / f"quick-{stamp}.json"
    budgets = sum(p.budget_s for p in parts)
    print(f"bench.quick: {len(parts)} parts, {budgets} s of budgets (at most {args.total:g} s in all); results: "
          f"{target}", file=sys.stderr if not args.dry_run else sys.stdout, flush=True)
    if args.dry_run:
        for part in parts:
            when = "on leftover time only" if part.leftover_only else f"at most {part.budget_s} s"
            print(f"{part.name} ({when}):")
            for run in part.runs:
                print(f"  {run.name}: {shlex.join(run.command)}")
        return 0
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    report = execute(parts, work, target, args.total, torch.cuda.is_available())
    print(f"written: {target} ({report['elapsed_s']:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
