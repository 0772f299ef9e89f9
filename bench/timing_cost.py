"""`python -m bench.timing_cost`: what --step-timing adds to one optimizer step, in microseconds.

The interleaved runs of the main harness (`python -m bench --stacks trainer baseline --baseline-args
'--step-timing false'`) compare whole runs, and this VM's run-to-run noise (several %) hides a cost
below 1%. This measures the cost itself: in one process, two copies of a small model, each with its
optimizer and the trainer's own StepTiming (one on, one off), train in alternating blocks of steps
(on, off, on, ...) through the same loop shape as trainer.engine.loop: batches through `timing.batches`,
forward, backward, optimizer step, and every --log-every steps `reduce_loss` and `scalars`. The model
is small so that a step takes about a millisecond: what timing adds per step (hooks, perf_counter
readings, the window's bookkeeping) does not grow with the model, so the difference per step is the
cost for any model, to be set against that model's step time.

    python -m bench.timing_cost --blocks 40 --steps 50

Reported: the median step time on and off, their difference in microseconds with a distribution-free
95% interval over the block pairs, and that difference as a share of a given step time (--step-ms,
e.g. the 2-process ResNet-18 step of the main harness's run).
"""

from __future__ import annotations

import os
import sys
import time

from bench.results import alternate, check_counts, cost_batches, cost_parser, write_cost
from trainer.core.errors import exit_on_usage_error


def one_copy(timing_on: bool, log_every: int):
    import torch
    from torch import nn

    from trainer.cluster.topology import WORKER, resolve
    from trainer.config.settings import load_config
    from trainer.parallel.context import DistContext
    from trainer.engine.optim import build_optimizer
    from trainer.observe.steptiming import StepTiming

    cfg = load_config(["--env-file", os.devnull, "--step-timing", str(timing_on).lower(), "--log-every",
                       str(log_every)], {}, world_size=1)
    ctx = DistContext(resolve({}, WORKER), "none", torch.device("cpu"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = build_optimizer(cfg, model)
    return model, optimizer, StepTiming(cfg, ctx, model, model, optimizer)


def run_block(copy, batches: list, log_every: int) -> float:
    """Seconds per step over the block, the loop shaped as trainer.engine.loop's."""
    import torch

    model, optimizer, timing = copy
    loss_sum = torch.zeros(())
    began = time.perf_counter()
    for step, (x, y) in enumerate(timing.batches(batches), start=1):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        if step % log_every == 0:
            timing.reduce_loss(loss_sum)
            timing.scalars()
            loss_sum = torch.zeros(())
    return (time.perf_counter() - began) / len(batches)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = cost_parser("python -m bench.timing_cost", __doc__.split("\n\n")[0],
                         "blocks of steps per setting, alternating")
    with exit_on_usage_error():
        args = parser.parse_args(argv)
        check_counts(args)
        batches = cost_batches(args.steps)
        copies = {True: one_copy(True, args.log_every), False: one_copy(False, args.log_every)}
        for on in (True, False):  # warm-up: the first step hooks every gradient
            run_block(copies[on], batches, args.log_every)
        runs = alternate(args.blocks, {"on": lambda: run_block(copies[True], batches, args.log_every),
                                       "off": lambda: run_block(copies[False], batches, args.log_every)})
        write_cost(args, argv, "bench.timing_cost", runs, "on", "off", {"on": "timing on", "off": "off"},
                   "step timing's cost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
