"""`python -m bench`: one workload through the trainer, a hand-written DDP loop and Lightning.

Runs are interleaved (trainer, hand-written, Lightning, trainer, ...) so that a noisy neighbour
slows every stack alike; each stack's median and min-max over the rounds are reported, with the
ratios trainer/hand-written and trainer/Lightning, and, given --nproc 1 2, each stack's scaling
efficiency. `--stacks trainer container` instead runs the trainer bare-metal and in the CPU
container (compose's trainer-cpu service, image built beforehand) for the container/bare-metal
ratio. `--stacks launcher torchrun` runs one user script (the hand-written loop) through
trainer-launch and through plain torchrun, for the launcher/torchrun ratio. `--stacks trainer
baseline` runs the trainer twice per round, with --trainer-args and with --baseline-args, for the
effect of one setting (e.g. the input path) side by side. Results: a markdown table on stdout and
bench/results/<stamp>.{md,json}, with each run's own record of its figure (the trainer's summary.json and
params.json, a script's result.json) in bench/results/bench-<stamp>-runs/. `--input` measures the input path
alone (bench/inputpath.py).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.results import RESULTS, describe_machine, now, paired_ratios, write_results
from trainer.cli.scale import (
    STEPS_HELP,
    check_timed_steps,
    exit_with_failed_run,
    prepare_out,
    reject_harness_flags,
    run_counting_other_work,
    torchrun_command,
)
from trainer.cluster.gpus import visible_gpu_count
from trainer.config import catalog
from trainer.config.settings import load_config
from trainer.core.errors import OneLineErrorParser, UsageError, exit_on_usage_error, first_line

REPO = Path(__file__).resolve().parents[1]
STACKS = ("trainer", "handwritten", "lightning", "container", "baseline", "launcher", "torchrun", "script")
DEFAULT_STACKS = ["trainer", "handwritten", "lightning"]
MODULES = {"trainer": "trainer", "handwritten": "bench.handwritten", "lightning": "bench.lightning_run",
           "baseline": "trainer", "script": "bench.api_script"}
CLASSIFIER_STACKS = ("handwritten", "lightning", "launcher", "torchrun")  # bench/common.py's classifier loop
TRAINER_STACKS = ("trainer", "container", "baseline", "script")  # they write runs/summary.json (Run does)
# Besides trainer/<peer>: container parity (over bare metal), one setting's effect (over the baseline)
# and a user's script through trainer-launch (over the same script through plain torchrun).
RATIOS = [("container", "trainer"), ("trainer", "baseline"), ("launcher", "torchrun"), ("script", "trainer")]
CONTAINER_DIR = "/bench"  # where the container sees the run's folder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineErrorParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=None,
                        help="processes per run; several (1 2) also give each stack's scaling efficiency "
                             "(default: visible GPUs, or 2)")
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=DEFAULT_STACKS,
                        help="container: the trainer in the CPU image via compose (docker compose --profile "
                             "cpu build first); baseline: the trainer with --baseline-args")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs of every stack (at least 3)")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per process per step")
    parser.add_argument("--image-size", type=int, default=32, help="synthetic image side (224: ImageNet-shaped)")
    parser.add_argument("--steps", type=int, default=40, help=STEPS_HELP)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each process")
    parser.add_argument("--trainer-args", default="", help="extra trainer options, e.g. '--local-sgd-period 8'")
    parser.add_argument("--baseline-args", default="",
                        help="the baseline stack's trainer options instead, e.g. '--loader dataloader'")
    parser.add_argument("--baseline-from", type=Path, default=None,
                        help="a checkout whose trainer the baseline stack runs (git worktree add DIR COMMIT): the "
                             "trainer before a change against after it")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the .md and .json results")
    args = parser.parse_args(argv)
    args.nproc = args.nproc or [visible_gpu_count() or 2]  # counted only when needed: it may import torch
    if args.rounds < 3:
        raise UsageError("--rounds", f"{args.rounds} is too few for a median", "give 3 or more")
    for setting, value in (("--nproc", min(args.nproc)), ("--batch-size", args.batch_size),
                           ("--threads", args.threads)):
        if value < 1:
            raise UsageError(setting, f"{value} is below 1", "give 1 or more")
    check_timed_steps(args.steps)
    reconstructs = args.model in catalog.MODELS and catalog.MODELS[args.model].reconstructs
    if reconstructs and set(CLASSIFIER_STACKS) & set(args.stacks):
        raise UsageError("--model", f"{args.model} learns to reconstruct, and the hand-written and Lightning stacks "
                         "train classifiers", "choose a classifier, or --stacks trainer baseline")
    if "lightning" in args.stacks and importlib.util.find_spec("lightning") is None:
        raise UsageError("--stacks", "lightning is not installed",
                         "pip install -e '.[bench]', or leave lightning out of --stacks")
    check_trainer_options(args)
    return args


def check_trainer_options(args: argparse.Namespace) -> None:
    """Every run's trainer options, checked as the trainer will: a mistake fails here, in one line,
    not rounds into the benchmark."""
    owned = {"--max-steps": "--steps", "--synthetic-size": "--steps", "--log-dir": "--out", "--checkpoint-dir": "--out",
             "--model": "--model (every stack trains it)", "--batch-size": "--batch-size (every stack uses it)",
             "--synthetic-image-size": "--image-size"}
    for setting, extra in (("--trainer-args", args.trainer_args), ("--baseline-args", args.baseline_args)):
        try:
            reject_harness_flags(shlex.split(extra), owned, setting)
        except ValueError as err:  # shlex: an unbalanced quote
            raise UsageError(setting, first_line(err), "quote it as a shell would") from None
    with tempfile.TemporaryDirectory() as workdir:  # what each run gets: no .env in it
        for nproc in args.nproc:
            load_config(trainer_flags(nproc, args, workdir, ""), {}, world_size=nproc)  # the bench's own options
            for setting, extra in (("--trainer-args", args.trainer_args), ("--baseline-args", args.baseline_args)):
                try:  # (an unbalanced quote was refused above)
                    load_config(trainer_flags(nproc, args, workdir, extra), {}, world_size=nproc)
                except UsageError as err:  # name the option that holds the mistake
                    raise UsageError(f"{setting}: {err.parts[0]}", *err.parts[1:]) from None


def trainer_flags(nproc: int, args: argparse.Namespace, workdir: str, extra: str) -> list[str]:
    return ["--model", args.model, "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
            "--synthetic-size", str(args.steps * args.batch_size * nproc),
            "--synthetic-image-size", str(args.image_size), "--val-every", "0",
            "--log-every", str(args.steps), "--checkpoint-every", "0", "--resume", "never",
            "--log-dir", f"{workdir}/runs", "--checkpoint-dir", f"{workdir}/checkpoints",
            "--env-file", os.devnull, *shlex.split(extra)]


def stack_command(stack: str, nproc: int, args: argparse.Namespace, workdir: Path, name: str = "") -> list[str]:
    """name: the container's (the container stack), by which an interrupted run removes it."""
    if stack == "container":  # the service as users run it: its launcher, preflight and compose settings
        return ["docker", "compose", "--project-directory", str(REPO), "--profile", "cpu", "run", "--rm",
                "--name", name or workdir.name,
                "--no-deps", "-e", f"NPROC_PER_NODE={nproc}", "-e", f"OMP_NUM_THREADS={args.threads}",
                "-v", f"{workdir}:{CONTAINER_DIR}", "trainer-cpu",
                *trainer_flags(nproc, args, CONTAINER_DIR, args.trainer_args)]
    if stack in ("launcher", "torchrun"):  # as users run their script: trainer-launch (preflight on), or torchrun
        runner = [sys.executable, "-m", "trainer.cli.launch"] if stack == "launcher" else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        return [*runner, "-m", MODULES["handwritten"], *script_flags(args, workdir)]
    command = [*torchrun_command(nproc), "-m", MODULES[stack]]
    if stack in ("trainer", "script"):  # the script reads the same options as TRAIN_* variables (run_once)
        return command + (trainer_flags(nproc, args, str(workdir), args.trainer_args) if stack == "trainer" else [])
    if stack == "baseline":
        if args.baseline_from:  # another checkout's trainer, under plain torchrun (its supervisor may be elsewhere)
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                       "-m", "trainer"]
        return command + trainer_flags(nproc, args, str(workdir), args.baseline_args)
    return command + script_flags(args, workdir)


def as_environment(flags: list[str]) -> dict[str, str]:
    """--max-steps 40 ... as TRAIN_MAX_STEPS=40 ...: how a script on trainer.api is given the same settings."""
    env, i = {}, 0
    while i < len(flags):
        flag, value = flags[i], "true"  # a flag without its value is a boolean one's true
        i += 1
        if i < len(flags) and not flags[i].startswith("--"):
            value, i = flags[i], i + 1
        if flag != "--env-file":
            env["TRAIN_" + flag.removeprefix("--").replace("-", "_").upper()] = value
    return env


def script_flags(args: argparse.Namespace, workdir: Path) -> list[str]:
    """The options of the hand-written and Lightning stacks' scripts (bench/common.py reads them)."""
    return ["--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--image-size", str(args.image_size), "--result", str(workdir / "result.json")]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_once(stack: str, nproc: int, args: argparse.Namespace, keep: Path) -> tuple[float, float]:
    """One run of one stack: its steady-state samples/s over all processes, and how many cores
    other work on the machine kept busy meanwhile (the noise every number here carries). The run's own
    record of it (summary.json and params.json, or result.json) is kept in the folder `keep`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAIN_")}  # the workload is the flags alone
    env.update(OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if stack == "baseline" and args.baseline_from:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(args.baseline_from), os.environ.get("PYTHONPATH")]))
    if stack == "launcher":  # the launcher's topology variables, a rendezvous port of its own
        env.update(NNODES="1", NODE_RANK="0", NPROC_PER_NODE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory(prefix=f"bench-{stack}-") as tmp:
        workdir = Path(tmp)
        workdir.chmod(0o777)  # the container's non-root user writes its results here
        if stack == "container":  # compose's mounts on host folders: no named volumes left behind per run
            env.update(DATA_DIR=str(workdir), CHECKPOINT_DIR=str(workdir), RUNS_DIR=str(workdir))
        name = workdir.name  # bench-container-<random>: the container's name too
        command = stack_command(stack, nproc, args, workdir, name)
        if stack == "script":
            env.update(as_environment(trainer_flags(nproc, args, str(workdir), args.trainer_args)))
        try:
            done, others = run_counting_other_work(command, cwd=workdir, env=env, capture_output=True, text=True,
                                                   timeout=1800)
        finally:  # Ctrl-C, a timeout, a client that ended first: compose run's --rm removes nothing without its client
            if stack == "container":
                subprocess.run(["docker", "rm", "--force", name], capture_output=True, timeout=120)
        if done.returncode != 0:
            print(f"+ {shlex.join(command)}  # the {stack} run that failed", file=sys.stderr)
            exit_with_failed_run(done)
        result_file = workdir / ("runs/summary.json" if stack in TRAINER_STACKS else "result.json")
        keep.mkdir(parents=True)
        for record in (result_file, result_file.with_name("params.json")):
            if record.is_file():
                shutil.copyfile(record, keep / record.name)
        return float(json.loads(result_file.read_text())["samples_per_second"]), others


def summarise(runs: list[dict], nprocs: list[int], stacks: list[str]) -> dict:
    summary: dict = {"stacks": {}, "ratios": {}, "paired": {}, "scaling_efficiency": {}}
    for nproc in nprocs:
        per_stack = {}
        for stack in stacks:
            values = [r["samples_per_second"] for r in runs if r["stack"] == stack and r["nproc"] == nproc]
            per_stack[stack] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                                "runs": values}
        summary["stacks"][str(nproc)] = per_stack
        medians = {stack: values["median"] for stack, values in per_stack.items()}
        pairs = [("trainer", peer) for peer in stacks if peer not in TRAINER_STACKS] + RATIOS
        ratios = {f"{a}/{b}": medians[a] / medians[b] for a, b in pairs if a in medians and b in medians}
        if ratios:
            summary["ratios"][str(nproc)] = ratios
            summary["paired"][str(nproc)] = {
                f"{a}/{b}": paired_ratios(runs, nproc, a, b) for a, b in pairs if a in medians and b in medians}
    low, high = min(nprocs), max(nprocs)
    if high > low:
        for stack in stacks:
            speedup = summary["stacks"][str(high)][stack]["median"] / summary["stacks"][str(low)][stack]["median"]
            summary["scaling_efficiency"][stack] = speedup / (high / low)
    return summary


def markdown(summary: dict, header: dict) -> str:
    lines = [f"`{header['command']}`  ", f"{header['date']}, {header['machine']}; "
             f"other work on the machine during the runs: median {header['other_cores_busy']:.2f} cores busy", "",
             "| processes | stack | median samples/s | min-max | runs |", "|---|---|---|---|---|"]
    for nproc, per_stack in summary["stacks"].items():
        for stack, s in per_stack.items():
            lines.append(f"| {nproc} | {stack} | {s['median']:.1f} | {s['min']:.1f}-{s['max']:.1f} | {len(s['runs'])} |")
    lines.append("")
    for nproc, ratios in summary["ratios"].items():
        for name, value in ratios.items():
            paired = summary["paired"][nproc][name]
            lines.append(f"- {nproc} processes: {name} = {value:.3f}; within each round: median {paired['median']:.3f}, "
                         f"95% interval {paired['low']:.3f}-{paired['high']:.3f} ({len(paired['values'])} rounds)")
    low_high = sorted(int(n) for n in summary["stacks"])
    lines += [f"- scaling efficiency {low_high[-1]} vs {low_high[0]} processes, {stack}: {value:.3f}"
              for stack, value in summary["scaling_efficiency"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--input" in argv:  # the input path alone: bench/inputpath.py
        from bench.inputpath import main as input_main

        return input_main([arg for arg in argv if arg != "--input"])
    with exit_on_usage_error():
        args = parse_args(argv)
        prepare_out(args.out)  # before the runs: a bad --out must not cost the benchmark
    header = {"command": shlex.join(["python", "-m", "bench", *argv]),
              "date": now(), "machine": describe_machine(),
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    runs = []
    kept = args.out / datetime.datetime.now().strftime("bench-%Y%m%d-%H%M%S-runs")  # every run's own record
    for round_number in range(1, args.rounds + 1):
        for nproc in args.nproc:
            for stack in args.stacks:
                keep = kept / f"round{round_number}-{nproc}p-{stack}"
                sps, others = run_once(stack, nproc, args, keep)
                runs.append({"round": round_number, "nproc": nproc, "stack": stack, "samples_per_second": sps,
                             "other_cores_busy": others, "record": str(keep)})
                print(f"round {round_number}/{args.rounds}  {nproc} proc  {stack:<11} {sps:8.1f} samples/s  "
                      f"(other work: {others:.2f} cores)", file=sys.stderr, flush=True)
    summary = summarise(runs, args.nproc, args.stacks)
    header["other_cores_busy"] = statistics.median(r["other_cores_busy"] for r in runs)
    table = markdown(summary, header)
    write_results(args.out, "bench", header, runs, summary, table)
    return 0
