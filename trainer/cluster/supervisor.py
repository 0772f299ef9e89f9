"""torchrun, run in this very process, with its failures turned into one-line errors.

The launcher execs `python -m trainer.cluster.supervisor <torchrun args>`: the process that receives the
container's signals *is* torchrun (same PID, torchrun's own agent code), but instead of torchrun's
multi-line failure report the user reads which rank failed how, or why rendezvous never completed.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Mapping

from trainer.core.errors import UsageError, print_error

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


def _arg(args: list[str], name: str) -> str:
    prefix = f"--{name}="
    return next((a[len(prefix):] for a in args if a.startswith(prefix)), "?")


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


def describe_child_failure(failures: dict) -> tuple[str, int]:
    """(message, exit code) for torchrun's ChildFailedError.failures: {global rank: ProcessFailure}, in the
    order torchrun observed them."""
    (rank, failure), _ = min(zip(failures.items(), range(len(failures))), key=_root_cause_first)
    code = failure.exitcode
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    others = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    where = "its own error is printed above" if code > 0 else "the signal came from outside the trainer"
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


def _drop_torchruns_failure_line() -> None:
    """torchrun logs each worker failure on its own; the one line main() prints says it for all of them."""
    import logging

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not str(record.msg).startswith("failed (exitcode"))


def main(argv: list[str] | None = None) -> int:
    try:
        _import_torch_quietly()
    except KeyboardInterrupt:  # Ctrl-C in the seconds before torchrun (which handles it later) runs
        print_error("interrupted (SIGINT) before the workers started")
        return 130
    _drop_torchruns_failure_line()
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = list(sys.argv[1:] if argv is None else argv)
    endpoint = f"{_arg(args, 'master-addr')}:{_arg(args, 'master-port')}"
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    try:
        run(parse_args(args))
    except ChildFailedError as err:
        message, code = describe_child_failure(err.failures)
        print_error(message)
        return code
    except SignalException as err:
        # torchrun has already passed the signal on and waited for the workers, which checkpoint and exit 0.
        print(f"stopped by {signal.Signals(err.sigval).name}: workers were asked to checkpoint and exit",
              file=sys.stderr, flush=True)
        return 0 if err.sigval in (signal.SIGTERM, signal.SIGINT) else 1
    except (RendezvousError, DistError, TimeoutError) as err:
        detail = " ".join(str(err).split())[:300]
        print_error(f"rendezvous at {endpoint} ({_arg(args, 'nnodes')} nodes) failed: {detail} ({rendezvous_fix(os.environ)})")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
