"""torchrun, run in this very process, with its failures turned into one-line errors.

The launcher execs `python -m trainer.cluster.supervisor <torchrun args>`: the process that receives the
container's signals *is* torchrun (same PID, torchrun's own agent code), but instead of torchrun's
multi-line failure report the user reads which rank failed how, or why rendezvous never completed.
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
from pathlib import Path
from typing import Iterator, Mapping

from trainer.cluster import presence, workers
from trainer.cluster.watchdog import DEFAULT_HANG_TIMEOUT, Watchdog
from trainer.core.errors import USAGE_EXIT_CODE, UsageError, print_error

# Workers find their host's agent (this process) here: see stop_host_agent.
AGENT_PID_ENV = "TRAINER_AGENT_PID"


def rendezvous_fix(env: Mapping[str, str]) -> str:
    """What to check, in the names of the variables this job's topology came from (NNODES by hand,
    SLURM_NNODES under Slurm, PET_NNODES on Kubeflow, ...)."""
    from trainer.cluster.topology import LAUNCHER, resolve

    try:  # the launcher resolved this very environment before it exec'd us
        topology = resolve(env, LAUNCHER, lambda: 0)
        same = topology.variables("nnodes", "master_addr", "master_port") or ["NNODES", "MASTER_ADDR", "MASTER_PORT"]
        rank = (topology.variables("node_rank") or ["NODE_RANK"])[0]
    except UsageError:
        same, rank = ["NNODES", "MASTER_ADDR", "MASTER_PORT"], "NODE_RANK"
    return (f"every host needs the same {', '.join(same)} and the host with {rank}=0 up; open the master port "
            "in that host's firewall; raise RDZV_TIMEOUT for slow starts")


def _arg(args: list[str], name: str, default: str = "?") -> str:
    prefix = f"--{name}="
    return next((a[len(prefix):] for a in args if a.startswith(prefix)), default)


def _rdzv_conf(args: list[str], key: str) -> str:
    """One key of --rdzv-conf=k=v,k=v ("?" when absent)."""
    pairs = dict(item.partition("=")[::2] for item in _arg(args, "rdzv-conf", "").split(",") if "=" in item)
    return pairs.get(key, "?")


def _root_cause_first(item: tuple) -> tuple:
    """The root cause failed first. Once one rank fails, torchrun SIGTERMs the rest, and a rank that is
    already exiting over its lost peer dies of it; so within the same second (the timestamps' unit)
    a rank killed from outside comes first, then one that exited with an error, then SIGTERM; then the
    one torchrun saw first (it records failures in the order it observed them: those it found failed
    before it stopped the others come before those that died of the stop, whatever their exit code)."""
    (rank, failure), observed = item
    code = failure.exitcode
    kind = 2 if code == -signal.SIGTERM else 0 if code < 0 else 1
    return failure.timestamp, kind, observed


def describe_child_failure(failures: dict, gone: str | None = None, ended: frozenset[int] = frozenset()
                           ) -> tuple[str, int]:
    """(message, exit code) for torchrun's ChildFailedError.failures: {global rank: ProcessFailure}, in the
    order torchrun observed them; `gone`: the hosts that went away meanwhile (trainer.cluster.presence); `ended`:
    the ranks whose program had returned (their record says exit 0) before the process died."""
    (rank, failure), _ = min(zip(failures.items(), range(len(failures))), key=_root_cause_first)
    code = failure.exitcode
    if code == -signal.SIGABRT and rank in ended:
        return (f"training failed: rank {rank} aborted at exit, after its last step (its program had returned; a "
                "process group still held by a model at the interpreter's exit aborts it: docs/scripts.md#the-end-"
                "of-a-script says how to end cleanly)", 1)
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    others = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    where = "its own error is printed above" if code > 0 else "the signal came from outside the trainer"
    if gone:
        return f"training failed: {gone}; rank {rank} {how}{others} when it lost its peers", (code if code > 0 else 1)
    return f"training failed: rank {rank} {how}{others}; {where}", (code if code > 0 else 1)


def stop_host_agent(env: Mapping[str, str]) -> bool:
    """Ask this host's torchrun agent to stop, as `docker compose stop` would; False without one.

    A stop begun on one host reaches every rank (they agree on a step), but not the other hosts'
    agents: theirs see their workers succeed and wait up to 300 s in torchrun's exit barrier for the
    stopped host's agent, which never comes. A worker whose stop came from elsewhere calls this, so
    every agent leaves through the same stop path, at once."""
    pid = env.get(AGENT_PID_ENV, "")
    if not pid.isdigit() or int(pid) != os.getppid():
        return False  # not started by this supervisor (plain torchrun, Slurm, a single process)
    os.kill(int(pid), signal.SIGTERM)
    return True


def _import_torch_quietly() -> None:
    """The store client logs every connection retry with a C++ stack trace; our one line says it better.
    Only this process is quieted: the workers inherit the user's TORCH_CPP_LOG_LEVEL, if any."""
    user_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = user_level or "FATAL"
    import torch  # noqa: F401 (c10 reads the level once, when it loads)

    if user_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


class WorkerUsageError(Exception):
    """A worker exited with the usage-error code (2) where torchrun would restart it."""


class _FailureLines(logging.Filter):
    """torchrun logs each worker failure on its own; the one line main() prints says it for all of them. A
    failure torchrun restarts the group for is announced instead, in one line (the restarted ranks then say
    which checkpoint they resume from)."""

    def __init__(self, args: list[str]):
        super().__init__()
        self.max_restarts = int(_arg(args, "max-restarts", "0"))
        self.nodes = _arg(args, "nnodes", "1")  # MIN:MAX for an elastic job
        self.base_rank = int(_arg(args, "node-rank", "0")) * int(_arg(args, "nproc-per-node", "1"))
        self.failures = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("failed (exitcode"):
            return True
        self.failures += 1
        if self.failures <= self.max_restarts:
            try:
                code, local_rank = int(record.args[0]), int(record.args[1])
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                what = f"rank {self.base_rank + local_rank} {how}"
            except (TypeError, ValueError, IndexError):  # another torch's record: say less, never fail
                code, what = None, "a worker failed"
            if code == workers.HOST_LEFT_EXIT_CODE and ":" in self.nodes:
                print(f"restart {self.failures} of {self.max_restarts}: another host left the job (it was stopped, "
                      f"and every rank committed a checkpoint); the hosts still here meet again (NNODES={self.nodes}) "
                      "and go on from that checkpoint, at the new world size", file=sys.stderr, flush=True)
                return False
            if code == USAGE_EXIT_CODE:
                # A mistake in the settings (the one-line error above) fails the same way every time: a restart
                # would only print it again, MAX_RESTARTS times. torchrun's agent stops its workers and closes the
                # rendezvous on the way out, so the other hosts' agents end too.
                raise WorkerUsageError(what)
            then = (f"the hosts still here meet again (NNODES={self.nodes}) and every rank starts again from the "
                    "newest checkpoint, at the new world size") if ":" in self.nodes else (
                    "every rank of this host starts again from the newest checkpoint")
            print(f"restart {self.failures} of {self.max_restarts}: {what}; {then}", file=sys.stderr, flush=True)
        return False


def run_through_bootstrap(config) -> None:
    """torchrun's parsed arguments, changed to start every worker through trainer.cluster.bootstrap."""
    target = ["-m", config.training_script] if config.module else [config.training_script]
    config.module, config.no_python = True, False
    config.training_script = "trainer.cluster.bootstrap"
    config.training_script_args = [*target, *config.training_script_args]


@contextlib.contextmanager
def agent_folder() -> Iterator[str]:
    """Where this host's workers leave their records: a private temp folder, or /dev/shm where the temp
    directory is read-only (some container runtimes' images)."""
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


def describe_stop(sig: int, folder: Path, expected: int) -> tuple[str, int]:
    """(last line, exit code) after a signal stopped this host: 0 only when every worker exited 0."""
    name = signal.Signals(sig).name
    found = workers.read_workers(folder)
    expected = expected or len(found)  # 0: torchrun counts the processes itself (--nproc-per-node=gpu)
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


def hang_timeout(env: Mapping[str, str]) -> int:
    """HANG_TIMEOUT in seconds (0: off); the launcher has checked it (trainer.cluster.launch)."""
    try:
        return max(0, int(env.get("HANG_TIMEOUT", "").strip()))
    except ValueError:
        return DEFAULT_HANG_TIMEOUT


def _elastic(args: list[str]) -> bool:
    """NNODES=MIN:MAX: torchrun's c10d rendezvous at --rdzv-endpoint."""
    return ":" in _arg(args, "nnodes", "1")


def store_at(args: list[str], elastic_too: bool = False) -> tuple[str, int] | None:
    """torchrun's rendezvous store, on a job of several hosts (None on one host). elastic_too: also an elastic
    job's c10d store (--rdzv-endpoint), whose keys change with every round."""
    several_hosts = _arg(args, "nnodes", "1") not in ("1", "1:1")
    if _elastic(args):
        if not elastic_too:
            return None
        host, _, port = _arg(args, "rdzv-endpoint").rpartition(":")
    else:
        host, port = _arg(args, "master-addr"), _arg(args, "master-port")
    return (host, int(port)) if several_hosts and port.isdigit() else None


def start_watchdog(folder: Path, args: list[str]) -> Watchdog | None:
    timeout = hang_timeout(os.environ)
    if not timeout:
        return None
    dog = Watchdog(folder, timeout, store_at(args), lambda: os.kill(os.getpid(), signal.SIGTERM))
    dog.start()
    return dog


# An elastic host that has not reached the rendezvous store for this long ends itself (see store_lost).
STORE_LOST_S = 30.0


def start_presence(args: list[str], folder: Path | None = None) -> presence.Presence | None:
    where = store_at(args, elastic_too=True)
    if where is None:
        return None
    elastic = _elastic(args)
    on_lost = (lambda: store_lost(where, folder)) if elastic and folder is not None else None
    beat = presence.Presence(where, presence.label(_arg(args, "node-rank", "")), on_lost, STORE_LOST_S)
    beat.start()
    return beat


def store_lost(where: tuple[str, int], folder: Path) -> None:
    """An elastic host cut off from the rendezvous store: torchrun's agent is blocked in a call to it (it polls
    the store for hosts waiting to join), so it would never notice its failed workers, and the host would hang
    without a word. Say so, stop this host's workers, and end with exit 1 (from the presence thread)."""
    host, port = where
    print_error(f"training failed: the rendezvous host {host} went away (its c10d store at {host}:{port} has not "
                f"answered for {STORE_LOST_S:g} s: its machine or the network to it is gone); this host stops "
                "(start it again once the rendezvous host answers: the job resumes from the newest checkpoint)")
    workers.kill(workers.read_workers(folder))  # they cannot agree on a stop with hosts they cannot reach
    sys.stderr.flush()
    os._exit(1)


def end_presence(beat: presence.Presence | None, why: str, args: list[str], failed: bool) -> str | None:
    """This launcher leaves the store's roll; after a failure, first: which hosts went away (a clause, or None).
    The store's own host (node 0) stays until the others have looked: its store is what they look in."""
    if beat is None:
        return None
    gone = beat.verdict() if failed else None
    beat.leave(why)
    if _arg(args, "node-rank", "") == "0":
        beat.linger()
    return gone


PER_HOST = "--per-host"


def supervise_one(argv: list[str]) -> int:
    """A script that starts its own processes (mp.spawn, a tcp:// init), run once on this host: through the same
    bootstrap (its children die with it, its stacks can be read) and with the same truthful end. Torch-free."""
    with agent_folder() as folder:
        env = {**os.environ, workers.AGENT_DIR_ENV: folder}
        proc = subprocess.Popen([sys.executable, "-m", "trainer.cluster.bootstrap", *argv], env=env,
                                start_new_session=True)  # its own group: the sentinel's, and the stop's target
        received: list[int] = []

        def forward(sig, _frame):
            received.append(sig)
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        timeout = hang_timeout(os.environ)
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
                print(f"stopped by {name}: the script exited 0", file=sys.stderr, flush=True)
                return 0
            how = f"was killed by it (no handler for {name})" if code == -received[0] else (
                f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
            print(f"stopped by {name}: the script {how}", file=sys.stderr, flush=True)
            return 128 + received[0]
        if code < 0:
            print_error(f"training failed: the script was killed by {signal.Signals(-code).name}; the signal came "
                        "from outside the trainer")
            return 128 - code
        if code > 0:
            print_error(f"training failed: the script exited with code {code}; its own error is printed above")
        return code


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == [PER_HOST]:
        return supervise_one(args[1:])
    try:
        _import_torch_quietly()
    except KeyboardInterrupt:  # Ctrl-C in the seconds before torchrun (which handles it later) runs
        print_error("interrupted (SIGINT) before the workers started")
        return 130
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_FailureLines(args))
    endpoint = _arg(args, "rdzv-endpoint", f"{_arg(args, 'master-addr')}:{_arg(args, 'master-port')}")
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    config = parse_args(args)
    run_through_bootstrap(config)
    expected = int(config.nproc_per_node) if str(config.nproc_per_node).isdigit() else 0
    with agent_folder() as folder:
        os.environ[workers.AGENT_DIR_ENV] = folder
        dog = start_watchdog(Path(folder), args)
        beat = start_presence(args, Path(folder))
        try:
            run(config)
        except ChildFailedError as err:
            if dog is not None and dog.fired:  # the agent saw the killed workers before the stop
                end_presence(beat, "failed", args, failed=False)
                print_error(dog.fired)
                return 1
            # err's traceback holds torchrun's agent, and with it the store node 0 hosts: still up here.
            gone = end_presence(beat, "failed", args, failed=True)
            ended = frozenset(w.rank for w in workers.read_workers(Path(folder)) if w.exit == 0)
            message, code = describe_child_failure(err.failures, gone, ended)
            print_error(message)
            return code
        except WorkerUsageError as err:
            end_presence(beat, "failed", args, failed=False)
            print_error(f"training failed: {err}; its own error is printed above (a mistake in the settings is not "
                        "restarted)")
            return USAGE_EXIT_CODE
        except SignalException as err:
            end_presence(beat, "stopped", args, failed=False)
            if dog is not None and dog.fired:
                print_error(dog.fired)
                return 1
            # torchrun has passed the signal on and waited for the workers (30 s, then SIGKILL).
            message, code = describe_stop(err.sigval, Path(folder), expected)
            print(message, file=sys.stderr, flush=True)
            return code
        except (RendezvousError, DistError, TimeoutError) as err:
            started = bool(workers.read_workers(Path(folder)))  # else the rendezvous never completed
            elastic = _elastic(args)
            gone = end_presence(beat, "failed", args, failed=started and not elastic)
            if gone:
                print_error(f"training failed: {gone}")
                return 1
            if started and elastic and isinstance(err, RendezvousTimeoutError):  # fewer than MIN hosts are left
                print_error(f"training failed: fewer than the {_arg(args, 'nnodes').split(':')[0]} hosts an elastic "
                            f"job needs (NNODES={_arg(args, 'nnodes')}) were left, and no other host joined within "
                            f"RDZV_TIMEOUT ({_rdzv_conf(args, 'join_timeout')} s) (start the lost hosts again, or lower "
                            "MIN: the job resumes from the newest checkpoint)")
                return 1
            if started and elastic:  # it had run: the c10d store's host is gone
                host = endpoint.rpartition(":")[0]
                print_error(f"training failed: the rendezvous host {host} went away (its c10d store at {endpoint} "
                            "stopped answering): an elastic job goes on without any host but that one (start it "
                            "again there, with the others: the job resumes from the newest checkpoint)")
                return 1
            detail = " ".join(str(err).split())[:300]
            fix = rendezvous_fix(os.environ)
            if "address already in use" in detail.lower() or "EADDRINUSE" in detail:
                fix = (f"another process took port {_arg(args, 'master-port')} between the launcher's check and "
                       "torchrun's bind: choose a free MASTER_PORT, the same on every host (on one host, leave it "
                       "unset and the launcher takes a free one)")
            print_error(f"rendezvous at {endpoint} ({_arg(args, 'nnodes')} nodes) failed: {detail} ({fix})")
            return 1
        finally:
            if beat is not None:  # stopped on every way out (after the verdicts above, which need it beating)
                beat.stop()
        alone = workers.trained_alone(workers.read_workers(Path(folder)), world_size(args))
        if alone is not None:
            print(alone, file=sys.stderr, flush=True)
    return 0


def world_size(args: list[str]) -> int:
    try:
        return int(_arg(args, "nnodes", "1").split(":")[-1]) * int(_arg(args, "nproc-per-node", "1"))
    except ValueError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
