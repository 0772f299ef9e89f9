"""`python -m bench.engine_cost`: what the engine (trainer.api's Run) adds to one optimizer step, in microseconds.

Whole runs compared on this VM carry several % of noise, which hides a cost below 1%. This measures the cost
itself: in one process, two copies of a small model train in alternating blocks of steps. One goes through a
bare loop (forward, backward, optimizer step, zero_grad); the other through the engine exactly as the built-in
loop and a script use it: run.steps() with its micro-batch iterator and no-sync context, run.autocast(),
run.backward(), run.optimizer_step(), and after every step the engine's bookkeeping (position, throughput, step
timing, the stop vote, the checkpoint cadence) with the loss reduce, the tracker scalars and the progress line
every --log-every steps. The model is small so that a step takes about a millisecond: what the engine adds per
step does not grow with the model, so the difference per step is its cost for any model, to be set against
that model's step time. It bounds two ratios at once: a script on the API against the built-in loop (the same
engine), and the built-in loop after the engine against before it (whose own bookkeeping cost at least 0).

    python -m bench.engine_cost --blocks 40 --steps 50

Reported: the median step time of both, the engine's cost per step with a distribution-free 95% interval over the
block pairs, and that cost as a share of a given step time (--step-ms, e.g. the 2-process ResNet-18 step).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

from bench.results import alternate, check_counts, cost_batches, cost_parser, write_cost
from trainer.core.errors import exit_on_usage_error


def small_model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def bare_block(model, optimizer, batches: list) -> float:
    """Seconds per step of the bare loop."""
    import torch

    began = time.perf_counter()
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - began) / len(batches)


def engine_block(run, forward, optimizer, batches: list) -> float:
    """Seconds per step through the engine, as trainer/engine/loop.py and the README's script step."""
    import torch

    began = time.perf_counter()
    for micro_batches in run.steps(batches):
        for x, y in micro_batches:
            with run.autocast():
                loss = torch.nn.functional.cross_entropy(forward(x), y)
            run.backward(loss)
        run.optimizer_step(optimizer)
    return (time.perf_counter() - began) / len(batches)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = cost_parser("python -m bench.engine_cost", __doc__.split("\n\n")[0],
                         "blocks of steps per loop, alternating")
    with exit_on_usage_error():
        args = parser.parse_args(argv)
        check_counts(args)
    from trainer import api

    batches = cost_batches(args.steps)
    bare = small_model()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TRAIN_", "RANK", "WORLD_SIZE"))}
    os.environ.clear()
    os.environ.update(environ)
    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp), \
            api.Run(log_every=args.log_every, checkpoint_every=0) as run:  # no .env there: the defaults
        model, optimizer = small_model()
        forward = run.wrap(model)
        run.resume(model=model, optimizer=optimizer)
        bare_block(*bare, batches)  # warm-up: first steps allocate the optimizer state
        engine_block(run, forward, optimizer, batches)
        runs = alternate(args.blocks, {"engine": lambda: engine_block(run, forward, optimizer, batches),
                                       "bare": lambda: bare_block(*bare, batches)})
    write_cost(args, argv, "bench.engine_cost", runs, "engine", "bare",
               {"engine": "through the engine", "bare": "bare"}, "the engine's cost")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
