"""The launcher's agent: torch's elastic agent (LocalElasticAgent, what torchrun runs), built from the resolved
topology and driven through its documented hooks, with every end said in one line.

trainer-launch runs it in its own process (the one that receives the container's signals). The agent's own state
says what happened: `_monitor_workers`' RunResult names the failed ranks and their exit codes (a restart is
announced from it; a usage error ends the job instead of being restarted), `_stop_workers` gives the workers
STOP_GRACE_PERIOD (less the launcher's room) at every stop, and the exit barrier is bounded by it and announced.
Beside the agent run the hang watchdog (watchdog.py) and, on several hosts, the host presence (presence.py); the
workers' records (workers.py) say how a stop ended. Torch-free at import: torch is loaded by run().
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from trainer.cluster import presence, workers
from trainer.cluster.watchdog import Watchdog
from trainer.config.settings import RUN_STARTED_ENV
from trainer.core.errors import USAGE_EXIT_CODE, print_error

BOOTSTRAP = ("-m", "trainer.parallel.bootstrap")
STORE_LOST_S = 30.0  # an elastic host that has not reached the rendezvous store for this long ends itself
BARRIER_NOTE_S = 3.0  # a wait for the other hosts that lasts this long is announced
HOST = socket.gethostname()
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torchrun's default set
AGENT_LOG, PROCESSES_LOG = "torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"
# PROCESSES_LOG's warning for each worker it stops ("Sending process 12712 closing signal SIGTERM"), its templates in
# torch 2.13 and 2.14: at a restart or a new round the launcher's own line says why. Reworded by a torch upgrade, the
# warning shows again; nothing else changes.
CLOSING = ("Sending process %s closing signal %s", "Closing process %s via signal %s")


class WorkerUsageError(Exception):
    """A worker exited with the usage-error code (2) where the agent would restart it."""


def cause(failures: dict) -> tuple[int, object]:
    """(global rank, ProcessFailure) of the failure that came first, of the agent's {global rank: failure} (in the
    order it observed them). Once one rank fails the agent SIGTERMs the rest, and a rank already exiting over its
    lost peer dies of it; so within the same second (the timestamps' unit) a rank killed from outside comes first,
    then one that exited with an error, then SIGTERM; then the one the agent saw first."""
    def order(item):
        (_, failure), observed = item
        code = failure.exitcode
        return failure.timestamp, 2 if code == -signal.SIGTERM else 0 if code < 0 else 1, observed
    return min(zip(failures.items(), range(len(failures))), key=order)[0]


def how(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def describe_child_failure(failures: dict, gone: str | None = None, ended: frozenset[int] = frozenset(),
                           named: Callable[[int], str | None] = lambda rank: None) -> tuple[str, int]:
    """(message, exit code) for the agent's failures {global rank: ProcessFailure}; `gone`: the hosts that went
    away meanwhile (presence.py); `ended`: the ranks whose program had returned (record: exit 0) before they died;
    `named`: a rank's name where it is not the agent's (in place, Job.named)."""
    if not failures:  # UNHEALTHY: a worker stuck in the kernel (torch's D-state check), no exit code
        return "training failed: a worker hung in the kernel (uninterruptible sleep) and was stopped", 1
    rank, failure = cause(failures)
    code, who = failure.exitcode, named(rank) or f"rank {rank}"
    if code == -signal.SIGABRT and rank in ended:
        return (f"training failed: {who} aborted at exit, after its last step (its program had returned; a "
                "process group still held by a model at the interpreter's exit aborts it: docs/scripts.md#the-end-"
                "of-a-script says how to end cleanly)", 1)
    # The others that failed of their own: not a rank the agent stopped with SIGTERM once this one failed, nor one
    # whose program had returned (a script's rank 0 that ended first is not a failure, however late it exited).
    own = [r for r, f in failures.items() if r != rank and f.exitcode != -signal.SIGTERM and r not in ended]
    others = f" (and {len(own)} more)" if own else ""
    where = "its own error is printed above" if code > 0 else "the signal came from outside the trainer"
    what = f"{gone}; {who} {how(code)}{others} when it lost its peers" if gone else \
        f"{who} {how(code)}{others}; {where}"
    return f"training failed: {what}", (code if code > 0 else 1)


def describe_stop(sig: int, folder: Path, expected: int, grace: int) -> tuple[str, int]:
    """(last line, exit code) after a signal stopped this host: 0 only when every worker exited 0. grace: the seconds
    the workers had to stop."""
    name = signal.Signals(sig).name
    found = workers.read_workers(folder)
    committed = sorted({w.committed for w in found if w.committed})
    saved = f"the stop checkpoint {committed[-1]} is committed" if committed else \
        "no checkpoint was committed at the stop" if any(w.supervised for w in found) else \
        "no checkpoint through trainer.api (the launcher does not see a script's own checkpoint files)"
    if found and len(found) == expected and all(w.exit == 0 for w in found):
        return f"stopped by {name}: every worker on this host exited 0; {saved}", 0
    if not any(w.training or (w.joined and not w.supervised) for w in found):
        return f"stopped by {name} during start-up, before training began; {saved}", 128 + sig
    killed = [w.rank for w in found if w.exit is None]
    parts = [f"rank {w.rank} exited with code {w.exit}" for w in found if w.exit not in (None, 0)]
    if killed:
        parts.append(f"{'rank' if len(killed) == 1 else 'ranks'} {', '.join(map(str, killed))} "
                     f"{'was' if len(killed) == 1 else 'were'} killed before exiting (no handler for {name}, or "
                     f"still busy after the {grace} s a stop gives, STOP_GRACE_PERIOD less the launcher's room)")
    if len(found) < expected:
        parts.append(f"{expected - len(found)} worker(s) had not started")
    return f"stopped by {name}: {'; '.join(parts)}; {saved}", 128 + sig


AGENT_FOLDER_PREFIX = "trainer-agent-"
# In every agent folder: its launcher's pid, and an fcntl lock on it that the launcher holds while it runs. The
# kernel drops the lock when the launcher dies, however it dies (SIGKILL, an OOM kill): a folder whose lock can be
# taken is a leftover. The lock, not the pid, says so: a dead launcher's pid may be another process's by now.
OWNER_FILE = "launcher.lock"


def remove_leftover_folders(where: str | None) -> None:
    """Remove the agent folders in `where` (None: the temp directory) whose launcher is gone (SIGKILLed: it could
    not remove its own). Another launcher's on this host (another job) holds its lock and is left alone; so is a
    folder without the owner file (a launcher creating it this moment; one of a trainer before the lock)."""
    with contextlib.suppress(OSError):
        for folder in Path(where or tempfile.gettempdir()).glob(AGENT_FOLDER_PREFIX + "*"):
            try:
                owner = os.open(folder / OWNER_FILE, os.O_RDWR)
            except OSError:  # none (see above), or not ours to open
                continue
            try:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its launcher runs
                os.close(owner)
                continue
            try:
                shutil.rmtree(folder, ignore_errors=True)
            finally:
                os.close(owner)


def _own(folder: str) -> int:
    """Lock `folder` as this launcher's (see OWNER_FILE); the open descriptor, which holds the lock until it is
    closed or the process ends (not inherited: Python's descriptors are close-on-exec, so a worker does not hold
    it). The file is locked before it takes its name, so a folder is never seen with an unlocked owner file."""
    staged = os.path.join(folder, f".{OWNER_FILE}.{os.getpid()}")
    owner = os.open(staged, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(owner, fcntl.LOCK_EX)
    os.write(owner, f"{os.getpid()}\n".encode())
    os.rename(staged, os.path.join(folder, OWNER_FILE))
    return owner


@contextlib.contextmanager
def agent_folder() -> Iterator[str]:
    """Where this host's workers leave their records (and the agent their error files): a private temp folder, or
    /dev/shm where the temp directory is read-only (some container runtimes' images). Owned (OWNER_FILE) while this
    launcher runs; the folders of launchers that died without removing theirs are removed first."""
    for where in (None, "/dev/shm"):
        remove_leftover_folders(where)
        with contextlib.suppress(OSError):
            folder = tempfile.mkdtemp(prefix=AGENT_FOLDER_PREFIX, dir=where)
            break
    else:
        print_error("TMPDIR: no writable temporary directory (nor /dev/shm) for the workers' records (mount a "
                    "writable /tmp, or set TMPDIR to a writable directory)")
        raise SystemExit(2)
    try:
        owner = _own(folder)
    except OSError:  # a file system without locks: the folder is still this launcher's to remove at its end
        owner = None
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if owner is not None:
            os.close(owner)


@contextlib.contextmanager
def quiet(name: str) -> Iterator[None]:
    """torch's logger `name` says nothing inside the block (the launcher's own lines say the same, once)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def without(name: str, messages: tuple[str, ...]) -> Iterator[None]:
    """torch's logger `name` drops these messages (its format strings) inside the block; its others still show."""
    def keep(record: logging.LogRecord) -> bool:
        return record.msg not in messages

    logger = logging.getLogger(name)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Job:
    """What the agent's hooks report to and what run() reads at the end: the failures so far, the exit barrier."""

    def __init__(self, launch, folder: Path):
        self.topology, self.settings, self.folder = launch.topology, launch.settings, folder
        self.in_place = launch.in_place
        self.failures = self.starts = 0
        self.beat: presence.Presence | None = None  # this launcher's beat in the store of a job of several hosts
        self.done_at: float | None = None  # when this host's workers succeeded (the exit barrier began)
        topology = self.topology  # the rendezvous store of a job of several hosts (static, or the c10d one)
        self.store_at = (topology.master_addr, topology.master_port) if topology.nnodes > 1 else None
        self.local_addr = launch.rendezvous.local_addr if launch.rendezvous is not None else None

    def starting(self, group) -> None:
        """A static job's group meets under a key prefix of its own in the agent's store, which outlives restarts
        (see presence.newest_attempt); an elastic round's store is a new one every round. The group before it,
        stopped by now, leaves its records behind: they go (workers.clear_records)."""
        workers.clear_records(self.folder)
        if group.spec.rdzv_handler.use_agent_store:
            attempt = self.starts if self.store_at is None else \
                presence.newest_attempt(presence.store_client(self.store_at, 60), self.starts)
            os.environ[workers.STORE_PREFIX_ENV] = f"{workers.STORE_PREFIX}{attempt}"
        self.starts += 1

    def joined(self, group, waiting: int) -> None:
        """An elastic job's hosts waiting to join (`waiting`: the rendezvous' count) stop the running group: every
        host's workers start again in a new round, with them. Said in one line (torch's only sign was its warning for
        each worker it stops)."""
        nodes = min(self.topology.nnodes, group.group_world_size + max(waiting, 1))
        hosts = "a host" if waiting <= 1 else f"{waiting} hosts"
        say(f"{hosts} joined the job: this host's workers stop, and every worker starts again at world size "
            f"{nodes * self.topology.nproc_per_node} ({nodes} hosts, NNODES={self.topology.node_range}) from the "
            "newest checkpoint")

    def named(self, rank: int) -> str | None:
        """In place, how a line names the agent's rank `rank`: the host's group is its own, so that is the host's
        rank; the job's is the worker's as of its latest quorum (its record). None off the in-place path."""
        if not self.in_place:
            return None
        worker = next((w for w in workers.read_workers(self.folder) if w.rank == rank), None)
        if worker is None or worker.job_rank is None:
            return f"this host's rank {rank} (host {HOST}, before its first quorum)"
        return (f"rank {worker.job_rank} (host {HOST}, replica {worker.replica} of generation {worker.generation}; "
                f"this host's rank {rank})")

    def failed(self, result) -> None:
        """A failed group: the agent restarts it while restarts remain; say so, in one line, from its RunResult."""
        self.failures += 1
        if self.failures > self.settings.max_restarts or not result.failures:
            return
        rank, failure = cause(result.failures)
        code, nodes = failure.exitcode, self.topology.node_range
        who = self.named(rank) or f"rank {rank} (host {HOST})"
        head = f"restart {self.failures} of {self.settings.max_restarts}"
        if code == workers.HOST_LEFT_EXIT_CODE and self.topology.elastic:
            return say(f"{head}: another host left the job (it was stopped, and every rank committed a checkpoint); "
                       f"the hosts still here meet again (NNODES={nodes}) and go on from that checkpoint, at the new "
                       "world size")
        if code == USAGE_EXIT_CODE:
            # A mistake in the settings (the one-line error above) fails the same way every time: a restart would
            # only print it again. The agent stops its workers and the rendezvous closes, so other hosts end too.
            raise WorkerUsageError(f"{who} {how(code)}")
        if self.topology.elastic:
            then = (f"the hosts still here meet again (NNODES={nodes}) and every rank starts again from the newest "
                    "checkpoint, at the new world size")
            # Its own rank died of the lost peer: which host went away is what happened (the survivor's worker is
            # only how it showed). Some seconds of the presence's watch, within those the rendezvous waits anyway
            # for the lost host's heartbeats to lapse.
            gone = self.beat.verdict() if self.beat is not None else None
            if gone is not None:
                if gone.startswith(presence.STORE_GONE_HEAD):
                    then = "the hosts left cannot meet again without it"
                return say(f"{head}: {gone}; {who} {how(code)} when it lost its peers; {then}")
        elif self.in_place:
            then = ("this host's ranks start again (from the newest checkpoint, then a live peer's state) and rejoin "
                    "in place; the other hosts go on without them meanwhile")
        else:
            then = "every rank of this host starts again from the newest checkpoint"
        say(f"{head}: {who} {how(code)}; {then}")

    def succeeded(self, group) -> None:
        """This host's workers are done: the agent waits in its exit barrier for the other hosts' (at most
        STOP_GRACE_PERIOD); a wait that lasts is announced."""
        if group.group_world_size > 1 and self.done_at is None:
            self.done_at = time.monotonic()

            def note():
                time.sleep(BARRIER_NOTE_S)
                if self.done_at is not None:
                    say(f"this host's workers are done; waiting up to {self.settings.stop_grace:g} s "
                        "(STOP_GRACE_PERIOD) for the other hosts to finish theirs")
            threading.Thread(target=note, daemon=True).start()

    def barrier_ran_out(self) -> bool:
        done, self.done_at = self.done_at, None
        return done is not None and time.monotonic() - done >= 0.95 * self.settings.stop_grace


def agent_type():
    """LocalElasticAgent, driven through the hooks SimpleElasticAgent documents for implementers."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    logging.getLogger(AGENT_LOG).setLevel(logging.CRITICAL + 1)  # its rendezvous pages, the barrier's traceback
    # What this agent is built from (torch 2.13 and 2.14 have all of it): a torch without it is refused in one line.
    missing = [name for name in ("_start_workers", "_stop_workers", "_monitor_workers", "_shutdown")
               if not callable(getattr(LocalElasticAgent, name, None))] + \
        [name for name in ("exit_barrier_timeout", "shutdown_timeout")
         if name not in inspect.signature(LocalElasticAgent).parameters]
    if missing:
        import torch

        print_error(f"torch: {torch.__version__}'s elastic agent has no {', '.join(missing)}, which trainer-launch "
                    "drives (install a torch from 2.13 on that has them, as pyproject.toml declares)")
        raise SystemExit(2)

    class Agent(LocalElasticAgent):
        def __init__(self, spec, job: Job):
            super().__init__(spec, DefaultLogsSpecs(log_dir=str(job.folder)), start_method="spawn",
                             exit_barrier_timeout=job.settings.stop_grace, shutdown_timeout=job.settings.workers_grace)
            self.job = job

        def _start_workers(self, worker_group):
            self.job.starting(worker_group)
            return super()._start_workers(worker_group)

        def _stop_workers(self, worker_group):  # a restart's or a new round's stop: the same grace as any other
            with without(PROCESSES_LOG, CLOSING):  # the line of the restart, or of the host that joined, says it
                self._shutdown(timeout=self.job.settings.workers_grace)

        def _restart_workers(self, worker_group):
            # The agent restarts a failed group (Job.failed said why), and a healthy one when hosts wait to join.
            # Torch-private: a torch that renames it only loses this line.
            if worker_group.state == WorkerState.HEALTHY:
                with contextlib.suppress(Exception):  # a line, never worth the job
                    self.job.joined(worker_group, worker_group.spec.rdzv_handler.num_nodes_waiting())
            return super()._restart_workers(worker_group)

        def _monitor_workers(self, worker_group):
            with quiet(PROCESSES_LOG):  # its report of each failed worker: the job's one line says it
                result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                self.job.failed(result)
            elif result.state == WorkerState.SUCCEEDED:
                self.job.succeeded(worker_group)
            return result

    return Agent


def worker_spec(launch, program: list[str]):
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    rdzv, topology, static = launch.rendezvous, launch.topology, launch.rendezvous.backend == "static"
    params = RendezvousParameters(rdzv.backend, rdzv.endpoint, rdzv.run_id, topology.min_nodes or topology.nnodes,
                                  topology.nnodes, rdzv.local_addr, **rdzv.config)
    # torchrun's own worker command: the interpreter, unbuffered, here through the bootstrap.
    return WorkerSpec(role="default", local_world_size=topology.nproc_per_node, entrypoint=sys.executable,
                      args=("-u", *BOOTSTRAP, *program), rdzv_handler=get_rendezvous_handler(params),
                      max_restarts=launch.settings.max_restarts, monitor_interval=0.1,
                      master_addr=topology.master_addr if static else None,
                      master_port=topology.master_port if static else None, local_addr=rdzv.local_addr)


def _import_torch_quietly() -> None:
    """The store client logs every connection retry with a C++ stack trace; our one line says it better.
    Only this process is quieted: the workers inherit the user's TORCH_CPP_LOG_LEVEL, if any."""
    user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = user_level or "FATAL"
    import torch  # noqa: F401 (c10 reads the level once, when it loads)

    if user_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _raise_stop(signum, _frame):
    from torch.distributed.elastic.multiprocessing import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def run(launch, program: list[str]) -> int:
    """This host's part of the job (program: the target and its arguments); the exit status to exit with."""
    try:
        _import_torch_quietly()
    except KeyboardInterrupt:  # Ctrl-C in the seconds before the agent (which handles it later) runs
        print_error("interrupted (SIGINT) before the workers started")
        return 130
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

    topology, settings = launch.topology, launch.settings
    if "OMP_NUM_THREADS" not in os.environ and topology.nproc_per_node > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's default for several workers per host
    os.environ[workers.AGENT_PID_ENV] = str(os.getpid())
    os.environ[RUN_STARTED_ENV] = str(time.time())  # a restart resumes from what this run has committed since
    for sig in STOP_SIGNALS:  # a stop during the rendezvous ends as one the agent saw (it takes them over later)
        signal.signal(sig, _raise_stop)
    with agent_folder() as name:
        folder, os.environ[workers.AGENT_DIR_ENV] = Path(name), name
        job = Job(launch, folder)
        dog = Watchdog(folder, settings.hang_timeout, None if topology.elastic else job.store_at,
                       lambda: os.kill(os.getpid(), signal.SIGTERM)) if settings.hang_timeout else None
        if dog is not None:
            dog.start()
        beat = job.beat = start_presence(job)
        spec = None
        try:
            spec = worker_spec(launch, program)
            result = agent_type()(spec, job).run()
        except WorkerUsageError as err:
            end_presence(beat, job, "failed", failed=False)
            print_error(f"training failed: {err}; its own error is printed above (a mistake in the settings is not "
                        "restarted)")
            return USAGE_EXIT_CODE
        except SignalException as err:
            spec = None  # the rendezvous stays open: the other hosts of an elastic job go on
            end_presence(beat, job, "stopped", failed=False)
            if dog is not None and dog.fired:
                print_error(dog.fired)
                return 1
            # The agent has passed the signal on and waited for the workers (STOP_GRACE_PERIOD), then killed them.
            message, code = describe_stop(err.sigval, folder, topology.nproc_per_node, settings.workers_grace)
            say(message)
            return code
        except (RendezvousError, DistError, TimeoutError) as err:
            return rendezvous_failed(err, job, beat, isinstance(err, RendezvousTimeoutError))
        finally:
            if beat is not None:  # stopped on every way out (after the verdicts above, which need it beating)
                beat.stop()
            if spec is not None:
                with contextlib.suppress(Exception):  # closes an elastic rendezvous: the other hosts end too
                    spec.rdzv_handler.shutdown()
        return finished(result, job, beat, dog, folder)


def finished(result, job: Job, beat, dog, folder: Path) -> int:
    """The verdict on the agent's result, once its workers ended (folder: theirs, still there)."""
    topology, settings = job.topology, job.settings
    if result is None:  # torch's RendezvousGracefulExitError: another host's agent closed the rendezvous
        print_error("training failed: the rendezvous was closed by another host (its log says why)")
        return 1
    if result.is_failed():
        if dog is not None and dog.fired:  # the agent saw the killed workers before the stop
            end_presence(beat, job, "failed", failed=False)
            print_error(dog.fired)
            return 1
        ended = frozenset(w.rank for w in workers.read_workers(folder) if w.exit == 0)
        message, code = describe_child_failure(result.failures, end_presence(beat, job, "failed", True), ended,
                                               job.named)
        print_error(message)
        return code
    if job.barrier_ran_out():
        gone = (beat.verdict() if beat is not None else None) or "another host did not finish"
        say(f"warning: {gone}; this host's workers finished, and it stopped waiting for the other hosts after "
            f"STOP_GRACE_PERIOD ({settings.stop_grace:g} s)")
    alone = workers.trained_alone(workers.read_workers(folder), topology.world_size)
    if alone is not None:
        say(alone)
    return 0


def rendezvous_failed(err: BaseException, job: Job, beat, timed_out: bool) -> int:
    topology, settings = job.topology, job.settings
    started = bool(workers.read_workers(job.folder))  # else the rendezvous never completed
    gone = end_presence(beat, job, "failed", failed=started and not topology.elastic)
    endpoint = f"{topology.master_addr}:{topology.master_port}"
    if gone:
        print_error(f"training failed: {gone}")
    elif started and topology.elastic and timed_out:  # fewer than MIN hosts are left
        print_error(f"training failed: fewer than the {topology.min_nodes} hosts an elastic job needs (NNODES="
                    f"{topology.node_range}) were left, and no other host joined within RDZV_TIMEOUT "
                    f"({settings.rdzv_timeout} s) (start the lost hosts again, or lower MIN: the job resumes from the "
                    "newest checkpoint)")
    elif started and topology.elastic:  # it had run: the c10d store's host is gone
        print_error(f"training failed: the rendezvous host {topology.master_addr} went away (its c10d store at "
                    f"{endpoint} stopped answering): an elastic job goes on without any host but that one (start it "
                    "again there, with the others: the job resumes from the newest checkpoint)")
    else:
        detail = " ".join(str(err).split())[:300]
        if not detail and timed_out:  # the c10d rendezvous' timeout says nothing
            detail = (f"fewer than the {topology.min_nodes or topology.nnodes} hosts NNODES={topology.node_range} "
                      f"needs joined within RDZV_TIMEOUT ({settings.rdzv_timeout} s)")
        detail = detail or type(err).__name__
        # An elastic job's hosts have no NODE_RANK: the rendezvous store is the MASTER_ADDR host's.
        store_host = "the MASTER_ADDR host, which runs the rendezvous store," if topology.elastic else \
            f"the host with {topology.variables('node_rank')[0]}=0"
        fix = (f"every host needs the same {', '.join(topology.variables('nnodes', 'master_addr', 'master_port'))} "
               f"and {store_host} up; open the master port in that host's firewall; raise RDZV_TIMEOUT for slow "
               "starts")
        if "address already in use" in detail.lower() or "EADDRINUSE" in detail:
            fix = (f"another process took port {topology.master_port} between the launcher's check and the agent's "
                   "bind: choose a free MASTER_PORT, the same on every host (on one host, leave it unset and the "
                   "launcher takes a free one)")
        print_error(f"rendezvous at {endpoint} ({topology.node_range} nodes) failed: {detail} ({fix})")
    return 1


def start_presence(job: Job) -> presence.Presence | None:
    if job.store_at is None:
        return None
    elastic = job.topology.elastic
    beat = presence.Presence(job.store_at, presence.label("" if elastic else str(job.topology.node_rank),
                                                          job.local_addr),
                             (lambda: store_lost(job)) if elastic else None, STORE_LOST_S)
    beat.start()
    return beat


def store_lost(job: Job) -> None:
    """An elastic host cut off from the rendezvous store: the agent is blocked in a call to it (it polls the store
    for hosts waiting to join), so it would never notice its failed workers, and the host would hang without a
    word. Say so, stop this host's workers, and end with exit 1 (from the presence thread)."""
    host, port = job.store_at
    print_error(f"training failed: the rendezvous host {host} went away (its c10d store at {host}:{port} has not "
                f"answered for {STORE_LOST_S:g} s: its machine or the network to it is gone); this host stops "
                "(start it again once the rendezvous host answers: the job resumes from the newest checkpoint)")
    workers.kill(workers.read_workers(job.folder))  # they cannot agree on a stop with hosts they cannot reach
    sys.stderr.flush()
    os._exit(1)


def end_presence(beat: presence.Presence | None, job: Job, why: str, failed: bool) -> str | None:
    """This launcher leaves the store's roll; after a failure, first: which hosts went away (a clause, or None).
    The store's own host (node 0) stays until the others have looked: its store is what they look in."""
    if beat is None:
        return None
    gone = beat.verdict() if failed else None
    beat.leave(why)
    if not job.topology.elastic and job.topology.node_rank == 0:
        beat.linger()
    return gone


def run_once(launch, program: list[str]) -> int:
    """A script that starts its own processes (mp.spawn, a tcp:// init), run once on this host: through the same
    bootstrap (its children die with it, its stacks can be read) and with the same truthful end. Torch-free."""
    with agent_folder() as folder:
        proc = subprocess.Popen([sys.executable, *BOOTSTRAP, *program], env={
            **os.environ, workers.AGENT_DIR_ENV: folder, workers.RUN_ONCE_ENV: "1"},
            start_new_session=True)  # its own group: the sentinel's, the stop's target
        received: list[int] = []

        def forward(sig, _frame):
            received.append(sig)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        dog = Watchdog(Path(folder), launch.settings.hang_timeout, None, lambda: None) \
            if launch.settings.hang_timeout else None
        if dog is not None:
            dog.start()
        code = proc.wait()
        if dog is not None and dog.fired:
            print_error(dog.fired)
            return 1
        if received:
            name = signal.Signals(received[0]).name
            if code == 0:
                say(f"stopped by {name}: the script exited 0")
                return 0
            say(f"stopped by {name}: the script "
                + (f"was killed by it (no handler for {name})" if code == -received[0] else how(code)))
            return 128 + received[0]
        if code:
            print_error(f"training failed: the script {how(code)}; " + ("its own error is printed above" if code > 0
                        else "the signal came from outside the trainer"))
        return 128 - code if code < 0 else code
