"""`python -m bench.step_cost`: the fault-free per-step cost of in-place recovery against the restart path.

Two local launcher "hosts" of one process each train ResNet-18 on synthetic data without a fault (bench.goodput's
one_run, faults=False), the restart path (RECOVERY=restart) and in place one after the other, round after round (each
arm in every position equally often: in_round), so that both meet the same load on a shared machine. --baseline DIR adds
in place as another source tree (a checkout of an earlier commit) runs it, in the same rounds. Prints one JSON line per
run and, at the end, each round's walls and ratios (start-up included), its per-step ratios (the trainer's steady-state
samples/s from summary.json, the restart path's over each run's: start-up left out), their median over the rounds with
its 95% interval (a bootstrap over the rounds: a goal is met or missed only when the whole interval says so; with
--baseline also the code under test over the baseline, round by round), a control against the machine's speed (each
path's compute, forward and backward, of its writing rank, and how many ms a step it spends outside it: in place's minus
the restart path's is its own cost, with the VM's speed mostly taken out), and in place's step split
(inplace.StepTiming's line of each host: quorum, forward, backward, the sum's exposed part, the optimizer and what
follows it, the rest).

Each run's processes import the trainer from PYTHONPATH's tree as it is when that run starts: a tree edited while the
bench runs mixes two codes between its rounds. For an A/B, run the code under test from a copy too (a clone of the
commit), and the code before it with --baseline.

    python -m bench.step_cost --rounds 3 --steps 400 [--baseline /tmp/before]
    python -m bench.step_cost --model vgg11 --batch-size 8 --lr 0.01 --checkpoint-every 20   # 129 M parameters
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

from bench.goodput import one_run, stop_on_sigterm


def in_round(arms: list, number: int) -> list:
    """The arms in round `number`'s order: rotated by one each round, and reversed every other pass through the
    rotations, so that over 2 x len(arms) rounds each arm runs in every position equally often. A machine that slows
    (or speeds up) over a round then favours no arm; with three arms, reversing every other round alone kept the
    middle one in the middle (its first 6-round A/B had in place in the middle every round, docs/benchmarks.md)."""
    k = len(arms)
    rotated = arms[number % k:] + arms[:number % k]
    return rotated[::-1] if (number // k) % 2 else rotated


def median_interval(values: list[float], level: float = 0.95, resamples: int = 10000, seed: int = 0) -> tuple[float, float]:
    """The median's percentile bootstrap interval: the medians of `resamples` draws of as many rounds, with
    replacement, and the middle `level` of them. Whether a goal is met takes its whole interval on one side: on a
    shared VM one path's rounds move by 10-20%, and a median of four says little (docs/benchmarks.md, "ResNet-18's
    gap over 24 rounds")."""
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    cut = int(resamples * (1 - level) / 2)
    return medians[cut], medians[resamples - 1 - cut]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--baseline", help="a source tree whose in place runs too (PYTHONPATH), e.g. an earlier commit")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per process at world size 2")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.0, help="the trainer's --lr (0: its default; VGG-11 without "
                        "BatchNorm wants 0.01, as bench.goodput's 129 M runs)")
    args = parser.parse_args(argv)
    args.timeout, args.keep, args.fault_every, args.down_for = 1800.0, False, 0.0, 0.0
    stop_on_sigterm()
    own = os.environ.get("PYTHONPATH", "")
    runs: list[dict] = []
    for number in range(args.rounds):
        order = [("restart", "elastic", own), ("in place", "inplace", own),
                 *((("in place (baseline)", "inplace", args.baseline),) if args.baseline else ())]
        for label, mode, path in in_round(order, number):
            os.environ["PYTHONPATH"] = path
            try:
                run = one_run(mode, args, faults=False)
            finally:
                os.environ["PYTHONPATH"] = own
            run.update(round=number, label=label)
            runs.append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
    ratios: dict[str, list[float]] = {}
    controls: dict[str, list[tuple[float, float]]] = {}  # per round: (compute / restart's, ms outside it - restart's)
    for number in range(args.rounds):
        walls = {run["label"]: run["wall_s"] for run in runs if run["round"] == number}
        restart = walls["restart"]
        print(json.dumps({"round": number, **{k: round(v, 1) for k, v in walls.items()},
                          **{f"{k} / restart": round(v / restart, 3) for k, v in walls.items() if k != "restart"}}))
        # The per-step cost: the trainer's own steady-state samples/s (summary.json: the first steps and the
        # checkpoint writes not counted), the restart path's over each other's: start-up left out.
        rates = {run["label"]: run.get("samples_per_s") for run in runs if run["round"] == number}
        if all(rates.values()):
            per_step = {k: rates["restart"] / v for k, v in rates.items() if k != "restart"}
            for label, ratio in per_step.items():
                ratios.setdefault(label, []).append(ratio)
            print(json.dumps({"round": number, "per step": {k: round(v, 3) for k, v in per_step.items()},
                              "samples_per_s": {k: round(v, 2) for k, v in rates.items()}}))
            # A control against the VM's speed, which moves the forward and backward of a whole run: each path's
            # step (from its samples/s) split into the writing rank's compute (forward and backward, the hooks of
            # the sum in them) and the rest, whose difference is the path's own cost outside the compute.
            splits = {run["label"]: run.get("split_ms") or {} for run in runs if run["round"] == number}
            if all("compute_ms" in split for split in splits.values()):
                step_ms = {k: 1000 * args.batch_size * 2 / v for k, v in rates.items()}
                outside = {k: step_ms[k] - splits[k]["compute_ms"] for k in step_ms}
                for label in per_step:
                    controls.setdefault(label, []).append((splits[label]["compute_ms"] / splits["restart"]["compute_ms"],
                                                           outside[label] - outside["restart"]))
                print(json.dumps({"round": number, "compute_ms": {k: round(v["compute_ms"], 1) for k, v in splits.items()},
                                  "outside_compute_ms": {k: round(v, 1) for k, v in outside.items()}}))
    if ratios:  # the rounds' middle: one slow moment of a shared machine moves a round, not the median
        print(json.dumps({"per step, median of the rounds": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
                          "95% interval of the median": {k: [round(x, 3) for x in median_interval(v)]
                                                         for k, v in ratios.items()},
                          "range": {k: [round(min(v), 3), round(max(v), 3)] for k, v in ratios.items()}}))
        if len(ratios) == 2:  # an A/B: round by round, the code under test over the baseline (the same load)
            pairs = [a / b for a, b in zip(ratios["in place"], ratios["in place (baseline)"])]
            print(json.dumps({"in place / in place (baseline), per step, median of the rounds":
                              round(statistics.median(pairs), 3),
                              "95% interval of the median": [round(x, 3) for x in median_interval(pairs)]}))
    if controls:
        print(json.dumps({"compute / restart's, median of the rounds": {
            k: round(statistics.median(c for c, _ in v), 3) for k, v in controls.items()},
            "outside the compute, ms more a step than restart's, median of the rounds": {
            k: round(statistics.median(d for _, d in v), 1) for k, v in controls.items()}}))
    for run in runs:  # one line per host: which host waits for the other's checkpoint writes changes between runs
        for number, split in enumerate(run.get("step_split_ms") or []):
            if split:
                print(json.dumps({"round": run["round"], "label": run["label"], "host": number, **split}))
    return 0 if all(run["global_step"] == args.steps for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
