"""A script on trainer.api's loop pieces (run.steps, run.backward, run.optimizer_step), as the in-place tests run it.

Every rank appends, for each step that commits, one line to <out>/seen-<pid>.txt: the world size, the step and the
sample indices it trained (a step abandoned when a host was lost is not written: its gradients were discarded).
Each DataLoader worker writes its pid to <out>/loader-<training pid>-<worker pid> when it starts; with --workers 0,
each batch read in the training process appends a line to <out>/reads-<pid>.txt: whether it was read while
run.steps() asked the step's quorum (1 or 0), and whether the trainer's quorum thread ("trainer-quorum") was still
running then (1 or 0). A test tells from these that every sample of the epoch was
trained on exactly once across the world-size changes, and that the processes that stayed kept their pids.

    trainer-launch tests/user_code/inplace_loop.py --out DIR [--samples N] [--step-seconds S] [--workers W]
                   [--epochs E] [--validate S] [--ballast-mb M] [--start-when FILE] [--hidden H]
                   [--checkpoint-every N] [--batchnorm] [--die-in-the-sum-at S]

--validate S: after each epoch, "validating" on stderr, then a validation that takes about S seconds (this host's
own: under in-place recovery every host validates the whole set). --ballast-mb M: M MiB more in every checkpoint
(and in the state a returning host gets), so that a checkpoint takes a while to write. --start-when FILE: between
run.resume() and the first step, "starting at step N" on stderr, then a wait until FILE exists (a start as slow as a
model's build or compile can be, as long as a test needs it). --batchnorm: a BatchNorm1d after the first layer, whose
running statistics and num_batches_tracked are in the model's state as buffers. --die-in-the-sum-at S: the first
process of the job to train step S or later at world size 2 (<out>/died, made exclusively, says which) SIGKILLs itself
in the backward, between the second layer's gradients and the first's: in the middle of the overlapped sum over the
hosts. <out>/died holds its pid, the step, how many of the sum's buckets it had launched, and how
many there are (-1 -1: a trainer that does not overlap it).
"""

import argparse
import os
import signal
import sys
import threading
import time

import torch
from numbered import Numbered
from torch.utils.data import DataLoader, default_collate

from trainer import api
from trainer.engine.inplace import _SETTLED


def paused_at(path: str) -> int | None:
    """The step the test's pause file names (it replaces the file whole), None without one."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, default=4800)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="a slower loop: time to change the world")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader worker processes (persistent)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--validate", type=float, default=0.0, help="seconds a validation takes (0: none)")
    parser.add_argument("--ballast-mb", type=int, default=0, help="MiB more in every checkpoint")
    parser.add_argument("--start-when", help="a slow start: the first step waits until this file exists")
    parser.add_argument("--hold-at", type=int, default=0, help="with --hold-until: wait before training this step")
    parser.add_argument("--hold-until", help="the file whose existence ends the wait at --hold-at")
    parser.add_argument("--pause-file", help="a file the test makes naming a step: before training the step after "
                                             "it, wait while the file exists (every process of the host at the same "
                                             "step, the test starting another host meanwhile)")
    parser.add_argument("--second-backward-at", type=int, default=-1,
                        help="once, in the step after this many committed ones: a second forward and backward pass in "
                             "each micro-batch (an auxiliary loss's), on this host alone")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=16, help="the model's hidden width (another model: another one)")
    parser.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d after the first layer")
    parser.add_argument("--die-in-the-sum-at", type=int, default=0, help="a host lost in the middle of a step's sum")
    args = parser.parse_args()
    out = args.out

    def loader_worker(worker_id: int) -> None:
        api.dataloader_worker_init(worker_id)
        open(f"{out}/loader-{os.getppid()}-{os.getpid()}", "w").close()

    def collate(samples):
        if args.workers == 0:  # the read is in this process: was the quorum being asked meanwhile?
            # Called from begin_step() between the start of the quorum's thread and the wait for its answer (the
            # run's state is then the quorum's to wait for); and whether that thread was still running: a quorum that
            # every host asked at once may be answered before the read under load.
            asked = getattr(getattr(run._driver, "replicas", None), "_settled", None) is not None and \
                run._driver.replicas._settled is not _SETTLED
            running = any(t.name == "trainer-quorum" for t in threading.enumerate())
            with open(f"{out}/reads-{os.getpid()}.txt", "a") as reads:
                reads.write(f"{int(asked)} {int(running)}\n")
        return default_collate(samples)

    dataset = Numbered(args.samples)
    with api.Run(checkpoint_dir=f"{out}/checkpoints", log_dir=f"{out}/runs", checkpoint_every=args.checkpoint_every,
                 log_every=10) as run:
        torch.manual_seed(0)
        norm = [torch.nn.BatchNorm1d(args.hidden)] if args.batchnorm else []
        model = run.wrap(torch.nn.Sequential(torch.nn.Linear(8, args.hidden), *norm, torch.nn.ReLU(),
                                             torch.nn.Linear(args.hidden, 3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if args.die_in_the_sum_at:  # the gradient of the first layer's output: the second layer's are accumulated
            def die_in_its_backward(_module, _inputs, output) -> None:
                if output.requires_grad:
                    output.register_hook(lambda grad: _die_in_the_sum(run, out, args.die_in_the_sum_at))

            getattr(model, "module", model)[0].register_forward_hook(die_in_its_backward)
        batch = run.settings.batch_size
        loader = DataLoader(dataset, batch_size=batch, sampler=run.sampler(dataset, batch), drop_last=True,
                            num_workers=args.workers, persistent_workers=args.workers > 0,
                            worker_init_fn=loader_worker if args.workers else None, collate_fn=collate)
        extra = {"ballast": Ballast(args.ballast_mb)} if args.ballast_mb else {}
        run.resume(model=model, optimizer=optimizer, **extra)
        if args.start_when:
            print(f"starting at step {run.step_count}", file=sys.stderr, flush=True)
            while not os.path.exists(args.start_when):
                time.sleep(0.1)
        val = Numbered(64)
        val_loader = DataLoader(val, batch_size=16)
        pending = None  # (step, world size, indices) of the step in flight: written once it committed
        with open(f"{out}/seen-{os.getpid()}.txt", "a") as seen:
            def write_if_committed() -> None:
                if pending is not None and run.step_count >= pending[0]:
                    seen.write(" ".join(map(str, [pending[1], pending[0], *pending[2]])) + "\n")
                    seen.flush()
            for _epoch in run.epochs(args.epochs):
                for micro_batches in run.steps(loader):
                    write_if_committed()
                    if args.hold_until and run.step_count == args.hold_at:  # the test starts another host meanwhile
                        while not os.path.exists(args.hold_until):
                            time.sleep(0.1)
                    if args.pause_file and paused_at(args.pause_file) == run.step_count:
                        while os.path.exists(args.pause_file):
                            time.sleep(0.1)
                    indices = []
                    for x, y, index in micro_batches:
                        with run.autocast():
                            loss = torch.nn.functional.cross_entropy(model(x.to(run.device)), y.to(run.device))
                        run.backward(loss)
                        if run.step_count == args.second_backward_at:
                            with run.autocast():
                                again = torch.nn.functional.cross_entropy(model(x.to(run.device)), y.to(run.device))
                            run.backward(again)
                        indices += index.tolist()
                    if run.step_count == args.second_backward_at:
                        args.second_backward_at = -1  # once: the step taken again has one backward pass
                    time.sleep(args.step_seconds)
                    # An abandoned step (False) is not written, even when the host is healed past it before its
                    # next step: its step count then passes the pending one's (a host cut off at step 27 wrote step
                    # 27 once healed to 84, which the other host had retaken).
                    committed = run.optimizer_step(optimizer)
                    if not committed:
                        print(f"optimizer_step: step {run.step_count + 1} not counted", file=sys.stderr, flush=True)
                    pending = (run.step_count + 1, run.world_size, indices) if committed else None
                write_if_committed()
                pending = None
                if args.validate and not run.stopped:
                    print(f"validating after epoch {run.epoch}", file=sys.stderr, flush=True)
                    slow = ((x, y) for x, y, _ in _slowly(val_loader, args.validate / len(val_loader)))
                    metrics = api.evaluate(run, model, slow, count=len(val_loader))
                    print(f"validated: {metrics}", file=sys.stderr, flush=True)


def _die_in_the_sum(run, out: str, step: int) -> None:
    """A hook on the gradient of the first layer's output, which the backward computes after the second layer's
    parameters' gradients were accumulated (torch's autograd runs the accumulation first) and before the first
    layer's: the second layer's bucket of the sum is launched, the first layer's not yet."""
    if run.step_count + 1 < step or run.world_size != 2:
        return
    try:
        died = os.open(f"{out}/died", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:  # a host died here already (this one, started again, or the other)
        return
    summed = getattr(run._driver.replicas, "summed", None)  # the test reads what the overlap had done by then
    launched, buckets = (summed.launched, len(summed.buckets)) if summed is not None else (-1, -1)
    os.write(died, f"{os.getpid()} {run.step_count + 1} {launched} {buckets}\n".encode())
    os.close(died)
    os.kill(os.getpid(), signal.SIGKILL)


class Ballast(torch.nn.Module):
    """Checkpointed, never trained: a checkpoint of M MiB more."""

    def __init__(self, mib: int):
        super().__init__()
        self.register_buffer("weight", torch.zeros(mib * 2**18))


def _slowly(batches, seconds: float):
    for batch in batches:
        time.sleep(seconds)
        yield batch


if __name__ == "__main__":
    main()
