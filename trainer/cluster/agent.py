"""The launcher's agent: torch's elastic agent (LocalElasticAgent, what torchrun runs), built from the resolved
topology and driven through its documented hooks, with every end said in one line.

trainer-launch runs it in its own process (the one that receives the container's signals). The agent's own state
says what happened: `_monitor_workers`' RunResult names the failed ranks and their exit codes (a restart is
announced from it, a usage error ends the job instead of being restarted), `_stop_workers` gives the workers
STOP_GRACE_PERIOD (less the launcher's room) at every stop, and the exit barrier is bounded by it and announced.
Beside the agent run the hang watchdog (watchdog.py) and, on several hosts, the host presence (presence.py); the
workers' records (workers.py) say how a stop ended. Torch-free at import: torch is loaded by run().
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

from trainer.cluster import presence, workers
from trainer.cluster.presence import newest_attempt, store_client
from trainer.cluster.topology import Topology
from trainer.cluster.watchdog import Watchdog
from trainer.core.errors import USAGE_EXIT_CODE, print_error

BOOTSTRAP = ("-m", "trainer.parallel.bootstrap")
STORE_LOST_S = 30.0  # an elastic host that has not reached the rendezvous store for this long ends itself
BARRIER_NOTE_S = 3.0  # a wait for the other hosts that lasts this long is announced
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torchrun's default set


class WorkerUsageError(Exception):
    """A worker exited with the usage-error code (2) where the agent would restart it."""


def _root_cause_first(item: tuple) -> tuple:
    """The root cause failed first. Once one rank fails, the agent SIGTERMs the rest, and a rank that is already
    exiting over its lost peer dies of it; so within the same second (the timestamps' unit) a rank killed from
    outside comes first, then one that exited with an error, then SIGTERM; then the one the agent saw first (it
    records failures in the order it observed them: those it found failed before it stopped the others come
    before those that died of the stop, whatever their exit code)."""
    (rank, failure), observed = item
    code = failure.exitcode
    kind = 2 if code == -signal.SIGTERM else 0 if code < 0 else 1
    return failure.timestamp, kind, observed


def cause(failures: dict) -> tuple[int, object]:
    """(global rank, ProcessFailure) of the failure that came first, of the agent's {global rank: failure}."""
    return min(zip(failures.items(), range(len(failures))), key=_root_cause_first)[0]


def how(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def describe_child_failure(failures: dict, gone: str | None = None, ended: frozenset[int] = frozenset()
                           ) -> tuple[str, int]:
    """(message, exit code) for the agent's failures {global rank: ProcessFailure}, in the order it observed them;
    `gone`: the hosts that went away meanwhile (presence.py); `ended`: the ranks whose program had returned (their
    record says exit 0) before the process died."""
    if not failures:  # UNHEALTHY: a worker stuck in the kernel (torch's D-state check), no exit code
        return "training failed: a worker hung in the kernel (uninterruptible sleep) and was stopped", 1
    rank, failure = cause(failures)
    code = failure.exitcode
    if code == -signal.SIGABRT and rank in ended:
        return (f"training failed: rank {rank} aborted at exit, after its last step (its program had returned; a "
                "process group still held by a model at the interpreter's exit aborts it: docs/scripts.md#the-end-"
                "of-a-script says how to end cleanly)", 1)
    others = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    where = "its own error is printed above" if code > 0 else "the signal came from outside the trainer"
    if gone:
        return f"training failed: {gone}; rank {rank} {how(code)}{others} when it lost its peers", (code if code > 0 else 1)
    return f"training failed: rank {rank} {how(code)}{others}; {where}", (code if code > 0 else 1)


def describe_stop(sig: int, folder: Path, expected: int) -> tuple[str, int]:
    """(last line, exit code) after a signal stopped this host: 0 only when every worker exited 0."""
    name = signal.Signals(sig).name
    found = workers.read_workers(folder)
    clean = bool(found) and len(found) == expected and all(w.exit == 0 for w in found)
    committed = sorted({w.committed for w in found if w.committed})
    saved = f"the stop checkpoint {committed[-1]} is committed" if committed else "no checkpoint was committed at " \
        "the stop"
    if clean:
        return f"stopped by {name}: every worker on this host exited 0; {saved}", 0
    killed = [w.rank for w in found if w.exit is None]
    failed = [f"rank {w.rank} exited with code {w.exit}" for w in found if w.exit not in (None, 0)]
    parts = failed + ([f"{_ranks(killed)} {'was' if len(killed) == 1 else 'were'} killed before exiting (no "
                       f"handler for {name}, or still busy after torchrun's 30 s)"] if killed else [])
    if len(found) < expected:
        parts.append(f"{expected - len(found)} worker(s) had not started")
    return f"stopped by {name}: {'; '.join(parts)}; {saved}", 128 + sig


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def rendezvous_fix(topology: Topology) -> str:
    """What to check, in the names of the variables this job's topology came from (NNODES by hand, SLURM_NNODES
    under Slurm, PET_NNODES on Kubeflow, ...)."""
    same = topology.variables("nnodes", "master_addr", "master_port")
    return (f"every host needs the same {', '.join(same)} and the host with {topology.variables('node_rank')[0]}=0 "
            "up; open the master port in that host's firewall; raise RDZV_TIMEOUT for slow starts")


def _import_torch_quietly() -> None:
    """The store client logs every connection retry with a C++ stack trace; our one line says it better.
    Only this process is quieted: the workers inherit the user's TORCH_CPP_LOG_LEVEL, if any."""
    user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = user_level or "FATAL"
    import torch  # noqa: F401 (c10 reads the level once, when it loads)

    if user_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


@contextlib.contextmanager
def agent_folder() -> Iterator[str]:
    """Where this host's workers leave their records (and the agent its workers' error files): a private temp
    folder, or /dev/shm where the temp directory is read-only (some container runtimes' images)."""
    for where in (None, "/dev/shm"):
        try:
            folder = tempfile.mkdtemp(prefix="trainer-agent-", dir=where)
            break
        except OSError:
            continue
    else:
        print_error("TMPDIR: no writable temporary directory (nor /dev/shm) for the workers' records (mount a "
                    "writable /tmp, or set TMPDIR to a writable directory)")
        raise SystemExit(2)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Job:
    """What the agent's hooks report to, and what run() reads at the end: the restarts so far, the exit barrier."""

    def __init__(self, launch, folder: Path):
        self.topology, self.settings, self.folder = launch.topology, launch.settings, folder
        self.failures = self.starts = 0
        self.done_at: float | None = None  # when this host's workers succeeded (the exit barrier began)
        self.barrier_note: threading.Timer | None = None
        self.store_at = store_at(self.topology)

    def starting(self, group) -> None:
        """A static job's group meets under a key prefix of its own in the agent's store, which outlives restarts
        (see presence.newest_attempt); an elastic round's store is new every round."""
        if group.spec.rdzv_handler.use_agent_store:
            own = self.starts
            if self.topology.nnodes > 1:
                own = newest_attempt(store_client((self.topology.master_addr, self.topology.master_port), 60), own)
            os.environ[workers.STORE_PREFIX_ENV] = f"{workers.STORE_PREFIX}{own}"
        self.starts += 1

    def failed(self, result) -> None:
        """A failed group: the agent restarts it while restarts remain; say so, in one line, from its RunResult."""
        self.failures += 1
        if self.failures > self.settings.max_restarts or not result.failures:
            return
        rank, failure = cause(result.failures)
        code, what = failure.exitcode, f"rank {rank} {how(failure.exitcode)}"
        nodes = self.topology.node_range
        head = f"restart {self.failures} of {self.settings.max_restarts}"
        if code == workers.HOST_LEFT_EXIT_CODE and self.topology.elastic:
            say(f"{head}: another host left the job (it was stopped, and every rank committed a checkpoint); the "
                f"hosts still here meet again (NNODES={nodes}) and go on from that checkpoint, at the new world size")
            return
        if code == USAGE_EXIT_CODE:
            # A mistake in the settings (the one-line error above) fails the same way every time: a restart would
            # only print it again. The agent stops its workers and the rendezvous closes, so other hosts end too.
            raise WorkerUsageError(what)
        then = (f"the hosts still here meet again (NNODES={nodes}) and every rank starts again from the newest "
                "checkpoint, at the new world size") if self.topology.elastic else (
                "every rank of this host starts again from the newest checkpoint")
        say(f"{head}: {what}; {then}")

    def succeeded(self, group) -> None:
        """This host's workers are done: the agent waits in its exit barrier for the other hosts, at most
        STOP_GRACE_PERIOD; a wait that lasts is announced."""
        if group.group_world_size > 1 and self.done_at is None:
            self.done_at = time.monotonic()
            self.barrier_note = threading.Timer(BARRIER_NOTE_S, say, [
                f"this host's workers are done; waiting up to {self.settings.stop_grace:g} s (STOP_GRACE_PERIOD) "
                "for the other hosts to finish theirs"])
            self.barrier_note.daemon = True
            self.barrier_note.start()

    def barrier_ran_out(self) -> bool:
        if self.barrier_note is not None:
            self.barrier_note.cancel()
        return self.done_at is not None and time.monotonic() - self.done_at >= 0.95 * self.settings.stop_grace


def store_at(topology: Topology) -> tuple[str, int] | None:
    """The rendezvous store of a job of several hosts (None on one host): the static store of node 0, or the
    elastic job's c10d store (whose keys change with every round)."""
    return (topology.master_addr, topology.master_port) if topology.nnodes > 1 else None


AGENT_LOG = "torch.distributed.elastic.agent.server.api"
PROCESSES_LOG = "torch.distributed.elastic.multiprocessing.api"


@contextlib.contextmanager
def quiet(name: str) -> Iterator[None]:
    """torch's logger `name` says nothing inside the block (its records: the job's own lines say the same)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def agent_type():
    """LocalElasticAgent, driven through its documented hooks (SimpleElasticAgent's abstract methods)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class Agent(LocalElasticAgent):
        def __init__(self, spec, job: Job):
            super().__init__(spec, DefaultLogsSpecs(log_dir=str(job.folder)), start_method="spawn",
                             exit_barrier_timeout=job.settings.stop_grace,
                             shutdown_timeout=job.settings.workers_grace)
            self.job = job

        def _start_workers(self, worker_group):
            self.job.starting(worker_group)
            return super()._start_workers(worker_group)

        def _stop_workers(self, worker_group):  # a restart's or a new round's stop: the same grace as any other
            self._shutdown(timeout=self.job.settings.workers_grace)

        def _monitor_workers(self, worker_group):
            with quiet(PROCESSES_LOG):  # its failure report per worker: the job's lines below say it once
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

    rdzv, topology = launch.rendezvous, launch.topology
    params = RendezvousParameters(backend=rdzv.backend, endpoint=rdzv.endpoint, run_id=rdzv.run_id,
                                  min_nodes=topology.min_nodes or topology.nnodes, max_nodes=topology.nnodes,
                                  local_addr=rdzv.local_addr, **rdzv.config)
    static = rdzv.backend == "static"
    # torchrun's own worker command: the interpreter, unbuffered, here through the bootstrap.
    return WorkerSpec(role="default", local_world_size=topology.nproc_per_node, entrypoint=sys.executable,
                      args=("-u", *BOOTSTRAP, *program), rdzv_handler=get_rendezvous_handler(params),
                      max_restarts=launch.settings.max_restarts, monitor_interval=0.1,
                      master_addr=topology.master_addr if static else None,
                      master_port=topology.master_port if static else None, local_addr=rdzv.local_addr)


def _raise_stop(signum, _frame):
    from torch.distributed.elastic.multiprocessing import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def run(launch, program: list[str]) -> int:
    """Run this host's part of the job (program: the target and its arguments); the exit status to exit with."""
    try:
        _import_torch_quietly()
    except KeyboardInterrupt:  # Ctrl-C in the seconds before the agent (which handles it later) runs
        print_error("interrupted (SIGINT) before the workers started")
        return 130
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

    topology, settings = launch.topology, launch.settings
    # The agent's own log (rendezvous details, a stop's signal, the exit barrier's timeout as a traceback): the
    # launcher's lines say what happened.
    logging.getLogger(AGENT_LOG).setLevel(logging.CRITICAL + 1)
    if "OMP_NUM_THREADS" not in os.environ and topology.nproc_per_node > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # torchrun's default for several workers per host
    os.environ[workers.AGENT_PID_ENV] = str(os.getpid())
    for sig in STOP_SIGNALS:  # a stop during the rendezvous ends as one the agent saw (it takes them over later)
        signal.signal(sig, _raise_stop)
    with agent_folder() as folder_name:
        folder = Path(folder_name)
        os.environ[workers.AGENT_DIR_ENV] = folder_name
        job = Job(launch, folder)
        dog = Watchdog(folder, settings.hang_timeout, job.store_at, lambda: os.kill(os.getpid(), signal.SIGTERM)) \
            if settings.hang_timeout else None
        if dog is not None:
            dog.start()
        beat = start_presence(job)
        spec, stopped = None, False
        try:
            spec = worker_spec(launch, program)
            result = agent_type()(spec, job).run()
        except WorkerUsageError as err:
            end_presence(beat, job, "failed", failed=False)
            print_error(f"training failed: {err}; its own error is printed above (a mistake in the settings is not "
                        "restarted)")
            return USAGE_EXIT_CODE
        except SignalException as err:
            stopped = True  # the rendezvous stays open: the other hosts of an elastic job go on
            end_presence(beat, job, "stopped", failed=False)
            if dog is not None and dog.fired:
                print_error(dog.fired)
                return 1
            # The agent has passed the signal on and waited for the workers (STOP_GRACE_PERIOD), then killed them.
            message, code = describe_stop(err.sigval, folder, topology.nproc_per_node)
            say(message)
            return code
        except (RendezvousError, DistError, TimeoutError) as err:
            return rendezvous_failed(err, job, beat, isinstance(err, RendezvousTimeoutError))
        finally:
            if beat is not None:  # stopped on every way out (after the verdicts above, which need it beating)
                beat.stop()
            if spec is not None and not stopped:
                with contextlib.suppress(Exception):  # closes an elastic rendezvous: the other hosts end too
                    spec.rdzv_handler.shutdown()
        if result is None:  # the rendezvous was closed (another host's agent ended the job)
            print_error("training failed: the rendezvous was closed by another host (see its log)")
            return 1
        if result.is_failed():
            if dog is not None and dog.fired:  # the agent saw the killed workers before the stop
                end_presence(beat, job, "failed", failed=False)
                print_error(dog.fired)
                return 1
            gone = end_presence(beat, job, "failed", failed=True)
            ended = frozenset(w.rank for w in workers.read_workers(folder) if w.exit == 0)
            message, code = describe_child_failure(result.failures, gone, ended)
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
        fix = rendezvous_fix(topology)
        if "address already in use" in detail.lower() or "EADDRINUSE" in detail:
            fix = (f"another process took port {topology.master_port} between the launcher's check and the agent's "
                   "bind: choose a free MASTER_PORT, the same on every host (on one host, leave it unset and the "
                   "launcher takes a free one)")
        print_error(f"rendezvous at {endpoint} ({topology.node_range} nodes) failed: {detail} ({fix})")
    return 1


def start_presence(job: Job) -> presence.Presence | None:
    if job.store_at is None:
        return None
    on_lost = (lambda: store_lost(job)) if job.topology.elastic else None
    node = "" if job.topology.elastic else str(job.topology.node_rank)
    beat = presence.Presence(job.store_at, presence.label(node), on_lost, STORE_LOST_S)
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
        env = {**os.environ, workers.AGENT_DIR_ENV: folder}
        proc = subprocess.Popen([sys.executable, *BOOTSTRAP, *program], env=env,
                                start_new_session=True)  # its own group: the sentinel's, and the stop's target
        received: list[int] = []

        def forward(sig, _frame):
            received.append(sig)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        timeout = launch.settings.hang_timeout
        dog = Watchdog(Path(folder), timeout, None, lambda: None) if timeout else None
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
            killed = f"was killed by it (no handler for {name})" if code == -received[0] else how(code)
            say(f"stopped by {name}: the script {killed}")
            return 128 + received[0]
        if code < 0:
            print_error(f"training failed: the script was killed by {signal.Signals(-code).name}; the signal came "
                        "from outside the trainer")
            return 128 - code
        if code > 0:
            print_error(f"training failed: the script exited with code {code}; its own error is printed above")
        return code
