"""In-place recovery: a lost or returning host costs the others seconds, not a restart (docs/elastic.md).

Each host's workers are one replica group of torchft's Manager (PyPI `torchft`, one of the project's
dependencies); its lighthouse, beside trainer-launch on the MASTER_ADDR host, says who is here at each step.
The processes stay as they are when a host goes or comes: their CUDA contexts, compiled graphs, DataLoader workers,
optimizer, scheduler, scaler and RNG stay in memory. Run calls this module at the step boundary:

  begin_step()  the quorum (torchft asks the lighthouse): who trains this step. Asked in a thread of its own while
                the training thread reads the step's first batch at the shares it trains now (read again when the
                quorum changed them). A new membership gets a new process group across the hosts (a new generation
                of torchft's reconfigurable gloo group on the first host's store; on GPUs its NCCL group, in a child
                process of each worker, not run on a GPU yet: trainer.engine.replica_group). A host behind
                (returned, or new) gets the state from a live peer over that group before the step: the checkpoint
                dict of trainer.checkpoint, its structure sent with torch.save and read with weights_only=True, its
                tensors as they are in memory (_StateOverGroup). Hosts all behind the job's newest committed
                checkpoint (those that trained further left while they started) go on from it.
  shares        the ranks of the job's largest world this rank trains now (trainer.data.sampling): a host away, its
                share of the global batch is trained by those here, in micro-batches of the same size, so every step
                trains the same samples in the same micro-batches whatever the membership.
  the sum       the gradients summed over the hosts (after the host's own DistributedDataParallel has averaged them
                over its processes: run.wrap() wraps as on the restart path, so checkpoints of either path fit the
                other), overlapped with the backward of the step's last micro-batch (GradientSum): fixed buckets
                made from the model, each launched on torchft's group as soon as its gradients are final (the
                host's DDP hands over each of its averaged buckets; a host of one process keeps its DDP out of
                the backward and hands over each gradient as autograd accumulates it), strictly in bucket order on
                every host.
  commit()      waits for every bucket's sum, then torchft's should_commit: the step counts only if every part
                succeeded on every host (a bucket summed while the next one failed is discarded with the rest). A model's
                buffers (BatchNorm's running statistics) follow share 0's chain, as DDP keeps them (BufferChain).
                Otherwise it is abandoned, its gradients discarded, and taken again at the new membership.

Fencing: a host that comes back after the others went on without it (SIGSTOP, a long pause, a cut network, or
heartbeats the lighthouse received too late on an overloaded machine) must not write a checkpoint or join the newer
group. The generation is the job's number for each new quorum of torchft's (JobGenerations: counted in the
checkpoint directory, it only grows, across restarts of the lighthouse too, whose quorum ids start over): the first
rank of each new generation writes it to the checkpoint directory (GENERATION_FILE) and makes the generation's folder there, retiring the older generations' folders
(trainer.checkpoint.store.open_generation). A host reads the newest generation before each step's quorum; its
checkpoints are written in its generation's folder and committed by a rename out of it, which finds nothing once that
generation is retired: a host frozen anywhere in a write, even between a check and the rename, cannot commit. A host
healed after a generation it never saw is fenced too. Either way it leaves with one line
(trainer.core.errors.Fenced); its launcher starts it again, and it rejoins as a returning host.

Why not torchft's own DistributedDataParallel: with torch 2.14 and gloo its comm hook fails an assertion on the
first lost peer (ManagedWork.wait() reports the gloo error and leaves the future unset), and it relies on
find_unused_parameters=True to keep torch's reducer from rebuilding its buckets, whose layout would then differ
between a host that just joined and the others (their sums would pair different gradients). GradientSum has neither
problem: sums on torchft's group whose errors go to the Manager, and should_commit (HostSums), on buckets laid out
from the model alone, never from the order gradients arrived in; the host's DDP only says when its (rebuilt,
whatever their layout) buckets are averaged (docs/benchmarks.md has the cost).
Whether an installed torchft's wrapper still crashes: `python -m bench.torchft_ddp_crash` (one line, either way).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from trainer.checkpoint.claim import Ended, forget_end
from trainer.checkpoint.store import (
    GENERATION_FILE,
    CheckpointError,
    generation_folder,
    generations_on_disk,
    next_generation,
    open_generation,
)
from trainer.config.settings import (INPLACE_JOB_ENV, INPLACE_WORLD_ENV, LIGHTHOUSE_ENV, REPLICA_ADDR_ENV,
                                     REPLICA_ENV, SHAPES_TRAINING)
from trainer.core.errors import Fenced, UsageError
from trainer.core.files import atomic_file
from trainer.data.sampling import shares_of
from trainer.engine import lighthouses
from trainer.parallel import bootstrap, collectives, supervised
from trainer.parallel.context import DistContext, collective_failure

log = logging.getLogger("trainer")
MAX_ABANDONED = 100  # steps abandoned in a row before the run ends: one that never commits is not training
# The lighthouse gone (killed, restarted, its host rebooting): torchft's ManagerServer asks it again about this often
# (its quorum_retries, spread over the quorum's timeout), reconnecting each time, until the quorum's timeout.
LIGHTHOUSE_RETRY_S = 0.5
SILENT_S = 1.0  # a quorum this long in coming: if the lighthouse does not answer, the host says that it waits for it
ENDED_POLL_S = 1.0  # then, this often, whether the job ended meanwhile without this host (the directory says so)
# A lighthouse started again forms its first quorum with the hosts that asked first: the other hosts of the last
# quorum (their heartbeats not yet back) are waited for this long before a host goes on without them.
REJOIN_S = 10.0
# torchft's Rust client raises tonic's status as its text, e.g. (torchft 0.2.0, a quorum the lighthouse never
# answered): status: Cancelled, message: "Timeout expired", details: [], metadata: MetadataMap { headers: {} }
GRPC_STATUS = re.compile(r'status: (?P<code>\w+), message: "(?P<message>(?:[^"\\]|\\.)*)", details: \[[^\]]*\], '
                         r"metadata: MetadataMap \{ headers: \{[^}]*\} \}(?:, source: .*)?")


def wanted(env) -> bool:
    """Whether trainer-launch put this job on in-place recovery."""
    return bool(env.get(LIGHTHOUSE_ENV, "").strip())


def largest_world(env) -> int | None:
    """The largest world of an in-place job (its settings are resolved for it); None off the in-place path."""
    raw = env.get(INPLACE_WORLD_ENV, "").strip()
    return int(raw) if wanted(env) and raw.isdigit() else None


class InPlace:
    """One process's part in the replica groups (see the module's docstring). `state()` and `load(state)` are the
    run's: the checkpoint dict at the current position, and putting one back (Run provides them)."""

    def __init__(self, ctx: DistContext, env, collective_timeout_s: float, checkpoint_dir: str, job: str, label: str,
                 state: Callable[[], dict], load: Callable[[dict], None], newer: Callable[[], int | None],
                 ended: Callable[[], None] = lambda: None):
        """job: the job's name (its hosts hold the checkpoint directory together); label: the checkpoint directory's
        setting as the run's user names it; ended: raises claim.Ended where the directory says the job trained to
        its end (with this run's settings)."""
        self.ctx, self.state, self.load, self.newer, self.ended = ctx, state, load, newer, ended
        self.job, self.label = job, label
        self.largest = int(env[INPLACE_WORLD_ENV])
        self.lighthouse = env[LIGHTHOUSE_ENV].strip()
        self.directory = Path(checkpoint_dir)
        self.generation_file = self.directory / GENERATION_FILE
        self.quorum: tuple[int, int, int] | None = None  # (generation, replica rank, replicas) this process is in
        self.shares: list[int] = []
        self.healed = False       # this step began with the state of a peer
        self.reloaded = False     # this step began with the newest checkpoint, the hosts here being behind it
        self.trained = False      # this process committed a step (a healed one that had: fenced)
        self.abandoned = 0        # steps abandoned since the last commit
        self.lost_at: float | None = None
        self.step_began = time.perf_counter()
        self._took_over = False
        self.chain: BufferChain | None = None  # the model's buffers, on share 0's chain (Run.wrap() sets it)
        self.summed: GradientSum | None = None  # the gradients' buckets (the driver makes them at Run.wrap())
        self.timing = StepTiming(ctx.is_local_main)
        self._settled: Callable[[], Any] = _SETTLED  # waits, in the quorum's thread, until the run's state is its own
        timeout = timedelta(seconds=collective_timeout_s)
        # torchft's Rust side logs every quorum and commit at INFO, and its Python side a traceback for every error
        # it handles (a lost peer is one): this module's lines say what happened, once.
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        try:
            import torchft  # noqa: F401
        except ImportError as err:
            raise UsageError("RECOVERY", f"in-place recovery needs torchft, which does not import here ({err})",
                             "pip install 'torchft>=0.2,<0.3' (a dependency of the trainer) on every host, or RECOVERY=restart") from None
        from torchft import Manager

        from trainer.engine.replica_group import tensors_device

        # Over NCCL on GPUs (not run on a GPU yet: trainer.engine.replica_group), gloo on CPUs; the tensors this
        # module sends over the group (the state, the sums, the end's flag) are on self.device.
        self.device = tensors_device(ctx.device)
        self.group = _replica_group(timeout, ctx.device)
        self.transport = _StateOverGroup(self.group, self.device)
        if ctx.is_local_main:
            log.info("in place: the replica group across the hosts is %s%s", self.group.getBackendName(),
                     " (torchft's NCCL, in a child process of each worker; in place over NCCL had not run on a GPU "
                     "when this was written: `bash bench/gpu.sh quick` measures it)" if self.device.type == "cuda" else "")
        address = env.get(REPLICA_ADDR_ENV, "").strip() or "127.0.0.1"
        # LIGHTHOUSE_HOSTS of several: the host's first process reaches them through a relay of its own, which moves
        # to another when the one in use is lost (trainer.engine.lighthouses); its ManagerServer alone asks them.
        self.lighthouses = lighthouses.addresses(env)
        self.relay = lighthouses.Relay(self.lighthouses, self.directory) \
            if len(self.lighthouses) > 1 and ctx.topology.local_rank == 0 else None
        self.lease: lighthouses.Lease | None = None
        if len(self.lighthouses) > 1:
            self.lighthouse = " or ".join(map(lighthouses.shown, self.lighthouses))
        try:
            self.manager = Manager(
                pg=self.group, load_state_dict=self._load, state_dict=self._state, min_replica_size=1,
                # Not torchft's async quorum (answered during the forward, its shares then known too late for the
                # step's data): begin_step() asks it in a thread of its own while the step's first batch is read.
                use_async_quorum=False,
                timeout=timeout, quorum_timeout=timeout, connect_timeout=timedelta(seconds=10),
                rank=ctx.topology.local_rank, world_size=ctx.topology.local_world_size,
                store_addr=ctx.topology.master_addr, store_port=ctx.topology.master_port,
                lighthouse_addr=self.relay.url if self.relay is not None else self.lighthouse,
                replica_id=env.get(REPLICA_ENV, "").strip() or None,
                hostname=address, checkpoint_transport=self.transport,
                # A lighthouse that goes away and comes back within the quorum's timeout is asked again (torchft's
                # Rust side retries: without, the quorum waited out its whole timeout, then the workers restarted).
                quorum_retries=max(1, round(collective_timeout_s / LIGHTHOUSE_RETRY_S)),
                max_retries=MAX_ABANDONED)  # then a RuntimeError: a step that never commits is not training
        except Exception as err:  # noqa: BLE001 (torchft's Rust client says why in its own words)
            # Not a mistake in the settings (trainer-launch found the lighthouse before it started the workers): it
            # went away since, and a restart may find it back. Exit 1, restartable; exit 2 stays for the settings'.
            raise QuorumFailed(f"in place: the lighthouse at {self.lighthouse} answers no more ({said(err)}) (it runs "
                               "beside trainer-launch on the MASTER_ADDR host, or as compose.multinode.yaml's "
                               "lighthouse service: start it again; the job resumes from the newest checkpoint)"
                               ) from None
        # Each quorum's id, as torchft's Manager uses it (the group's generation, its store prefix), is the job's
        # generation for it (JobGenerations): only growing, across restarts of the lighthouse too.
        self.generations = JobGenerations(self.manager._client, self.directory, timeout, self._stale,
                                          lambda member: lighthouses.on_a_lost_lighthouse_host(member,
                                                                                              self.lighthouses),
                                          HostStore(ctx, timeout) if ctx.topology.local_world_size > 1 else None)
        self.manager._client = self.generations
        # Every sum over the hosts (the buckets, the step's flags, the buffers, the end's flag) goes through this: on
        # gloo the group called directly, on NCCL the Manager's allreduce (HostSums says why).
        self.sums = HostSums(self.manager, self.group if self.device.type == "cpu" else None)
        if self.relay is not None:
            self.lease = lighthouses.Lease(self.relay, self._holds_lease)
        self._waiting_said: float | None = None  # when it said that it waits for the lighthouse

    def agree(self, mine: dict[str, Any], job_settings: Callable[[dict], dict], label: Callable[[str], str]) -> None:
        """Before this host's first quorum: its fingerprint (fingerprint()) against the job's, which the job's first
        host recorded in the checkpoint directory (job_settings: the record, made from `mine` if there is none).
        A host that differs would train the job's state with other settings, or not fit it: it is refused (exit 2)
        in one line naming what differs, both ways, and the job goes on without it."""
        job = collectives.on_main_then_share(self.ctx, lambda: job_settings(mine))
        found = differences(mine, job, label)
        if not found:
            return
        where = os.environ.get(INPLACE_JOB_ENV, "").strip() or self.lighthouse
        raise UsageError(", ".join(what for what, _, _ in found),
                         f"this host has {', '.join(f'{what} {_shown(value)}' for what, value, _ in found)}; the in-place "
                         f"job it joins (its lighthouse at {where}) has "
                         f"{', '.join(f'{what} {_shown(theirs)}' for what, _, theirs in found)}",
                         "every host of an in-place job trains with the same settings: start this host with the job's "
                         "settings, or stop every host and start the job again with the new ones, which a resume "
                         "applies")

    # ------------------------------------------------------------------ torchft's state callbacks
    def _state(self) -> dict:
        """A peer behind asks (in torchft's quorum thread, while this one's main thread waits in the quorum, once it
        has read the step's first batch: _Asked.settled)."""
        self._settled()
        return self.state()

    def _load(self, state: dict) -> None:
        self._settled()
        generation = self.group.generation
        if self.trained and self.quorum is not None and generation - self.quorum[0] >= 2:
            raise self._fenced(self.quorum[0], generation, "when handed a live peer's state")
        self.load(state)
        self.healed = True

    # ------------------------------------------------------------------ the step boundary
    def set_step(self, step: int) -> None:
        """The run's step after a resume (torchft counts committed steps: the quorum compares them)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self, meanwhile: Callable[[], Any] | None = None) -> tuple[bool, Any]:
        """The quorum for the next step: (True when this rank's shares or state changed (the batches restart), what
        `meanwhile` returned). The quorum, a round trip to the lighthouse that waits for every host to ask, is asked
        in a thread of its own while this one calls `meanwhile` (the step's first batch, read at the shares trained
        now: read again by the caller when they changed). What the quorum does to the run's state (a peer's state
        taken, the newest checkpoint read, this host's state sent to a peer) waits until `meanwhile` returned: a
        batch read meanwhile may draw from torch's generator, which a checkpoint holds."""
        if meanwhile is None:
            return self._begin_step(), None
        asked = _Asked()
        self._settled = asked.settled.wait  # before the quorum's thread starts: its first wait must see it
        asked.start(self._begin_step)
        try:
            try:
                got = meanwhile()
            finally:
                asked.settled.set()
            waited = time.perf_counter()
            changed = asked.answer()
        finally:
            self._settled = _SETTLED
        self.timing.add("quorum", time.perf_counter() - waited)  # its exposed part: the rest overlapped the batch
        return changed, got

    def _begin_step(self, timed: bool = True) -> bool:
        # Before asking for a quorum (a host that is in a newer generation is inside its quorum call, not here): a
        # newer generation on disk is one that was formed without this host.
        self.check_fence("after an abandoned step" if self.abandoned else "at a step's start")
        self.timing.since_commit("optimizer")
        self.healed = False
        self.group.configured_s = self.transport.moved_s = 0.0
        began = time.perf_counter()
        answered = threading.Event()
        threading.Thread(target=self._while_asked, args=(answered,), name="trainer-quorum-watch", daemon=True).start()
        try:
            self.manager.start_quorum()
        except Fenced:
            raise
        except Exception as err:  # noqa: BLE001 (the lighthouse gone: torchft raises what its client raised)
            raise QuorumFailed(f"in place: no quorum from the lighthouse at {self.lighthouse} ({said(err)}, after "
                               f"{time.perf_counter() - began:.0f} s) (the lighthouse runs beside trainer-launch on "
                               "the MASTER_ADDR host: that host went away, or fewer hosts than NNODES's MIN were "
                               "left for --collective-timeout; start them again: the job resumes from the newest "
                               "checkpoint)") from None
        finally:
            answered.set()
        if self._waiting_said is not None:
            log.info("in place: the lighthouse at %s answers again: this host rejoined it after %.1f s, its processes "
                     "as they were", lighthouses.shown(self.relay.current) if self.relay is not None else
                     self.lighthouse, time.perf_counter() - self._waiting_said)
            self._waiting_said = None
        replicas, replica = self.manager.num_participants(), self.manager.participating_rank()
        # The quorum's generation, whether or not its group formed: one whose rendezvous failed (a host of it lost
        # meanwhile) is not the one before it, and its step is abandoned.
        quorum = (self.group.asked, replica or 0, replicas)
        changed = quorum != self.quorum or self.healed
        self.step_began = time.perf_counter()
        if quorum != self.quorum:
            nproc = self.ctx.topology.local_world_size
            rank, world = (replica or 0) * nproc + self.ctx.topology.local_rank, replicas * nproc
            self.shares = shares_of(rank, world, self.largest)
            formed = self.group.generation == quorum[0]
            if self.ctx.is_local_main:
                self._say_quorum(quorum, world, time.perf_counter() - began, formed)
            if replica == 0 and self.ctx.is_local_main and formed:
                self._open_generation(quorum[0])
            bootstrap.note(job_rank=rank, replica=quorum[1], generation=quorum[0])  # the launcher's lines name it
            self.quorum = quorum
        # torchft heals from the furthest host of the quorum; the job may be further still: hosts that trained on and
        # left (finished, or lost) while this one started. Then every host here goes on from the newest checkpoint.
        self._settled()
        step = self.newer() if changed else None
        if step is not None:
            self.set_step(step)
            self.reloaded = True
        if timed:
            self.timing.add("quorum", time.perf_counter() - began)
        return changed

    def _after_gradients(self, summed: GradientSum):
        """One sum over the hosts after the gradients' (every host issues it after every bucket, in the same order):
        the step's flags, and on a host's first process the buffers of share 0 (BufferChain.share_0), in one tensor.
        Every sum a step waits for costs each host a round trip and a wait for the slowest host; these were two, one
        after the other. Returns the buffers summed (None: none here, or the sum failed, which the Manager has).

        The flags are two reasons to abandon a step that one host may have alone, summed so that every host abandons
        it (torchft's should_commit() is each host's own: a host that saw neither would commit):
        - the host began the step from the newest checkpoint: each host read it on its own, and one that read a newer
          one than another's would train from another state; the next quorum heals every host to the furthest
          (torchft compares their steps);
        - a gradient changed after its sum had been launched, or was added to in its bucket (a second backward pass
          in the last micro-batch, GradientSum.stale): the sum is not the step's gradients, on every host."""
        import torch

        # float64 throughout: exact for BufferChain's float32 statistics and its counts (below 2**53), and for the
        # flags; NCCL sums it as gloo does (ncclFloat64). On the group's device (NCCL's: the GPU).
        flags = torch.tensor([float(self.reloaded), float(summed.stale is not None)], dtype=torch.float64,
                             device=self.device)
        chain = self.chain if self.ctx.topology.local_rank == 0 else None  # the others' DDP gives them their first's
        flat = flags if chain is None else torch.cat([flags, chain.share_0(self.rank == 0, self.device)])
        ok = self.sums.launch(flat).wait()
        self.reloaded = False
        if not ok:  # reported to the Manager: the step is abandoned anyway
            return None
        reloads, stale = flat[:2].tolist()
        if stale and summed.stale is not None:
            self.manager.report_error(RuntimeError(f"a gradient {STALE[summed.stale][0]}"))
        elif stale:
            self.manager.report_error(RuntimeError("a gradient on another host changed after it had been taken into "
                                                   "the sum (more than one backward pass in its step's last "
                                                   "micro-batch)"))
        if reloads and self.manager.num_participants() > 1:
            self.manager.report_error(RuntimeError("a host here began it from the newest checkpoint: the hosts heal "
                                                   "to the furthest of them first"))
        return None if chain is None else flat[2:]

    def _while_asked(self, answered) -> None:
        """A quorum slow in coming (a thread of its own until `answered`): if the lighthouse does not answer, the host
        says so, once. And each ENDED_POLL_S, whether the job ended meanwhile without this host (its hosts trained to
        the end and left, the lighthouse beside the first of them with them: this host had started as they ended, or
        was cut off): then it has nothing to train and leaves now, exit 0, in the line a host started after the end
        gets, instead of waiting out --collective-timeout for a lighthouse that does not come back."""
        if answered.wait(SILENT_S):
            return
        first = True
        while True:
            try:
                self.ended()
            except Ended as ended:
                if self.ctx.is_local_main:
                    log.info("%s", ended)
                supervised.leave_now(0)
            if first and self.ctx.is_local_main:
                self._say_waiting()
            first = False
            if answered.wait(ENDED_POLL_S):
                return

    def _say_waiting(self) -> None:
        """The quorum is slow in coming: if the lighthouse does not answer, say so, once."""
        from urllib.parse import urlsplit

        import socket

        where = urlsplit(self.lighthouse)
        try:
            if self.relay is not None:  # several: the one in use (the relay says when it moves to another)
                if not self.relay.answers():
                    raise OSError(0, f"the one in use, {lighthouses.shown(self.relay.current)}, does not answer")
            else:
                socket.create_connection((where.hostname, where.port or 80), timeout=1).close()
        except OSError as err:
            self._waiting_said = time.perf_counter()
            log.warning("in place: waiting for the lighthouse at %s (%s): this host keeps its processes and rejoins it "
                        "when it answers again (up to --collective-timeout)", self.lighthouse,
                        err.strerror or type(err).__name__)

    def _holds_lease(self) -> bool:
        """Whether this host renews the job's lease (lighthouses.Lease): it is the first of a generation whose group
        formed, and its lighthouse answers it (a host cut off from it renews nothing: the others, past the lease,
        may go on with another)."""
        quorum = self.quorum
        if quorum is None or quorum[1] != 0 or self.group.generation != quorum[0]:
            return False
        return self.relay is not None and self.relay.answers()

    def _stale(self, generation: int) -> None:
        """A quorum's answer (torchft's quorum thread, before the group forms): Fenced if a generation newer than
        the quorum's trained without this host, which trained before (it was frozen, paused or cut off)."""
        newest = self.newest_generation()
        if self.trained and newest is not None and newest > generation:
            raise self._fenced(self.quorum[0] if self.quorum is not None else generation, newest, "at a step's start")

    def _say_quorum(self, quorum: tuple[int, int, int], world: int, waited: float, formed: bool) -> None:
        """The line of a new membership. The quorum's time: agreeing on the members (the lighthouse waits for a
        lost host's heartbeats to lapse), the new group across the hosts, and the state sent to (or received from)
        a host behind."""
        generation, replica, replicas = quorum
        group, moved = self.group.configured_s, self.transport.moved_s
        log.info("in place: generation %d, world size %d of at most %d (%d host(s)); this host is replica %d and "
                 "trains shares %s; the quorum took %.2f s (agreement %.2f s, new group %.2f s, state %.2f s%s)%s",
                 generation, world, self.largest, replicas, replica,
                 ",".join(map(str, self.shares)) or "none (a spare: more hosts than NNODES's MAX)", waited,
                 max(0.0, waited - group - moved), group, moved,
                 f", {self.transport.moved_bytes / 2**20:.1f} MiB" if moved else "",
                 "; healed from a peer" if self.healed else "" if formed else
                 "; its group across the hosts did not form (a host of it was lost): the step is abandoned")

    @property
    def world_size(self) -> int:
        return (self.quorum[2] if self.quorum else 1) * self.ctx.topology.local_world_size

    @property
    def rank(self) -> int:
        return (self.quorum[1] if self.quorum else 0) * self.ctx.topology.local_world_size + self.ctx.topology.local_rank

    def writes(self) -> bool:
        """Whether this host writes the job's checkpoints, scalars and summary: the first replica of the generation."""
        return self._took_over or (self.quorum is not None and self.quorum[1] == 0)

    def summing(self, params: list, fresh: bool = False) -> GradientSum:
        """The step's GradientSum: the one made from the model at run.wrap() (its hooks report readiness during the
        backward), or, for parameters other than its (no run.wrap(), parameters frozen since), one made for them now,
        without hooks: it launches every bucket at commit(). Every host runs the same script: the same layout.
        fresh: a new one even for the same parameters (the strategy hooks a new DDP's buckets to it)."""
        if fresh or self.summed is None or not self.summed.matches(params):
            if self.summed is not None:
                self.summed.remove_hooks()
            self.summed = GradientSum(params, self.manager, self.share_scale(), sums=self.sums)
        return self.summed

    def share_scale(self) -> float:
        """A host's gradients' weight in the step's mean: its processes (DDP has averaged over them) / the largest
        world's ranks (each of which is a share some rank trained)."""
        return self.ctx.topology.local_world_size / self.largest

    def commit(self, parameters) -> bool:
        """The step's gradients summed over the hosts, scaled to the mean over the largest world's ranks (each of
        which is a share some rank trained); True: step the optimizer, False: the step is abandoned."""
        began = time.perf_counter()
        params = [p for p in parameters if p.requires_grad]
        summed = self.summing(params)
        # The host's own DistributedDataParallel has averaged over its processes: x processes / largest world.
        summed.finish()
        buffers = self._after_gradients(summed)
        try:
            committed = self.manager.should_commit()
        except RuntimeError as err:  # torchft's end to abandoned steps (max_retries), or its manager gone
            raise QuorumFailed(f"in place: step {self.manager.current_step() + 1} could not be committed "
                               f"({said(err)}); {MAX_ABANDONED} abandoned in a row end the "
                               "run (the hosts kept failing their sums: see their logs)") from None
        finally:
            self.timing.committed(time.perf_counter() - began, summed)
        summed.new_step()
        if committed:
            summed.apply()
            if buffers is not None:
                self.chain.take(buffers)
            self.trained = True
            self.abandoned = 0
            return True
        error = self.manager.errored()
        self.abandoned += 1
        spent = time.perf_counter() - self.step_began
        if self.lost_at is None:
            self.lost_at = time.perf_counter()
        if self.ctx.is_local_main:
            what = collective_failure(error.original_exception) if error is not None else None
            log.warning("in place: step %d abandoned after %.2f s (%s); it is taken again with the hosts still here",
                        self.manager.current_step() + 1, spent, what or (said(error.original_exception) if error
                                                                         else "a peer did not commit"))
        for p in params:
            p.grad = None
        if self.chain is not None:  # taken again: the buffers as the step found them
            self.chain.restore()
        return False

    def recovered(self, step: int) -> None:
        """A step committed: after abandoned ones, say what the change cost."""
        if self.lost_at is not None and self.ctx.is_local_main:
            log.info("in place: step %d committed %.2f s after the first abandoned one, at world size %d",
                     step, time.perf_counter() - self.lost_at, self.world_size)
        self.lost_at = None

    def confirm(self, wrote: bool) -> bool:
        """The end, on every host: whether the host that writes committed the last checkpoint (a sum over the hosts;
        False if it failed, or a host was lost meanwhile)."""
        import torch

        flag = torch.tensor([1.0 if wrote else 0.0], device=self.device)  # NCCL's tensors: on the GPU
        return bool(self.sums.launch(flag).wait()) and flag.item() > 0 \
            and self.manager.errored() is None

    def take_over(self) -> None:
        """This host writes from now on (the end, when the writing host did not confirm)."""
        self._took_over = True

    # ------------------------------------------------------------------ fencing
    def _open_generation(self, generation: int) -> None:
        """The first host of a new generation, before anyone trains in it: the generation's folder, where its
        checkpoints are written, and the older ones retired (a writer of theirs can no longer commit); then its
        number in GENERATION_FILE."""
        try:
            newer = open_generation(self.directory, generation)
        except CheckpointError as err:  # the store names the built-in loop's flag
            raise CheckpointError(str(err).replace("--checkpoint-dir", self.label, 1)) from None
        if newer is not None:  # frozen between its quorum and here: that generation is over
            raise self._fenced(generation, newer, "at a step's start")
        forget_end(self.directory)  # a job trains here again: a late host of an earlier one must not end on its record
        try:
            with atomic_file(self.generation_file, "w", durable=False) as f:
                f.write(f"{generation}\n")
        except OSError as err:  # the generations' folders fence the commits; this number only tells the hosts sooner
            log.warning("in place: cannot write %s (%s)", self.generation_file, err.strerror)

    def newest_generation(self) -> int | None:
        """The job's newest generation: the number its first host wrote, or a newer generation's folder (a host that
        was frozen before it wrote its own number may write it over a newer one)."""
        found = generations_on_disk(self.directory)
        try:
            found.append(int(self.generation_file.read_text().strip()))
        except (OSError, ValueError):
            pass
        return max(found, default=None)

    def check_fence(self, when: str) -> None:
        """Leave (Fenced) if a generation newer than this host's trained without it."""
        newest = self.newest_generation()
        if self.trained and self.quorum is not None and newest is not None and newest > self.quorum[0]:
            raise self._fenced(self.quorum[0], newest, when)

    def staging(self) -> Path | None:
        """Where a checkpoint of this host's state now is written: its generation's folder (the checkpointer calls
        it when it takes the state)."""
        return None if self.quorum is None else generation_folder(self.directory, self.quorum[0])

    def fence(self) -> None:
        """A checkpoint of this host's was not committed, its generation having ended (the checkpointer calls it):
        Fenced if the job went on without this host; else the membership changed while it wrote, this host with it."""
        newest = self.newest_generation()
        if self.quorum is not None and newest is not None and newest > self.quorum[0]:
            raise self._fenced(self.quorum[0], newest, "before committing a checkpoint")

    @staticmethod
    def _fenced(own: int, newest: int, when: str) -> Fenced:
        return Fenced(f"in place: this host came back after the job went on without it (generation {own}, the job's "
                      f"is {newest}: it was frozen, paused or cut off; noticed {when}): it leaves, having written "
                      "nothing of the newer generation (started again, it rejoins as a returning host)")

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        self.timing.say()
        if self.lease is not None:
            self.lease.stop()
        for end in (lambda: self.manager.shutdown(wait=False), self.group.shutdown):  # the NCCL group's child too
            try:
                end()
            except Exception:  # noqa: BLE001 (leaving: nothing more to do with it)
                pass


def fingerprint(settings: dict[str, Any], built: dict[str, Any], modules: dict[str, Any]) -> dict[str, Any]:
    """What a host of an in-place job trains with: the settings that shape the training (SHAPES_TRAINING), the
    optimizers' and schedulers' hyper-parameters as the script built them (checkpoint.state.as_built: a script's own
    learning rate too), and each model's tensors (names, shapes, dtypes), as plain JSON data."""
    import hashlib

    models = {}
    for name, module in modules.items():
        tensors = module.state_dict()
        layout = "\n".join(f"{key} {tuple(t.shape)} {t.dtype}" for key, t in tensors.items() if hasattr(t, "shape"))
        models[name] = {"tensors": len(tensors), "values": sum(t.numel() for t in tensors.values()
                                                               if hasattr(t, "numel")),
                        "layout": hashlib.sha256(layout.encode()).hexdigest()[:16]}
    plain = {"settings": {key: settings[key] for key in SHAPES_TRAINING if key in settings}, "built": built,
             "models": models}
    return json.loads(json.dumps(plain, default=str))  # as the job's record reads back: tuples as lists


def differences(mine: dict[str, Any], job: dict[str, Any], label: Callable[[str], str]) -> list[tuple[str, Any, Any]]:
    """(what, this host's, the job's) for each way this host's fingerprint differs from the job's: the settings
    where any differs (the rest follows from them), else what the script built, else the models."""
    found = [(label(key), value, job["settings"].get(key)) for key, value in mine["settings"].items()
             if job.get("settings", {}).get(key) != value]
    if found:
        return found
    for name, value in mine["built"].items():
        theirs = job.get("built", {}).get(name)
        if theirs != value:
            found += _built_differences(name, value, theirs)
    for name, model in mine["models"].items():
        theirs = job.get("models", {}).get(name)
        if theirs != model:
            found.append((f"{name} (its state_dict)", _layout(model), _layout(theirs)))
    return found


def _layout(model: dict | None) -> str:
    return f"{model['tensors']} tensors, {model['values']:,} values, layout {model['layout']}" if model else "none"


def _built_differences(name: str, mine: Any, theirs: Any) -> list[tuple[str, Any, Any]]:
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):  # parameter groups
        return [(f"{name}'s {key}" + (f" (group {index})" if len(mine) > 1 else ""), value, group.get(key))
                for index, (own, group) in enumerate(zip(mine, theirs)) for key, value in own.items()
                if group.get(key) != value]
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [(f"{name}'s {key}", value, theirs.get(key)) for key, value in mine.items() if theirs.get(key) != value]
    return [(name, mine, theirs)]


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


class JobGenerations:
    """torchft's ManagerClient, each quorum's id in its answers renumbered as the job's generation for that quorum.
    torchft's lighthouse numbers its quorums from 1 each time it starts, and its Manager takes an id it had before
    for the group it has (it would keep a group with a lost host in it) and prefixes the new group's keys in the
    store with it (keys of an older group of that number are there). The fencing compares generations: a host frozen
    across a restart of the lighthouse must find the job's newer than its own. So each new quorum (a quorum id or
    members this process did not have last) takes the job's next number from the checkpoint directory
    (store.next_generation), once for all its members: the first to ask takes it and leaves it in the store of the
    quorum's group, under a key naming the quorum (its id, members and step), where the others read it.

    torchft gives each process of a host the store of another member of the quorum (its group rank modulo the
    members: torchft's compute_quorum_results), so that the processes of one host would count the same quorum in
    different stores, twice, and disagree on its generation (one of them then fenced at the next step). So the
    host's first process agrees with the other hosts' first processes, and hands the number to its host's others
    through the host's own store (HostStore, `host`).

    A lighthouse started again answers the first host that asks with a quorum of that host alone (the others'
    heartbeats are not back yet): the host asks again, for up to REJOIN_S, while hosts of its last quorum are
    missing, so that the hosts rejoin it together, no one behind the other (healed, or fenced)."""

    def __init__(self, client, directory: Path, timeout: timedelta, stale: Callable[[int], None],
                 lost: Callable[[str], bool] = lambda member: False, host: "HostStore | None" = None):
        self._client, self.directory, self.timeout, self.stale, self.lost = client, directory, timeout, stale, lost
        self.host = host  # None: one process per host
        self.last: tuple[int, tuple[str, ...]] | None = None  # the last quorum's (id, members), as torchft said them
        self.generation: int | None = None  # the job's generation of that quorum

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def _quorum(self, **asked):
        quorum = self._client._quorum(**asked)
        deadline = time.monotonic() + REJOIN_S
        while self._restarted(quorum) and time.monotonic() < deadline:
            time.sleep(LIGHTHOUSE_RETRY_S)
            quorum = self._client._quorum(**asked)
        key = (quorum.quorum_id, tuple(quorum.replica_ids))
        if key != self.last:
            generation = self._agree(quorum)
            self.last, self.generation = key, generation
        self.stale(self.generation)
        return _Renumbered(quorum, self.generation)

    def _restarted(self, quorum) -> bool:
        """A quorum of a lighthouse started since the last one (its ids went back, or the same id has other
        members), without some hosts of the last quorum."""
        if self.last is None:
            return False
        number, members = self.last
        if quorum.quorum_id > number or (quorum.quorum_id == number and tuple(quorum.replica_ids) == members):
            return False
        # Not waited for: a host of LIGHTHOUSE_HOSTS whose lighthouse is lost with it (another lighthouse took over).
        return any(not self.lost(member) for member in set(members) - set(quorum.replica_ids))

    def _agree(self, quorum) -> int:
        import hashlib

        from torchft.process_group import create_store_client

        members = hashlib.sha256("\n".join(quorum.replica_ids).encode()).hexdigest()[:16]
        key = f"{quorum.quorum_id}-{quorum.max_step}-{members}"
        if self.host is not None and not self.host.first:
            number = self.host.number(key)  # the host's first process agreed on it with the other hosts
        else:
            number = 0
            try:
                store = create_store_client(f"{quorum.store_address}/trainer/generations", self.timeout)
                if store.add(f"{key}/asked", 1) == 1:
                    try:
                        number = next_generation(self.directory)
                    except OSError as err:
                        store.set(key, "0")  # the others fail as this host does, at once
                        raise CheckpointError(f"in place: cannot write {self.directory} ({err.strerror}): each "
                                              "quorum's generation is counted there") from None
                    store.set(key, str(number))
                number = int(store.get(key))
            finally:
                if self.host is not None:
                    self.host.hand(key, number)  # 0 (failed): the host's others fail with it, at once
        if number <= 0:
            raise CheckpointError(f"in place: the host that counts this quorum's generation in {self.directory} "
                                  "could not write it")
        return number


class HostStore:
    """The store of a host's own process group (its torchrun's), where the host's first process hands each quorum's
    generation to the others (JobGenerations). Keys under the worker group's attempt: a restarted group does not
    read the numbers of the one before it."""

    def __init__(self, ctx: DistContext, timeout: timedelta):
        self.ctx, self.timeout = ctx, timeout
        self.first = ctx.topology.local_rank == 0
        self.prefix = f"trainer/generations/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/" \
                      f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
        self._store = None

    def _client(self):
        if self._store is None:
            from torch.distributed import TCPStore

            self._store = TCPStore(self.ctx.topology.master_addr, self.ctx.topology.master_port, is_master=False,
                                   timeout=self.timeout)
        return self._store

    def hand(self, key: str, number: int) -> None:
        self._client().set(self.prefix + key, str(number))

    def number(self, key: str) -> int:
        return int(self._client().get(self.prefix + key))


class _Renumbered:
    """A quorum's answer from torchft's client, its id replaced by the job's generation."""

    def __init__(self, quorum, quorum_id: int):
        self._quorum, self.quorum_id = quorum, quorum_id

    def __getattr__(self, name: str):
        return getattr(self._quorum, name)


def _replica_group(timeout: timedelta, device=None):
    """torchft's reconfigurable group for workers on `device` (None: the CPU's), which also remembers the generation
    (quorum id) it was made for: gloo on CPUs, NCCL on CUDA (trainer.engine.replica_group says which and why)."""
    import torch

    from trainer.engine.replica_group import replica_group

    return replica_group(torch.device("cpu") if device is None else torch.device(device), timeout)


def _StateOverGroup(group, device=None):
    """torchft's transport for a host behind: the state from a live peer over the new group. torchft's own (HTTP, and
    its process-group one) unpickle what a peer sends; this one sends the dict's structure as torch.save's bytes with
    every tensor in it replaced by a meta tensor of its shape and dtype (read with weights_only=True, as every
    checkpoint is), then each tensor's own bytes as they are in memory. No tensor is pickled or copied into one
    buffer: pickling the whole state took the running host most of a 5-6 s pause per return at 129 M parameters
    (docs/benchmarks.md, "In-place recovery at 129 M parameters").

    device: where the group's tensors must be (replica_group.tensors_device: the CPU for gloo, the worker's GPU for
    NCCL; None: the CPU). The structure says which tensors lived there on the sender (_placed): those arrive on the
    receiver's own device (a sender's cuda:1 is the receiver's cuda:0 if that is its device), the others (RNG
    states, a CPU-side counter) cross through the device and land on the CPU, where they were. Over gloo every
    tensor lands on the CPU, as the group carries them."""
    import torch
    from torchft.checkpointing.transport import CheckpointTransport

    device = torch.device("cpu") if device is None else torch.device(device)

    class StateOverGroup(CheckpointTransport):
        moved_s, moved_bytes = 0.0, 0  # the last transfer's seconds (serialising included) and size

        def metadata(self) -> str:
            return "process-group"

        def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
            began = time.perf_counter()
            tensors: list = []
            buffer = io.BytesIO()
            skeleton = _skeleton(state_dict, tensors)
            torch.save({"state": skeleton, "on_device": _placed(tensors, device)}, buffer)
            structure = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)
            parts = [_as_bytes(t, device) for t in tensors]
            header = torch.tensor([structure.numel(), step, len(parts)], dtype=torch.int64, device=device)
            for rank in dst_ranks:
                group.send([header], rank, 1).wait(timeout)
                group.send([structure], rank, 2).wait(timeout)
                sent = [group.send([part], rank, 3) for part in parts if part.numel()]
                for work in sent:  # all in flight at once: one peer's receives match them in order
                    work.wait(timeout)
            self.moved_s = time.perf_counter() - began
            self.moved_bytes = structure.numel() + sum(part.numel() for part in parts)

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            began = time.perf_counter()
            header = torch.zeros(3, dtype=torch.int64, device=device)
            group.recv([header], src_rank, 1).wait(timeout)
            size, sent_step, count = (int(v) for v in header.cpu())
            if sent_step != step:
                raise RuntimeError(f"a peer sent the state of step {sent_step}, not {step}")
            structure = torch.empty(size, dtype=torch.uint8, device=device)
            group.recv([structure], src_rank, 2).wait(timeout)
            sent = torch.load(io.BytesIO(structure.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
            skeleton, on_device = sent["state"], sent["on_device"]
            metas: list = []
            _filled(skeleton, metas.append)
            if len(metas) != count or len(on_device) != count:
                raise RuntimeError(f"the state's structure holds {len(metas)} tensors, the peer sent {count}")
            made = [torch.empty(meta.shape, dtype=meta.dtype, device=device) for meta in metas]
            received = [group.recv([_as_bytes(t, device)], src_rank, 3) for t in made if t.numel()]
            for work in received:
                work.wait(timeout)
            landed = iter(_landed(made, on_device))
            state = _filled(skeleton, lambda meta: next(landed))
            self.moved_s = time.perf_counter() - began
            self.moved_bytes = size + sum(t.numel() * t.element_size() for t in made)
            return state

    return StateOverGroup()


def _placed(tensors: list, device) -> list[bool]:
    """For each tensor a sender sends: whether it lives on the group's device (a GPU's, when the group is NCCL), so
    that the receiver keeps it on its own device; False: it lives on the CPU (or elsewhere) and lands there."""
    return [t.device.type == device.type for t in tensors]


def _landed(received: list, on_device: list[bool]) -> list:
    """The tensors received over the group, each where the sender had it: on the receiver's group device (where it
    arrived) if on_device, else on the CPU."""
    return [t if on or t.device.type == "cpu" else t.cpu() for t, on in zip(received, on_device)]


def _movable(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_quantized \
        and not value.is_meta


def _skeleton(value, tensors: list):
    """value with each plain tensor in its dicts, lists and tuples replaced by a meta tensor of the same shape and
    dtype (appended to tensors, in the order _filled() meets them). Other containers stay as they are, tensors
    and all: torch.save sends those."""
    import torch

    def meta(tensor):
        tensors.append(tensor)
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    return _replaced(value, _movable, meta)


def _filled(value, receive: Callable):
    """The inverse of _skeleton: each meta tensor replaced by receive(meta), in the same order."""
    import torch

    return _replaced(value, lambda v: isinstance(v, torch.Tensor) and v.is_meta, receive)


def _replaced(value, chosen: Callable, replace: Callable):
    """value with replace(leaf) for each leaf chosen(leaf) in its dicts, OrderedDicts, lists and tuples (walked
    in order; other containers are leaves)."""
    if chosen(value):
        return replace(value)
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _replaced(v, chosen, replace)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_replaced(v, chosen, replace) for v in value)
    return value


def _as_bytes(tensor, device="cpu"):
    """A tensor's bytes as a flat uint8 tensor on `device` (the group's), over the same memory where it can (a
    tensor already there and contiguous): what a receive fills, or a send reads."""
    import torch

    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def said(err: BaseException) -> str:
    """What torchft's error says, in a few plain words for a one-line message: gRPC's status text becomes its message
    (or its code, in words), torchft's advice on its connect timeout (the line carries its own) goes."""
    text = " ".join(str(err).split()) or type(err).__name__

    def plain(status: re.Match) -> str:
        message = status["message"].replace('\\"', '"').strip()
        return message or re.sub(r"(?<!^)(?=[A-Z])", " ", status["code"]).lower()

    text = GRPC_STATUS.sub(plain, text)
    return text.split("; verify the address is correct")[0][:200]


def _SETTLED() -> bool:
    """No batch is being read beside the quorum: the run's state is the quorum's to read and change."""
    return True


class _Asked:
    """A step's quorum (InPlace._begin_step) in a thread of its own. A daemon thread, not an executor's: a process
    that fails while a quorum is in flight (the batch read beside it raised) exits without waiting out the quorum's
    timeout."""

    def __init__(self):
        self.settled = threading.Event()  # set when the batch read beside the quorum returned (or raised)
        self._result: tuple[bool, BaseException | None] = (False, None)
        self._thread: threading.Thread | None = None

    def start(self, begin: Callable[..., bool]) -> None:
        self._thread = threading.Thread(target=self._run, args=(begin,), name="trainer-quorum", daemon=True)
        self._thread.start()

    def _run(self, begin: Callable[..., bool]) -> None:
        try:
            self._result = (begin(timed=False), None)
        except BaseException as err:  # noqa: BLE001 (raised again in the caller's thread: answer())
            self._result = (False, err)

    def answer(self) -> bool:
        assert self._thread is not None, "start() first"
        self._thread.join()
        changed, err = self._result
        if err is not None:
            raise err
        return changed


class QuorumFailed(Exception):
    """The lighthouse went away, or a quorum never formed (fewer hosts than the job's fewest for too long)."""


class HostSums:
    """Sums over the hosts (ReduceOp.SUM) with the contract of torchft's managed allreduce: launch() never raises and
    its work's wait() never raises (True: summed; False: a failure, reported to the Manager, whose should_commit()
    then says False, so the step applies nothing; a lost host fails the sum on every host); once the Manager has an
    error this step, nothing more is launched (what is in the tensor then is never applied).

    On gloo (`group` given) the sums go to the replica group itself, the very group the Manager was given, in the order
    they are issued, as the Manager's would: its allreduce wraps each sum in a managed work, a chain of futures and a
    timer on torchft's event-loop thread, 0.55-0.72 ms a sum on this project's 2-core VM
    (`python -m bench.torchft_step_cost`'s `direct`, docs/benchmarks.md), five a step at ResNet-18, on the training
    thread and on a thread that shares its cores. Gloo's own timeout (the group's, the collective timeout the Manager
    has too) ends a sum a peer never joins, as the Manager's timer would. A host that does not take part in the
    quorum's sums (torchft's healing replica under its async quorum, not used here) goes through the Manager, which
    sends zeros for it. NCCL keeps the Manager's sum: its managed work orders the CUDA streams, and no GPU has run
    the direct path."""

    def __init__(self, manager, group=None):
        from torch.distributed import AllreduceOptions, ReduceOp

        self.manager, self.group = manager, group
        self.options = AllreduceOptions()
        self.options.reduceOp = ReduceOp.SUM

    def launch(self, tensor):
        if self.group is None or not self.manager.is_participating():
            return self.manager.allreduce(tensor, reduce_op=self.options.reduceOp)
        if self.manager.errored() is not None:
            return _Summed(None, self.manager)
        try:
            return _Summed(self.group.allreduce([tensor], self.options), self.manager)
        except Exception as err:  # noqa: BLE001 (a group whose rendezvous failed, a peer gone: the step's)
            self.manager.report_error(err)
            return _Summed(None, self.manager)


class _Summed:
    """A sum launched by HostSums on the group directly: wait() reports a failure to the Manager instead of raising.
    `work` None: not launched (the step already failed)."""

    def __init__(self, work, manager):
        self.work, self.manager = work, manager

    def wait(self) -> bool:
        if self.work is None:
            return False
        try:
            self.work.wait()
            return True
        except Exception as err:  # noqa: BLE001 (gloo's error for a lost peer, or its timeout)
            self.manager.report_error(err)
            return False


class BufferChain:
    """The model's buffers (BatchNorm's running statistics and num_batches_tracked) as the job's largest world keeps
    them. Under DistributedDataParallel (broadcast_buffers, its default) every forward starts from rank 0's buffers,
    so the job's are rank 0's chain: updated by the forwards of share 0 alone. In place a host may train several
    shares through one module: the updates of every forward but share 0's are discarded (the buffers put back after
    the micro-batch), and each committed step gives every host the buffers of the host that trained share 0 (a sum
    over the hosts, the others adding zeros: x + 0 == x), so that whichever host holds share 0 after a loss goes on
    with its chain. A step abandoned puts back the buffers it began with (it is taken again)."""

    def __init__(self, buffers: list):
        self.buffers = buffers
        self.began: list | None = None  # the buffers as the step in flight found them

    @classmethod
    def of(cls, model) -> "BufferChain | None":
        import torch

        buffers = [b for b in model.buffers() if isinstance(b, torch.Tensor)] if model is not None else []
        return cls(buffers) if buffers else None

    def _copy(self) -> list:
        return [b.detach().clone() for b in self.buffers]

    def restore(self, saved: list | None = None) -> None:
        import torch

        with torch.no_grad():
            for buffer, value in zip(self.buffers, saved if saved is not None else self.began or []):
                buffer.copy_(value)

    def micro_batches(self, no_sync: Callable, shares: list[int], accum: int) -> Callable:
        """Counted's context for a step's micro-batches (in order: accum of each share): the strategy's no_sync,
        and for a micro-batch of any share but 0 its buffer updates put back when it ends (its backward uses the
        batch's own statistics, not the running ones)."""
        import contextlib

        index = iter(range(accum * len(shares)))

        @contextlib.contextmanager
        def context(last: bool):
            i = next(index)
            if i == 0:
                self.began = self._copy()
            kept = None if shares[i // accum] == 0 else self._copy()
            with no_sync(last):
                yield
            if kept is not None:
                self.restore(kept)

        return context

    def share_0(self, holds: bool, device):
        """This process's buffers, flat, in float64 (exact for float32 and for counts below 2**53), on `device`; zeros
        unless it `holds` share 0. Summed over the hosts (InPlace._after_gradients), the others adding zeros, they are
        the buffers of the host that trained share 0. Only a host's first process sends them: its other processes'
        own DistributedDataParallel gives them its first process's buffers at the next forward (their groups over the
        hosts hold no share 0)."""
        import torch

        if not holds:  # zeros of the same length: nothing of its own buffers to gather
            return torch.zeros(sum(b.numel() for b in self.buffers), dtype=torch.float64, device=device)
        return torch.cat([b.detach().reshape(-1).to(device=device, dtype=torch.float64) for b in self.buffers])

    def take(self, flat) -> None:
        import torch

        offset = 0
        with torch.no_grad():
            for buffer in self.buffers:
                buffer.copy_(flat[offset:offset + buffer.numel()].view(buffer.shape))
                offset += buffer.numel()


# DDP's bucket caps (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES, and bucket_cap_mb's default): a small first
# bucket goes out as soon as the backward's first gradients are final, the rest in buckets large enough that each
# collective's fixed cost stays small beside its bytes.
FIRST_BUCKET_BYTES = 2**20
BUCKET_BYTES = 25 * 2**20


STALE = {  # GradientSum.stale: (what happened to a gradient, what the host does from then on)
    "launched": ("changed after its sum over the hosts had been launched", "sums its gradients after the backward"),
    "added to": ("was added to after it had been taken into its bucket", "copies its gradients into the sum"),
}


class GradientSum:
    """The sum of the step's gradients over the hosts, overlapped with the backward pass (InPlace.commit waits for it).

    The gradients are cut into fixed buckets: the parameters that require a gradient in REVERSE registration order
    (the backward's usual order), capped as DDP caps its own, each bucket one preallocated flat tensor of one dtype
    and device. The layout follows from the model alone, never from when gradients arrived: a host that just joined
    must pair the very buffers the others pair (torch's reducer rebuilds its buckets after the first step from the
    order it saw them in, which is why the host's own DDP buckets are not these).

    A parameter's gradient is final only in the backward of the step's last micro-batch (the boundary: the others
    run in no_sync and accumulate), so readiness counts only while `armed`. It is reported by `ready(params,
    values)`: a post-accumulate-grad hook per parameter on a host of one process, or the host's DDP comm hook (the
    host-averaged gradients) on a host of several. Each gradient is copied into its bucket scaled by the host's
    share of the mean (`scale`), and a bucket whose every parameter is ready has its sum launched over the hosts
    (non-blocking; HostSums: torchft's gloo group called directly, or the Manager's allreduce). A hooked gradient
    becomes its place in the bucket as soon as it is copied in (the tensor autograd made freed in the backward), the
    others at apply(), after a commit. That is DDP's arithmetic, memory traffic and memory (it divides as it copies
    into its buckets, and its gradients are views of them): scaling the sum afterwards and copying it back were two more
    passes over the gradients a step. Gloo pairs the collectives of a group by the order they are issued, whatever
    thread issues them, so the buckets are launched strictly in index order on every host: a bucket ready before the one
    ahead of it waits for it.
    `finish()` launches what is left (a parameter that got no gradient this step adds its .grad from earlier
    micro-batches, or zeros, as the one flat sum did) and waits: what a sum met (a lost host, which fails it on every
    host) is reported to the Manager, whose should_commit() then says False, and the step applies nothing. A sum made
    wrong by this host's own script (`stale`, see ready()) is not reported here: InPlace.commit sums it over the
    hosts, so that every host abandons the step, and every bucket is launched all the same (the hosts stay paired)."""

    def __init__(self, params: list, manager, scale: float = 1.0, first_bytes: int = FIRST_BUCKET_BYTES,
                 bytes_: int = BUCKET_BYTES, sums: HostSums | None = None):
        """scale: this host's gradients' weight in the mean over the largest world (its processes / the largest world's
        ranks), applied as they are copied in (DDP divides while copying into its buckets too): no pass of its own.
        sums: how the buckets are summed (InPlace's: on gloo, the replica group called directly); by default the
        Manager's allreduce."""
        import torch

        self.params, self.manager, self.scale = params, manager, scale
        self.sums = sums if sums is not None else HostSums(manager)
        self.buckets: list[tuple[Any, list]] = []  # (flat tensor, [(parameter, its place in it)]) in launch order
        self.slot: dict[int, tuple[int, Any]] = {}  # id(parameter) -> (bucket, its place in it)
        members: list = []
        size = 0
        cap = first_bytes

        def close() -> None:
            nonlocal members, size, cap
            if members:
                first = members[0][0]
                flat = torch.zeros(size, dtype=first.dtype, device=first.device)
                # Each parameter's place in the bucket, a view shaped as the parameter, made once: slicing it anew
                # in every gradient's hook, in the backward, cost 62 slices and views a step at ResNet-18.
                placed = [(p, flat[offset:offset + p.numel()].view_as(p)) for p, offset in members]
                for p, part in placed:
                    self.slot[id(p)] = (len(self.buckets), part)
                self.buckets.append((flat, placed))
                cap = bytes_
            members, size = [], 0

        for p in reversed(params):
            if members and (p.dtype != members[0][0].dtype or p.device != members[0][0].device):
                close()
            members.append((p, size))
            size += p.numel()
            if size * p.element_size() >= cap:  # DDP's rule: a bucket closes once it holds its cap or more
                close()
        close()
        self.lock = threading.Lock()  # readiness may come from the autograd engine's threads or gloo's
        self.armed = False   # the step's last micro-batch is in its backward
        self.overlap = True  # off for good once a gradient changed after its bucket was launched (see ready())
        # Each .grad is its place in its bucket (DDP's gradient_as_bucket_view): a hooked one as it arrives, the rest
        # at apply(). Off for good once a second backward added to a gradient there (see ready()).
        self.views = True
        self.stale: str | None = None  # why this step's sum is wrong: "launched" or "added to" (see ready())
        self.hooks: list = []
        self.new_step()

    def new_step(self) -> None:
        self.counts = [0] * len(self.buckets)
        self.seen: set[int] = set()
        self.works: list = []
        self.launched = 0          # buckets launched this step
        self.launched_early = 0    # of them, launched during the backward (the overlap's measure)
        self.stale = None

    def matches(self, params: list) -> bool:
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def hook_parameters(self) -> None:
        """Readiness from each parameter's post-accumulate-grad hook: a host of one process (no DDP of its own, or
        one the strategy keeps out of the backward: drivers.InPlace.comm_hook)."""
        def accumulated(p) -> None:  # a post-accumulate-grad hook returns nothing
            if self.armed:
                self.ready([p], [p.grad], adopt=self.views)

        for p in self.params:
            self.hooks.append(p.register_post_accumulate_grad_hook(accumulated))

    def hook_ddp(self, ddp, chained: tuple | None) -> None:
        """Readiness from the host's DistributedDataParallel: its comm hook does what the default one does (or what
        `chained`, (state, hook), does: shm_allreduce's), and then marks that DDP bucket's parameters ready with
        their host-averaged values. DDP calls it only for the synchronised micro-batch: no arming needed."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        state, hook = chained if chained is not None else (None, allreduce_hook)

        def averaged_then_ready(_, bucket):
            params = bucket.parameters()

            def mark(future):
                result = future.value()
                result = result[0] if isinstance(result, list) else result
                values, offset = [], 0
                for p in params:  # the bucket's flat buffer holds its parameters' gradients in this order
                    values.append(result[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
                self.ready(params, values)
                return result

            return hook(state, bucket).then(mark)

        ddp.register_comm_hook(None, averaged_then_ready)

    def ready(self, params: list, values: list, adopt: bool = False) -> None:
        """These parameters' gradients are final for the step: into their buckets, and every bucket that is complete
        and next in order launched. adopt: `values` are the parameters' own .grad (autograd's, from the hooks), which
        become their places in the buckets at once."""
        with self.lock:
            if not self.overlap:
                return
            for p, value in zip(params, values):
                where = self.slot.get(id(p))
                if where is None:  # not one of the summed parameters (frozen when the buckets were made)
                    continue
                index, part = where
                if index < self.launched:
                    # A second backward in the last micro-batch changed a gradient already on its way: this step's
                    # sum is wrong. It is abandoned (on every host: InPlace._after_gradients), and this host sums
                    # after the backward from now on; that is only later in time, the launches stay in order, so the
                    # hosts still pair.
                    self.stale = "launched"
                    continue
                there = value.is_set_to(part)
                if there and id(p) in self.seen:
                    # A second backward added to a gradient that is its place in the bucket (adopted below, or kept
                    # there by zero_grad(set_to_none=False)): autograd added the new part to the scaled first one,
                    # and the two cannot be told apart any more. The step is abandoned, and from now on the
                    # gradients are tensors of their own, copied in (a bucket not launched yet then takes a gradient
                    # again, whole, as often as it changes).
                    self.stale = self.stale or "added to"
                    continue
                self._take(part, value, there)
                if adopt and not there:
                    # As the gradient arrives, not at the commit: the tensor the backward made for it is freed now.
                    # Held to the commit, every gradient but the largest was in memory twice at the backward's end
                    # (its tensor and its place): 45 MiB more at ResNet-18's peak, 111 at VGG-11's.
                    self._as_place(p, part)
                if id(p) not in self.seen:
                    self.seen.add(id(p))
                    self.counts[index] += 1
            while self.launched < len(self.buckets) and \
                    self.counts[self.launched] == len(self.buckets[self.launched][1]):
                self._launch()
                self.launched_early += 1

    def _take(self, part, value, there: bool) -> None:
        """A gradient into its place in a bucket, scaled (one pass; in place where the gradient is that place already,
        `there`: adopted, or made so by apply() and kept by the user's zero_grad(set_to_none=False))."""
        import torch

        if there:
            if self.scale != 1.0:
                part.mul_(self.scale)
        elif self.scale != 1.0:
            torch.mul(value, self.scale, out=part)
        else:
            part.copy_(value)

    def _launch(self) -> None:
        self.works.append(self.sums.launch(self.buckets[self.launched][0]))
        self.launched += 1

    def finish(self) -> None:
        """After the step's backward: the buckets not launched yet launched (their parameters that reported nothing
        add their .grad or zeros), then every sum waited for (an error is torchft's to report: should_commit). A
        stale sum (`stale`) is said here and left for InPlace.commit to sum over the hosts."""
        with self.lock:
            self.armed = False
            if self.stale is not None:  # what went wrong, and what this host does from now on (see ready())
                what, then = STALE[self.stale]
                if self.stale == "launched":
                    self.overlap = False
                else:
                    self.views = False
                log.warning("in place: a gradient %s (more than one backward pass in the step's last micro-batch): "
                            "this step is taken again, and this host %s from now on", what, then)
            while self.launched < len(self.buckets):
                members = self.buckets[self.launched][1]
                for p, part in members:
                    if id(p) in self.seen:
                        continue
                    if p.grad is not None:
                        self._take(part, p.grad, p.grad.is_set_to(part))
                    else:
                        part.zero_()
                self._launch()
        for work in self.works:
            work.wait()

    def apply(self) -> None:
        """The sums as the parameters' .grad: each gradient becomes its place in the bucket (DDP's
        gradient_as_bucket_view: no copy back; the next step's backward makes new gradients, or, kept by
        zero_grad(set_to_none=False), accumulates into these). A parameter laid out otherwise (channels_last) gets a
        copy in its own layout, and so does every one once `views` is off."""
        for _, members in self.buckets:
            for p, part in members:
                if p.grad is None:
                    if part.any():  # unused here, used by a peer
                        p.grad = part.clone()
                elif not self.views:
                    p.grad.copy_(part)
                elif not p.grad.is_set_to(part) and not self._as_place(p, part):
                    p.grad.copy_(part)  # laid out otherwise: a copy in its own layout

    @staticmethod
    def _as_place(p, part) -> bool:
        """p's .grad becomes its place in the bucket (DDP's gradient_as_bucket_view), where both are laid out alike:
        a view of its own, the sum's own view never leaves it (code that re-pointed a .grad's .data would otherwise
        move where the next step's gradient is summed). False: laid out otherwise (channels_last), left as it is."""
        if not (p.is_contiguous() and p.grad.is_contiguous()):
            return False
        p.grad = part.view_as(p)
        return True

    def remove_hooks(self) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks = []


class StepTiming:
    """Where an in-place step's time goes, logged every EVERY committed steps (means, milliseconds): the quorum, the
    forward and backward passes (run.forward_backward's: a script that calls its model and run.backward() itself
    has them in "other"), the sum over the hosts as far as the step waits for it after the backward (its exposed
    part: the rest overlapped with the backward), the optimizer step and what follows it until the next quorum
    (logging, checkpoints), and the rest (the data). The wall clock of the calling thread: on a GPU, kernels still
    queued count where they are waited for."""

    EVERY = 100

    def __init__(self, says: bool):
        self.says = says
        self.spent: dict[str, float] = {}
        self.steps = self.buckets = self.early = 0
        self.began = self.last_commit = None

    def add(self, phase: str, seconds: float) -> None:
        if self.began is None:  # the window's first phase: it began that long ago
            self.began = time.perf_counter() - seconds
        self.spent[phase] = self.spent.get(phase, 0.0) + seconds

    def since_commit(self, phase: str) -> None:
        if self.last_commit is not None:
            self.add(phase, time.perf_counter() - self.last_commit)
            self.last_commit = None

    def committed(self, seconds: float, summed: "GradientSum") -> None:
        now = time.perf_counter()
        self.add("sum", seconds)
        self.last_commit = now
        self.steps += 1
        self.buckets += len(summed.buckets)
        self.early += summed.launched_early
        if self.steps >= self.EVERY:
            self.say(now)

    def say(self, now: float | None = None) -> None:
        now = now or time.perf_counter()
        if self.steps and self.says:
            wall = now - self.began
            known = {k: self.spent[k] for k in ("quorum", "forward", "backward", "sum", "optimizer") if k in self.spent}
            parts = ", ".join(f"{k} {v / self.steps * 1e3:.1f}" for k, v in known.items())
            log.info("in place: per step over %d steps (ms): %s, other %.1f, wall %.1f; %d of %d buckets of the sum "
                     "launched during the backward", self.steps, parts.replace("sum", "sum exposed"),
                     max(0.0, wall - sum(known.values())) / self.steps * 1e3, wall / self.steps * 1e3,
                     self.early, self.buckets)
        self.spent, self.steps, self.buckets, self.early, self.began = {}, 0, 0, 0, None
