"""What a worker does for its launcher, in one place, behind `Supervised` (engine/run.py's one handle on it):

- its record: progress for the hang watchdog (a step), what a stop committed (trainer.parallel.bootstrap writes);
- the stop: a signal asks for it (GracefulStop), every rank agrees on the step (StopVote);
- the teardown after another rank's failure (a rank stuck outside any collective leaves on its own);
- the elastic regroup (a stop from another host: exit HOST_LEFT_EXIT_CODE, so that the agent restarts it) and a
  static job's stop from another host (this host's agent is stopped too);
- the store its process group meets in (the attempt the agent chose), and which peers are stuck when a
  collective fails.

Under plain torchrun or srun there is no agent folder: the records, the regroup and the agent's stop do nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

from trainer.cluster import workers
from trainer.cluster.presence import newest_attempt
from trainer.cluster.watchdog import probe
from trainer.config.settings import ELASTIC_WORLD_ENV
from trainer.parallel import bootstrap
from trainer.parallel.compat import torchrun_agent_store

log = logging.getLogger("trainer")
# After the agent's stop for another rank's failure: a rank in a collective fails on its own well within this; one
# still running after it is stuck elsewhere (its own code, a read), where the agent would SIGKILL it much later.
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
        if peer_failed_here():  # the agent tearing the group down: no user asked for a stop
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


def leave_now(code: int) -> None:
    """This process ends now, from any thread, whatever its main thread waits in (a call into torchft's Rust side,
    which nothing interrupts): a checkpoint write in flight finishes first; the launcher reads how it ended in
    bootstrap's record, as after a return."""
    while _writes:
        time.sleep(0.2)
    bootstrap.note_the_end(code)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


class StopVote:
    """Whether any rank wants to stop, agreed with one step of slack (CPU-side, no GPU sync).

    `vote(flag)` starts this step's MAX all-reduce and returns the previous step's outcome, so no
    rank waits for the others at every step: with local SGD no other collective runs in a step,
    and meeting every step would cost each step the slower rank's jitter. Every rank sees the
    same outcome at the same step, which is all that stopping together needs."""

    def __init__(self, ctx: "DistContext"):  # noqa: F821 (trainer.parallel.context imports this module)
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


def peer_failed_here() -> bool:
    """A sibling worker of this group on this host ended without a clean exit: a SIGTERM now is the agent stopping
    the group after that failure, not a user's stop. An earlier group's records (an elastic round's other ranks,
    which exited 75 when a host left) do not count: a SIGTERM after them is the next round's stop."""
    folder = bootstrap.agent_dir()
    if folder is None:
        return False
    me, mine = bootstrap.this_rank(), bootstrap.group()
    return any(w.rank != me and w.group == mine and w.exit != 0 and (w.exit is not None or not w.alive)
               for w in workers.read_workers(folder))


def peer_failed_first(wait_s: float = 1.0) -> bool:
    """After this rank's collective failed: whether a sibling on this host failed first (its death closed the
    connection; the kernel may take a moment to show it dead), so that this rank's line is not a second error."""
    deadline = time.monotonic() + wait_s
    while not peer_failed_here():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stuck_peers() -> str | None:
    """For a worker whose collective just failed: which other ranks of this host are not inside it (None: all
    are, or there is no agent's folder to ask through)."""
    folder = bootstrap.agent_dir()
    if folder is None:
        return None
    me = bootstrap.this_rank()
    peers = [w for w in workers.read_workers(folder) if w.rank != me and w.exit is None and w.alive]
    outside, _ = probe(folder, peers, show=False) if peers else ([], [])
    return "; ".join(outside) or None


def stop_host_agent() -> bool:
    """Ask this host's agent to stop, as `docker compose stop` would; False without one.

    A stop begun on one host reaches every rank (they agree on a step), but not the other hosts' agents: theirs
    see their workers succeed and wait in the exit barrier for the stopped host's agent, which never comes. A
    worker whose stop came from elsewhere calls this, so every agent leaves through the same stop path, at once."""
    pid = os.environ.get(workers.AGENT_PID_ENV, "")
    if not pid.isdigit() or int(pid) != os.getppid():
        return False  # not started by the launcher's agent (plain torchrun, Slurm, a single process)
    os.kill(int(pid), signal.SIGTERM)
    return True


def group_store_prefix(client: Callable[[], object]) -> str | None:
    """The key prefix this rank's process group meets under in the agent's store, kept across restarts (None: a
    store of the group's own, env:// as torch makes it). The launcher's agent names it (the newest attempt any
    host of the job has reached: a host started again counts its restarts from 0). Under plain torchrun, whose
    static rendezvous keeps one store across restarts with the killed group's addresses in it, the same prefix
    is worked out here from its restart count (client: a client of that store)."""
    given = os.environ.get(workers.STORE_PREFIX_ENV, "").strip()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if given or attempt is None or not torchrun_agent_store():
        return given or None
    return f"{workers.STORE_PREFIX}{newest_attempt(client(), int(attempt))}"


class Supervised:
    """A worker's part in its launcher's supervision: the one object engine/run.py asks (see the module's doc)."""

    def __init__(self, ctx: "DistContext"):  # noqa: F821
        self.ctx = ctx
        self.vote = StopVote(ctx)
        self.stop: GracefulStop | None = None
        bootstrap.note(supervised=True)

    def start(self) -> None:
        """Training begins: SIGTERM and SIGINT ask for a stop from now on."""
        if self.stop is None:
            self.stop = GracefulStop()
            bootstrap.note(training=True)

    @property
    def requested(self) -> bool:
        return self.stop is not None and self.stop.requested

    @staticmethod
    def step_done() -> None:
        bootstrap.progress()  # for the launcher's hang watchdog

    def close(self) -> None:
        """Training is over and saved: a late signal changes nothing."""
        if self.stop is not None:
            self.stop.close()

    def leave(self, stopped: bool, step: int, committed: bool) -> int:
        """The end of training, summary written: 0, or HOST_LEFT_EXIT_CODE for an elastic job whose stop came
        from another host (its agent restarts the workers and the hosts left meet again)."""
        code, elsewhere = 0, stopped and self.stop is not None and not self.stop.requested
        if elsewhere and os.environ.get(ELASTIC_WORLD_ENV) and bootstrap.agent_dir() is not None:
            if self.ctx.is_local_main:
                log.warning("the stop was requested on another host, which leaves this elastic job: this host's "
                            "workers start again with the hosts left, from the checkpoint of step %d", step)
            code = workers.HOST_LEFT_EXIT_CODE
        elif elsewhere and self.ctx.is_local_main and stop_host_agent():
            log.warning("the stop was requested on another host: stopping this host's launcher too")
        if stopped and committed:
            bootstrap.note(committed=f"step {step}")  # the launcher's last line says so
        return code
