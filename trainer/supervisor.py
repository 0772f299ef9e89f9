"""torchrun, run in this very process, with its failures turned into one-line errors.

The launcher execs `python -m trainer.supervisor <torchrun args>`: the process that receives the
container's signals *is* torchrun (same PID, torchrun's own agent code), but instead of torchrun's
multi-line failure report the user reads which rank failed how, or why rendezvous never completed.
"""

from __future__ import annotations

import signal
import sys

RENDEZVOUS_FIX = ("start every host with the same NNODES, MASTER_ADDR and MASTER_PORT, NODE_RANK 0 first; "
                  "open MASTER_PORT on the NODE_RANK 0 host's firewall; raise RDZV_TIMEOUT for slow starts")


def _arg(args: list[str], name: str) -> str:
    prefix = f"--{name}="
    return next((a[len(prefix):] for a in args if a.startswith(prefix)), "?")


def describe_child_failure(failures: dict) -> tuple[str, int]:
    """(message, exit code) for torchrun's ChildFailedError.failures: {global rank: ProcessFailure}."""
    rank, failure = min(failures.items())
    code = failure.exitcode
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    others = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
    return f"training failed: rank {rank} {how}{others}; its own error is printed above", (code if code > 0 else 1)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    args = list(sys.argv[1:] if argv is None else argv)
    endpoint = f"{_arg(args, 'master-addr')}:{_arg(args, 'master-port')}"
    try:
        run(parse_args(args))
    except ChildFailedError as err:
        message, code = describe_child_failure(err.failures)
        print(f"error: {message}", file=sys.stderr, flush=True)
        return code
    except SignalException as err:
        # torchrun has already passed the signal on and waited for the workers, which checkpoint and exit 0.
        print(f"stopped by {signal.Signals(err.sigval).name}: workers were asked to checkpoint and exit",
              file=sys.stderr, flush=True)
        return 0 if err.sigval in (signal.SIGTERM, signal.SIGINT) else 1
    except (RendezvousError, DistError, TimeoutError) as err:
        detail = " ".join(str(err).split())[:300]
        print(f"error: rendezvous at {endpoint} ({_arg(args, 'nnodes')} nodes) failed: {detail} ({RENDEZVOUS_FIX})",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
