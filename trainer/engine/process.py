"""This process's way into the job and out of it: joining the process group (a failed rendezvous in one line), the
same software on every host, amp as this device runs it, and the one line for a failure that ends the run."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace
from typing import Callable

from trainer.checkpoint.store import CheckpointError
from trainer.cluster.topology import Topology
from trainer.cluster.versions import check_same_versions, version_fingerprint
from trainer.config.settings import TrainConfig, check_gpu_options
from trainer.core.errors import Diverged, Fenced, UsageError, exit_on_usage_error, print_error
from trainer.engine import inplace
from trainer.parallel import collectives
from trainer.parallel.collectives import MainRankFailed
from trainer.parallel.compat import private
from trainer.parallel.context import DistContext, collective_failure, rendezvous_failure, setup
from trainer.parallel.supervised import peer_failed_first, stuck_peers

log = logging.getLogger("trainer")
# One line and exit 1: the run's own failures.
RUN_ERRORS = (CheckpointError, Diverged, MainRankFailed, Fenced)  # (inplace.QuorumFailed: end_for_lost_lighthouse)


def join(topology: Topology, config: TrainConfig, timeout_setting: str) -> DistContext:
    """The process group of this process's topology; a rendezvous that fails is one line, exit 1."""
    try:
        with exit_on_usage_error():
            return setup(topology, config.backend, config.collective_timeout)
    except SystemExit:
        raise
    except Exception as err:
        message = rendezvous_failure(topology, err, timeout_setting, config.collective_timeout)
        if message is None:
            raise
        print_error(message)
        raise SystemExit(1) from None


def check_same_software(ctx: DistContext) -> None:
    """Mismatched images across hosts fail here, clearly, instead of hanging in a collective."""
    problem = check_same_versions(collectives.all_gather_objects(ctx, version_fingerprint()))
    if problem:
        raise UsageError("image", problem, "run the same trainer image on every host")


def for_this_device(config: TrainConfig, ctx: DistContext, label: Callable[[str], str]) -> TrainConfig:
    """amp as this device runs it, decided once (the optimizer and the checkpoint follow it)."""
    import torch

    cuda = ctx.device.type == "cuda"
    check_gpu_options(config.backend, config.sync_bn, cuda, ctx.world_size, label)
    if cuda or config.amp == "off":
        return config
    amp = label("amp")
    if config.amp == "fp16":  # its loss scaler is CUDA's
        log.warning("%s fp16 applies to CUDA only; training in fp32 on the CPU (%s bf16 works on CPUs)", amp, amp)
        return replace(config, amp="off")
    if not cpu_has_bf16(torch):
        log.warning("this CPU has no bf16 instructions (AVX512-BF16, AMX or Arm BF16): %s bf16 will likely be "
                    "slower than fp32 here", amp)
    return config


def cpu_has_bf16(torch) -> bool:
    """Whether this CPU has bf16 instructions. mkldnn's check is a private op: without it, assume it has them
    (the warning it feeds is advice, never worth a crash)."""
    probe = private("torch.ops.mkldnn._is_mkldnn_bf16_supported", lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported)
    return probe is None or bool(torch.backends.mkldnn.is_available() and probe())


def exit_for(exc_type, exc, timeout_setting: str, timeout_s: float) -> None:
    """A failure that ended the run, once the run let go of its group: a usage mistake or one of the run's own
    failures is one line (exit 2 or 1), a collective that failed one line naming its wait; else nothing (the
    script's own error: its traceback, then the launcher's line naming the rank)."""
    if issubclass(exc_type, UsageError):
        with exit_on_usage_error():
            raise exc
    if issubclass(exc_type, inplace.QuorumFailed):  # an infrastructure fault: the launcher may restart the workers
        end_for_lost_lighthouse(exc)
    if issubclass(exc_type, RUN_ERRORS):
        print_error(str(exc))
        raise SystemExit(1) from None
    what = collective_failure(exc) if issubclass(exc_type, Exception) else None
    if what is None:
        return
    stuck = stuck_peers()  # this host's ranks outside the collective, by their stacks (a second)
    what = f"{what}; {stuck}" if stuck else what
    line = (f"collective: {what} (a peer rank died or stalled, or the network between hosts broke; see the other "
            f"ranks' logs; {timeout_setting}, now {timeout_s:g} s, sets the wait)")
    if peer_failed_first():  # the cause is that rank's: the launcher's one error line names it
        sys.stderr.write(f"warning: {line}; a rank of this host failed first\n")
    else:
        say_failure(line, "a peer was lost: ")
    raise SystemExit(1) from None


def end_for_lost_lighthouse(lost: Exception, say: bool = True) -> None:
    """In place, no quorum or no lighthouse: exit 1, restartable (never 2, a mistake in the settings); a warning while
    the launcher has a restart left (not the run's end), else the run's one error line. say: this process says it."""
    if say:
        say_failure(str(lost))
    raise SystemExit(1) from None


def say_failure(line: str, cause: str = "") -> None:
    """A failure that ends this worker: a warning while the launcher has a restart left for it (not the run's end:
    "LINE; CAUSE the launcher restarts the workers (restart N of M)"), else the run's one error line."""
    if (restart := next_restart()) is not None:
        sys.stderr.write(f"warning: {line}; {cause}the launcher restarts the workers ({restart})\n")
    else:
        print_error(line)


def next_restart() -> str | None:
    """"restart N of M" where the agent that started this worker restarts it after a failure (torchrun's documented
    TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS; an elastic job's membership changes count none); None
    where no restart is left, or no agent restarts it."""
    try:
        done, most = (int(os.environ[f"TORCHELASTIC_{name}"]) for name in ("RESTART_COUNT", "MAX_RESTARTS"))
    except (KeyError, ValueError):
        return None
    return f"restart {done + 1} of {most}" if done < most else None
