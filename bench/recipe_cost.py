"""`python -m bench.recipe_cost`: what each technique of the reference recipe adds to one training step.

Whole runs on a shared 2-core machine vary by a factor of 2 from minute to minute (bench.recipe's interleaved
rounds show it); this measures the techniques' own work instead, in CPU time, as timing_cost does for step timing
in wall time: in one
process, one thread, a copy of the same small CNN per technique, each with its optimizer, trains on the same real
MNIST digits in blocks of steps, each technique's block beside one of plain's (their order swapped every round),
through the built-in loop's pieces for the in-memory input path: the uint8 batch, --auto-augment and
--random-erase sample by
sample (data.augment.SampleAugment, as data.Batches runs them on the device), normalisation, mixup or cutmix
(run.mixup_cutmix's MixUpCutMix), the forward and the loss (Objective, with --label-smoothing), the backward,
clipping (optim.clip_gradients), the optimizer step, the EMA's update every --model-ema-steps (ModelEma).

    python -m bench.recipe_cost --blocks 15 --steps 64

Reported per technique: the median CPU time of a step, and its ratio to the plain block beside it (the median
over the rounds and its distribution-free 95% interval). Not here, having no per-step work: --ra-sampler (an epoch's order, once
per epoch) and --bias-weight-decay (the same optimizer kernel over other groups).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

from bench.recipe import MNIST_T10K, write_split
from bench.results import RESULTS, describe_machine, now, paired_ratios, write_results

# Each technique at the recipe's value (and the reference's EMA cadence); "all": every one together.
VARIANTS = {
    "plain": {},
    "clip": {"clip": 1.0},
    "smoothing": {"smoothing": 0.1},
    "mixup": {"mixup": 0.2},
    "cutmix": {"cutmix": 1.0},
    "ema": {"ema": 32},
    "ta_wide": {"policy": "ta_wide"},
    "erase": {"erase": 0.1},
}
VARIANTS["all"] = {key: value for options in VARIANTS.values() for key, value in options.items()}


class Loop:
    """One technique's copy of the model and its step, the built-in loop's pieces in its order."""

    def __init__(self, options: dict, batch_size: int):
        import torch

        from trainer.config.catalog import DATASETS
        from trainer.data.augment import MixUpCutMix, SampleAugment, policy_transform
        from trainer.data.images import builtin_spec
        from trainer.engine.ema import ModelEma
        from trainer.engine.models import Objective, build_model
        from trainer.engine.optim import parameter_groups

        entry = DATASETS["mnist"]
        torch.manual_seed(0)
        self.model = build_model("cnn", builtin_spec("mnist", 28))
        self.optimizer = torch.optim.SGD(parameter_groups(self.model, 5e-4, 0.0, 0.0), lr=0.05, momentum=0.9,
                                         fused=True)
        self.objective = Objective(self.model, "cnn", options.get("smoothing", 0.0))
        policy = options.get("policy")
        self.samples = SampleAugment(policy_transform(policy, 9, 3, "bilinear") if policy else None,
                                     options.get("erase", 0.0), entry.mean) \
            if policy or options.get("erase") else None
        self.mixer = MixUpCutMix(options.get("mixup", 0.0), options.get("cutmix", 0.0), 10) \
            if options.get("mixup") or options.get("cutmix") else None
        self.clip = options.get("clip")
        self.ema = ModelEma(self.model, 0.99, options["ema"], 0) if options.get("ema") else None
        self.scale = 1 / (255 * torch.tensor(entry.std).view(1, -1, 1, 1))
        self.shift = torch.tensor(entry.mean).view(1, -1, 1, 1) / torch.tensor(entry.std).view(1, -1, 1, 1)
        self.batch_size, self.step = batch_size, 0

    def block(self, images, labels, steps: int) -> float:
        """CPU seconds per step over `steps` steps (the process's CPU time: on a machine whose cores other work
        shares, its wall time measures the others as much as this; one thread does all the work here)."""
        from trainer.data.augment import mix_key
        from trainer.data.images import sample_key
        from trainer.engine.optim import clip_gradients

        began = time.process_time()
        for _ in range(steps):
            first = (self.step * self.batch_size) % (len(labels) - self.batch_size)
            x, y = images[first:first + self.batch_size], labels[first:first + self.batch_size]
            if self.samples is not None:
                x = self.samples.batch(x, [sample_key(first + i, 0, 0) for i in range(len(y))])
            x = x.float().mul_(self.scale).sub_(self.shift)
            if self.mixer is not None:
                x, y = self.mixer(x, y, mix_key(0, 0, self.step, 0))
            loss = self.objective.per_sample(self.model(x), x, y).mean()
            loss.backward()
            if self.clip:
                clip_gradients(self.optimizer, self.clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            if self.ema is not None:
                self.ema.after_step(self.step)
        return (time.process_time() - began) / steps


def mnist_tensors(root: Path):
    """The 8,000 training digits of bench.recipe's split, uint8 N x 1 x 28 x 28, and their labels."""
    import numpy as np
    import torch

    raw = root / "MNIST" / "raw"
    images = np.frombuffer((raw / "train-images-idx3-ubyte").read_bytes()[16:], dtype=np.uint8).reshape(-1, 1, 28, 28)
    labels = np.frombuffer((raw / "train-labels-idx1-ubyte").read_bytes()[8:], dtype=np.uint8)
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.recipe_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=15, help="rounds: a pair of blocks (plain's and its own) per "
                        "technique each")
    parser.add_argument("--steps", type=int, default=64, help="steps per block (the EMA updates every 32)")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step (bench.recipe's per process)")
    parser.add_argument("--data", type=Path, default=MNIST_T10K, help="the folder of t10k-*-idx*-ubyte.gz")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as each training process of the runs (OMP_NUM_THREADS=1)
    images, labels = mnist_tensors(write_split(args.data, args.out / "mnist-8k-2k"))
    loops = {name: Loop(options, args.batch_size) for name, options in VARIANTS.items()}
    for loop in loops.values():  # warm-up: first-call costs (kernels, the policies' set-up)
        loop.block(images, labels, 4)
    # Each technique's block right beside a block of plain's, their order swapped every round: the two ran seconds
    # apart, so what the rest of the machine did to the caches they share divides out of their ratio.
    runs = []
    for number in range(1, args.blocks + 1):
        for name in [n for n in loops if n != "plain"]:
            pair = ["plain", name] if number % 2 else [name, "plain"]
            for stack in pair:
                runs.append({"round": number, "nproc": 1, "stack": stack, "beside": name,
                             "samples_per_second": 1.0 / loops[stack].block(images, labels, args.steps)})
    header = {"command": shlex.join(["python", "-m", "bench.recipe_cost", *argv]), "date": now(),
              "machine": describe_machine()}
    plain_ms = statistics.median(1e3 / r["samples_per_second"] for r in runs if r["stack"] == "plain")
    lines = [f"`{header['command']}`  ", f"{header['date']}, {header['machine']}", "",
             "| technique | median step, CPU ms | step / plain beside it: median (95% interval) | "
             "added CPU ms per step |", "|---|---|---|---|", f"| plain | {plain_ms:.2f} | 1 | 0 |"]
    summary = {}
    for name in [n for n in loops if n != "plain"]:
        beside = [r for r in runs if r["beside"] == name]
        step_ms = statistics.median(1e3 / r["samples_per_second"] for r in beside if r["stack"] == name)
        ratio = paired_ratios(beside, 1, "plain", name)
        summary[name] = {"step_ms": step_ms, "ratio": ratio}
        lines.append(f"| {name} | {step_ms:.2f} | {ratio['median']:.3f} ({ratio['low']:.3f}-{ratio['high']:.3f}) "
                     f"| {(ratio['median'] - 1) * plain_ms:.2f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(args.out, "recipe-cost", header, runs, {"techniques": summary, "plain_ms": plain_ms},
                  "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
