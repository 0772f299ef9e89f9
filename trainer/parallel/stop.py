"""The stop: a signal asks for it (GracefulStop), every rank agrees on the step (StopVote)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time

from trainer.cluster import workers
from trainer.parallel.context import DistContext

log = logging.getLogger("trainer")
# After torchrun's stop for another rank's failure: a rank in a collective fails on its own well within this; one
# still running after it is stuck elsewhere (its own code, a read), where torchrun would SIGKILL it only after 30 s.
TEARDOWN_GRACE_S = 5.0
_writes = 0  # checkpoint writes in flight, in the step or in the background: the teardown waits for them
_writes_lock = threading.Lock()


@contextlib.contextmanager
def writing():
    """Around a checkpoint write: a rank leaving after torchrun's stop lets it finish (torchrun's SIGKILL may not)."""
    global _writes
    with _writes_lock:
        _writes += 1
    try:
        yield
    finally:
        with _writes_lock:
            _writes -= 1


class GracefulStop:
    """SIGTERM (docker stop, torchrun shutdown) or SIGINT: finish the step, checkpoint, exit 0.

    The built-in trainer and trainer.api both stop through it, agreeing on the step with StopVote."""

    def __init__(self):
        self.requested = False
        self.leaving = False  # the teardown thread runs (torchrun stops the group after another rank failed)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request)

    def close(self) -> None:
        """Training is over and saved: a late signal (our own agent's, see stop_host_agent) changes nothing."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)

    def _request(self, signum, _frame):
        self.requested = True
        if workers.peer_failed_here():  # torchrun tearing the group down: no user asked for a stop
            log.warning("received %s: torchrun stops this host's workers after another one failed",
                        signal.Signals(signum).name)
            if not self.leaving:
                self.leaving = True
                where = (f"{os.path.basename(_frame.f_code.co_filename)}:{_frame.f_lineno} in {_frame.f_code.co_name}"
                         if _frame is not None else "an unknown place")
                threading.Thread(target=_leave_if_stuck, args=(where,), name="teardown", daemon=True).start()
            return
        log.warning("received %s: stopping within a step or two, with a checkpoint", signal.Signals(signum).name)

    @staticmethod
    def dataloader_worker_init(worker_id: int) -> None:
        """A DataLoader's worker_init_fn: its workers leave a stop to the training process. torchrun signals
        each worker's whole process group, DataLoader workers included, and torch's SIGTERM handler in a
        DataLoader worker dies of any SIGTERM but its parent's: the training process then failed on the
        dead worker instead of checkpointing. In a process group of its own, a worker gets neither that
        signal nor a terminal's Ctrl-C; its parent shuts it down (and it exits when its parent dies)."""
        os.setpgid(0, 0)


def _leave_if_stuck(where: str) -> None:
    """The teardown thread: a rank still here TEARDOWN_GRACE_S after torchrun's stop is not in a collective (that
    would have failed); it leaves now, so the restart or the end comes without torchrun's 30 s wait. A checkpoint
    write in flight finishes first: what it commits is the restart's starting point."""
    time.sleep(TEARDOWN_GRACE_S)
    while _writes:
        time.sleep(0.2)
    log.warning("still running %g s after torchrun's stop, outside any collective (at %s when it came): this "
                "rank leaves now", TEARDOWN_GRACE_S, where)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


class StopVote:
    """Whether any rank wants to stop, agreed with one step of slack (CPU-side, no GPU sync).

    `vote(flag)` starts this step's MAX all-reduce and returns the previous step's outcome, so no
    rank waits for the others at every step: with local SGD no other collective runs in a step,
    and meeting every step would cost each step the slower rank's jitter. Every rank sees the
    same outcome at the same step, which is all that stopping together needs."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.pending: tuple | None = None

    def vote(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        if not self.ctx.distributed:
            return flag
        previous = self.finish()
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.ctx.control_group, async_op=True)
        self.pending = (value, work)
        return previous

    def finish(self) -> bool:
        """The outcome of the vote in flight (False if none); call once more before leaving the loop."""
        if self.pending is None:
            return False
        value, work = self.pending
        self.pending = None
        work.wait()
        return bool(value.item())
