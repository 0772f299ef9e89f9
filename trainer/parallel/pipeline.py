"""Pipeline stages (--pipeline-stages P): the model cut into P stages that pass activations from one process to the
next, each step's per-rank batch cut into --pipeline-microbatches M so that the stages work at once
(torch.distributed.pipelining's schedules: GPipe, 1F1B, interleaved 1F1B).

The layout: world size = P x D. Rank r is stage r % P of data-parallel replica r // P: a replica's stages are
consecutive ranks, so with NPROC_PER_NODE a multiple of P they share a host (the activations cross shared memory, not
the network) and the replicas spread over the hosts, as the tutorials draw it. Each stage's gradients are averaged
over the D processes that hold it. Interleaved 1F1B cuts the model into V x P pieces and gives each process V of them,
P apart (rank 0 of a replica holds pieces 0, P, 2P...): the activations go round the processes V times, and the idle
share of a step falls to (P - 1) / (V x M + P - 1).

The cut: at module boundaries, where the forward runs them, traced by torch.distributed.pipelining.pipeline (with
torch.export): the forward's own code (ResNet's flatten, ViT's class token) lands in the stage that runs it, so any
model whose forward exports splits, with no change to it. The stages keep the unsplit model's parameter and buffer
names and share its tensors: what a stage saves is its part of the unsplit model's state dict, so a checkpoint
written at one layout is read at any other, the unsplit one included.

The default cut balances the stages' parameter counts over the model's blocks: its top-level children, a child that
holds more than a stage's share of the parameters taken apart into its own children (ResNet-50's layer4 into its
three bottlenecks, a ViT's encoder into its layers), in the order they are registered.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from torch import nn

from trainer.config.settings import split_names
from trainer.core.errors import UsageError

@dataclass(frozen=True)
class Layout:
    """Where a rank sits: stage `stage` of P, in data-parallel replica `replica` of D."""

    stages: int
    replicas: int
    stage: int
    replica: int
    chunks: int = 1  # the pieces of the model each process holds (V: more than one under interleaved 1F1B)

    @classmethod
    def of(cls, rank: int, world_size: int, stages: int, chunks: int = 1) -> "Layout":
        return cls(stages, world_size // stages, rank % stages, rank // stages, chunks)

    @property
    def pieces(self) -> list[int]:
        """The indices of the model's pieces this rank holds (of stages x chunks), in the model's order."""
        return [self.stage + chunk * self.stages for chunk in range(self.chunks)]

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def pipeline_ranks(self, replica: int | None = None) -> list[int]:
        """The ranks of a replica's stages, in order (this rank's replica by default)."""
        replica = self.replica if replica is None else replica
        return [replica * self.stages + stage for stage in range(self.stages)]

    def replica_ranks(self, stage: int | None = None) -> list[int]:
        """The ranks that hold a stage, one per replica (this rank's stage by default)."""
        stage = self.stage if stage is None else stage
        return [replica * self.stages + stage for replica in range(self.replicas)]


def groups(layout: Layout, timeout=None):
    """(this rank's pipeline group, its stage's replica group): every rank makes every group, in the same order, as
    torch.distributed.new_group requires; the replica group is None with one replica."""
    import torch.distributed as dist

    options = {} if timeout is None else {"timeout": timeout}
    mine = None
    for replica in range(layout.replicas):
        group = dist.new_group(layout.pipeline_ranks(replica), **options)
        if replica == layout.replica:
            mine = group
    if layout.replicas == 1:
        return mine, None
    holding = None
    for stage in range(layout.stages):
        group = dist.new_group(layout.replica_ranks(stage), **options)
        if stage == layout.stage:
            holding = group
    return mine, holding


def blocks(model: nn.Module, stages: int) -> list[tuple[str, int]]:
    """(name, parameter count) of the blocks a default cut falls between, in registration order: the top-level
    children, and a child holding more than 1/stages of the parameters taken apart into its children, again; a block
    without parameters is part of the one before it."""
    share = sum(p.numel() for p in model.parameters()) / max(stages, 1)
    found: list[tuple[str, int]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            count = sum(p.numel() for p in child.parameters())
            if count > share and any(True for _ in child.children()):
                walk(child, prefix + name + ".")
            elif count or not found:  # a block without parameters (an activation, a pooling) goes with the one
                found.append((prefix + name, count))  # before it: a stage begins with weights, never with, say, an
    #                                                     in-place ReLU on the activations it receives
    walk(model, "")
    return found


def taken_apart(model: nn.Module, name: str) -> list[tuple[str, int]]:
    """A block's children as blocks (those without parameters part of the one before them); [] when it has fewer
    than two, or its first holds no parameters (a stage begins with weights)."""
    inner: list[tuple[str, int]] = []
    for child_name, child in model.get_submodule(name).named_children():
        count = sum(p.numel() for p in child.parameters())
        if count:
            inner.append((f"{name}.{child_name}", count))
        elif not inner:
            return []
    return inner if len(inner) > 1 else []


def largest_part(counts: list[int], starts: list[int]) -> int:
    edges = [0, *starts, len(counts)]
    return max(sum(counts[a:b]) for a, b in zip(edges, edges[1:]))


def refined(model: nn.Module, found: list[tuple[str, int]], stages: int) -> list[str]:
    """The balanced cut over `found`, then, while it makes the largest stage smaller, a block beside a cut taken
    apart into its children (ResNet-50 with a 10-class head: a cut inside layer4.0, 0.52 of the parameters in the
    larger stage, where the blocks alone leave 0.62)."""
    starts = balanced([count for _, count in found], stages)
    for _ in range(8):
        best = None
        for index in sorted({i for start in starts for i in (start - 1, start)}):
            inner = taken_apart(model, found[index][0])
            if not inner:
                continue
            trial = found[:index] + inner + found[index + 1:]
            counts = [count for _, count in trial]
            trial_starts = balanced(counts, stages)
            size = largest_part(counts, trial_starts)
            if size < largest_part([count for _, count in found], starts) and (best is None or size < best[0]):
                best = (size, trial, trial_starts)
        if best is None:
            break
        _, found, starts = best
    return [found[index][0] for index in starts]


def balanced(counts: list[int], stages: int) -> list[int]:
    """Where each later stage begins (indices into counts): the contiguous cut into `stages` parts, none empty, whose
    largest part is smallest (ties: the earliest cut)."""
    n = len(counts)
    prefix = [0]
    for count in counts:
        prefix.append(prefix[-1] + count)
    # best[k][i]: the smallest largest part cutting counts[:i] into k parts; cut[k][i]: where the last part begins.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_points(model: nn.Module, stages: int, given: str, label: str, model_name: str, chunks: int = 1) -> list[str]:
    """The modules each later piece begins with (stages: the pieces, chunks: how many each process holds): `given`
    (comma-separated names) checked against the model, else the balanced cut over its blocks. A UsageError names
    `label` (the setting as the user wrote it)."""
    found = blocks(model, stages)
    if not given:
        if len(found) < stages:
            what = f"{stages} stages" if chunks == 1 else f"{stages} pieces ({stages // chunks} stages x {chunks} " \
                "pieces each, interleaved-1f1b)"
            raise UsageError(label.replace("split", "stages"), f"{what}, and {model_name} has "
                             f"{len(found)} blocks to cut between ({', '.join(name for name, _ in found)})",
                             f"use at most {len(found) // chunks} stages")
        return refined(model, found, stages)
    names = split_names(given)
    if len(names) != stages - 1:
        raise UsageError(label, f"{len(names)} names for {stages} stages", f"name the {stages - 1} module"
                         f"{'s' * (stages != 2)} that begin{'s' * (stages == 2)} each stage after the first, "
                         "comma-separated; or leave it empty for a balanced cut")
    modules = dict(model.named_modules())
    order = list(modules)
    for name in names:
        if name not in modules or name == "":
            close = difflib.get_close_matches(name, [n for n in order if n], n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UsageError(label, f"{name!r} is not a module of {model_name}",
                             f"{hint}the blocks: {', '.join(n for n, _ in found)}")
        if not any(True for _ in modules[name].parameters()):  # an activation's in-place op would write into the
            #                                                        stage's input: a stage begins with weights
            later = [n for n, _ in found if order.index(n) > order.index(name)]
            hint = f"did you mean {later[0]}? " if later else ""
            raise UsageError(label, f"{name!r} holds no parameters, and a stage begins with weights",
                             f"{hint}the blocks: {', '.join(n for n, _ in found)}")
    if [order.index(name) for name in names] != sorted(order.index(name) for name in names) or len(set(names)) != \
            len(names):
        raise UsageError(label, f"{','.join(names)} are not in the model's order",
                         "name each stage's first module in the order the model runs them")
    return names


def cut(model: nn.Module, example, points: list[str], training: bool = True) -> list[nn.Module]:
    """The model's stages, traced with `example` (one micro-batch's input) in training or evaluation mode (a trace
    keeps the mode it was made in: BatchNorm's batch statistics, or its running ones): modules that share the
    model's tensors under its own names, stage i+1 taking stage i's outputs. The model's own mode is left as it was."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    was = model.training
    model.train(training)
    try:
        pipe = pipeline(model, mb_args=(example,), split_spec={name: SplitPoint.BEGINNING for name in points})
    finally:
        model.train(was)
        for name in points:  # pipeline() marks each point by patching its module's forward, and leaves it patched:
            module = model.get_submodule(name)  # a second trace (the other mode) would split there twice over
            vars(module).pop("forward", None)
            vars(module).pop("_orig_forward", None)
    return [pipe.get_stage_module(index) for index in range(pipe.num_stages)]


_prefetching: type | None = None


def prefetching_stage() -> type:
    """torch's PipelineStage whose receives are posted ahead (GPipe and 1F1B on gloo), and whose sends are waited for
    only at the step's end where asked (1F1B).

    Why: a message moves only once its receive is posted (gloo's unbound buffers wait for the receiver; NCCL's send
    pairs with its recv). torch's ScheduleGPipe posts micro-batch i's receive just before it computes i, so each of a
    step's 2M messages waited out its whole transfer on the receiving stage; its Schedule1F1B posts each receive
    together with the send before it and waits for both at once, so the two stages met at every micro-batch and each
    waited out a transfer there (gloo, P = 2, M = 8, docs/benchmarks.md). Here the first receive a phase (forward or
    backward) asks for posts that phase's every later micro-batch's too (each has its own buffer, made by the
    schedule's set-up), and each chunk's forward or backward waits for its own; with sends_later, a send is issued
    where the schedule asks and waited for in finish_sends(), after the schedule's step (the tensors sent are the
    step's own: nothing overwrites them before). The transfers then run while the stages compute.

    Only the backends' public calls and PipelineStage's public methods are used. NCCL keeps torch's schedules as they
    are (Stage below): a pair of ranks shares one stream for its messages, so 1F1B's receive posted ahead would hold
    back its next send to the same neighbour; GPipe's phases receive from one neighbour and send to the other, which
    NCCL should take, but no GPU has run it (NCCL puts one rank on a GPU, and the lent device has one), and a GPU path
    no GPU has run is not a default."""
    global _prefetching
    if _prefetching is None:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage

        class PrefetchingStage(PipelineStage):
            def __init__(self, *args, microbatches: int, sends_later: bool, **kwargs):
                super().__init__(*args, **kwargs)
                self.microbatches, self.sends_later = microbatches, sends_later
                self.posted: dict[tuple[str, int], list] = {}  # (phase, chunk): its receives' works, not yet waited
                self.sending: list = []  # sends_later: this step's sends' works

            def _post_from(self, phase: str, chunk: int, ops_of) -> list:
                for later in range(chunk, self.microbatches):
                    if (phase, later) not in self.posted:
                        ops = ops_of(later)
                        self.posted[(phase, later)] = dist.batch_isend_irecv(ops) if ops else []
                return []  # the schedule has nothing left to post: the chunk's own call waits (below)

            def _wait(self, phase: str, chunk: int) -> None:
                for work in self.posted.pop((phase, chunk), []):
                    work.wait()

            def _send(self, ops: list) -> list:
                if not self.sends_later or not ops:
                    return ops
                self.sending.extend(dist.batch_isend_irecv(ops))
                return []

            def finish_sends(self) -> None:
                sending, self.sending = self.sending, []
                for work in sending:
                    work.wait()

            def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
                return self._post_from("forward", fwd_chunk_id, super().get_fwd_recv_ops)

            def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
                return self._post_from("backward", bwd_chunk_id, super().get_bwd_recv_ops)

            def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
                return self._send(super().get_fwd_send_ops(fwd_chunk_id))

            def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
                return self._send(super().get_bwd_send_ops(bwd_chunk_id))

            def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
                self._wait("forward", fwd_chunk_id)
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

            def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
                self._wait("backward", bwd_chunk_id)
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        _prefetching = PrefetchingStage
    return _prefetching


class Stage:
    """This rank's stage (its pieces of the model, layout.pieces) and the schedule that runs it: one call of step()
    trains one per-rank batch as M micro-batches through every stage of the replica (the first stage feeds the inputs,
    the last computes the loss), leaving each piece's gradients in its parameters; with D replicas, a step's last call
    (sync=True) averages them over the stage's replicas and gives every replica the first's buffers (BatchNorm's
    running statistics), as DistributedDataParallel would.

    Why not DistributedDataParallel over the replica group: its reducer learns the order of the gradients in its first
    step and checks it against every parameter's hook; a schedule that runs two forwards of a stage before its first
    backward (GPipe always, 1F1B whenever M <= P) hands it twice the parameters and it stops (an internal assert). The
    average here waits for the schedule's last backward, and sums in the same order on every replica."""

    def __init__(self, modules: list[nn.Module], layout: Layout, schedule: str, microbatches: int, loss_fn, device,
                 pipeline_group, replica_group=None, evaluation: list[nn.Module] | None = None):
        """modules: this rank's pieces (cut()'s, at layout.pieces); evaluation: the same traced in evaluation mode,
        for evaluate()."""
        import torch.distributed as dist
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        gloo = dist.get_backend(pipeline_group) == "gloo"

        def stages(pieces: list[nn.Module], kind) -> list:
            if gloo and kind in (ScheduleGPipe, Schedule1F1B):  # prefetching_stage(): why, and why not NCCL yet
                return [prefetching_stage()(piece, index, layout.stages * layout.chunks, device, group=pipeline_group,
                                            microbatches=microbatches, sends_later=kind is Schedule1F1B)
                        for piece, index in zip(pieces, layout.pieces)]
            return [PipelineStage(piece, index, layout.stages * layout.chunks, device, group=pipeline_group)
                    for piece, index in zip(pieces, layout.pieces)]

        def scheduled(kind, pieces: list[nn.Module], **options) -> tuple[list, object]:
            """(torch's PipelineStage of each piece, the schedule that runs them)."""
            made = stages(pieces, kind)
            return made, kind(made if kind is ScheduleInterleaved1F1B else made[0], n_microbatches=microbatches,
                              **options)

        self.layout, self.modules = layout, modules
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}[schedule]
        if len(modules) != layout.chunks or (layout.chunks > 1) != (kind is ScheduleInterleaved1F1B):
            raise ValueError(f"{schedule} with {len(modules)} pieces on a rank of a {layout.chunks}-piece layout")
        self.evaluating, self.size = None, None  # evaluate()'s schedule (forward only: no loss), its batch size
        if evaluation is not None:
            _, self.evaluating = scheduled(ScheduleGPipe if layout.chunks == 1 else kind, evaluation)
        self.replica_group = replica_group if layout.replicas > 1 else None
        self.sharded = False  # fsdp over the replicas (shard()): their reduce-scatter averages the gradients
        self.whole: list[tuple] = []  # shard()'s (evaluation parameter, its sharded training parameter) pairs
        self.gathered = False  # the evaluation pieces' parameters are whole now (gather_for_evaluation())
        self.evaluation_modules = evaluation or []
        # The loss of each micro-batch is divided here (scale_grads=False): the schedule's own division would also
        # divide gradients accumulated over several steps' worth of batches (grad_accum).
        self.stages, self.schedule = scheduled(kind, modules, loss_fn=loss_fn, scale_grads=False)
        self.sends_later = [part for part in self.stages if getattr(part, "sends_later", False)]

    def step(self, inputs, targets, sync: bool = True) -> list:
        """One per-rank batch forward and backward; the last stage's micro-batch losses (as loss_fn returned them),
        [] on the other stages. sync: the step's last batch (its gradients are averaged over the replicas)."""
        if self.gathered:
            self._empty_evaluation()
        losses: list = []
        if self.layout.first and self.layout.last:
            self.schedule.step(inputs, target=targets, losses=losses)
        elif self.layout.first:
            self.schedule.step(inputs)
        else:
            self.schedule.step(target=targets if self.layout.last else None, losses=losses)
        for part in self.sends_later:
            part.finish_sends()
        if sync and self.replica_group is not None:
            self.average()
        return losses

    def shard(self, model: nn.Module, device) -> None:
        """fsdp over the replicas: each piece sharded over its stage's replica group (FSDP2's fully_shard; the
        schedule's last backward reduce-scatters the gradients, averaged), the model's own parameters the sharded
        ones (its optimizer and checkpoints see this rank's shards). The evaluation pieces are traced apart and hold
        their own parameters: emptied here, gathered whole for a validation pass (gather_for_evaluation()), emptied
        again at the next step."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(self.replica_group, device.type)
        training = {}
        for piece in self.modules:
            fully_shard(piece, mesh=mesh)
            for name, param in piece.named_parameters():
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner)._parameters[leaf] = param
                training[name] = param
        self.whole = [(param, training[name]) for piece in self.evaluation_modules
                      for name, param in piece.named_parameters()]
        self._empty_evaluation()
        self.sharded = True

    def gather_for_evaluation(self) -> None:
        """A validation pass begins: under fsdp the evaluation pieces' parameters gathered from the shards (every
        replica of the stage calls this, as validation runs everywhere); step() empties them again."""
        for param, sharded in self.whole:
            param.data = sharded.detach().full_tensor()
        self.gathered = bool(self.whole)

    def _empty_evaluation(self) -> None:
        import torch

        for param, _ in self.whole:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.gathered = False

    def average(self, bucket: int = 1 << 22) -> None:
        """The gradients averaged over the stage's replicas (unless fsdp's reduce-scatter did), in buckets of up to
        `bucket` elements (one flat copy at a time); the buffers (floating point) set to the first replica's."""
        import torch
        import torch.distributed as dist

        params = [] if self.sharded else [p for module in self.modules for p in module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # unused in this step on this replica: it adds nothing to the sum
                p.grad = torch.zeros_like(p)
        start, size = 0, self.layout.replicas
        while start < len(params):
            end, count = start, 0
            while end < len(params) and (count == 0 or count + params[end].numel() <= bucket):
                count, end = count + params[end].numel(), end + 1
            grads = [p.grad for p in params[start:end]]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.replica_group)
            flat /= size
            for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(part.view_as(grad))
            start = end
        first = dist.get_global_rank(self.replica_group, 0)
        for module in self.modules:
            for buffer in module.buffers():
                if buffer.is_floating_point() or buffer.dtype == torch.long:
                    dist.broadcast(buffer, first, group=self.replica_group)

    def evaluate(self, inputs):
        """A batch through the stages in evaluation mode, no gradients: the model's output on the last stage (the
        micro-batches' outputs put back together), None on the others. The schedule keeps the micro-batch shape of
        its first batch: a batch of another size goes through in parts of that size, the last one padded with
        copies of its last sample (their outputs dropped)."""
        import torch

        if self.size is None:  # a whole number of micro-batches
            m = self.evaluating._n_microbatches
            self.size = -(-len(inputs) // m) * m
        outputs = []
        with torch.no_grad():
            for start in range(0, len(inputs), self.size):
                part = inputs[start:start + self.size]
                short = self.size - len(part)
                if short:
                    part = torch.cat([part, part[-1:].expand(short, *part.shape[1:])])
                output = self.evaluating.step(part) if self.layout.first else self.evaluating.step()
                if self.layout.last:
                    outputs.append(output[:len(output) - short])
        return torch.cat(outputs) if self.layout.last else None


def keep_only(model: nn.Module, pieces: list[nn.Module]) -> None:
    """Cut the model in place to this rank's pieces: the parameters and buffers of the others are dropped from it (set
    to None: model.parameters() and model.state_dict() then give this rank's alone, under the model's own names), so
    the optimizer built on the model afterwards holds this rank's state only, as under fsdp."""
    mine = {name for piece in pieces for name, _ in [*piece.named_parameters(), *piece.named_buffers()]}
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for name in list(table):
                if table[name] is not None and (f"{prefix}.{name}" if prefix else name) not in mine:
                    table[name] = None


class PipelineStrategy:
    """--pipeline-stages P: the strategy interface (wrap, no_sync, compiled) for a model cut into stages. wrap() cuts
    the model in place to this rank's stage and builds the schedule; the driver (trainer.engine.drivers.Staged) runs
    each micro-batch through it. Each stage is replicated over the data-parallel replicas with ddp's gradient
    average."""

    def __init__(self, cfg, ctx, label, name: str):
        self.cfg, self.ctx, self.label, self.name = cfg, ctx, label, name
        self.layout = Layout.of(ctx.rank, ctx.world_size, cfg.pipeline_stages, cfg.pipeline_chunks)
        self.stage: Stage | None = None
        self.loss_fn = None  # the running micro-batch's loss function (the schedule's is fixed when it is built)
        self.wrapped = None
        self.boundary = True  # the running micro-batch ends an optimizer step (no_sync's)
        self.norm_group = None  # the replica's stages, once wrap() made the groups: the norm is summed over them

    def wrap(self, model: nn.Module, memory_format=None, example=None, **ddp_options) -> nn.Module:
        """Cut the model in place to this rank's stage (example: one batch's inputs, to trace it with) and build the
        schedule; returns the model."""
        import torch

        if example is None:
            raise UsageError("wrap()", f"{self.label('pipeline_stages')} {self.cfg.pipeline_stages} cuts the model "
                             "where its forward runs, which needs an input to trace it with",
                             "pass one batch's inputs: run.wrap(model, example=inputs)")
        model.to(self.ctx.device, memory_format=memory_format or torch.contiguous_format)
        points = split_points(model, self.layout.stages * self.layout.chunks, self.cfg.pipeline_split,
                              self.label("pipeline_split"), self.name, self.layout.chunks)
        micro = example[:max(1, len(example) // self.cfg.pipeline_microbatches)].to(self.ctx.device)
        training, evaluation = ([pieces[index] for index in self.layout.pieces] for pieces in
                                (cut(model, micro, points), cut(model, micro, points, training=False)))
        if self.ctx.is_main:  # which cut, which schedule: the start line says only how many stages
            import logging

            logging.getLogger("trainer").info(
                "pipeline: %s, %d micro-batches per batch, %d pieces cut before %s", self.cfg.pipeline_schedule,
                self.cfg.pipeline_microbatches, self.layout.stages * self.layout.chunks, ", ".join(points))
        keep_only(model, training)
        model.pipeline_stage = self.layout.stage  # a part of the model: trainer.parallel.strategy.is_sharded
        from datetime import timedelta

        # The run's collective timeout, as the world's group has it (new_group's own default is torch's 30 min).
        pipeline_group, replica_group = groups(self.layout, timedelta(seconds=self.cfg.collective_timeout))
        self.norm_group = pipeline_group
        self.stage = Stage(training, self.layout, self.cfg.pipeline_schedule, self.cfg.pipeline_microbatches,
                           lambda output, target: self.loss_fn(output, target), self.ctx.device, pipeline_group,
                           replica_group, evaluation)
        if self.cfg.strategy == "fsdp" and self.layout.replicas > 1:
            self.stage.shard(model, self.ctx.device)
        self.wrapped = model
        return model

    def no_sync(self, boundary: bool):
        """The micro-batch's context: whether its schedule's step ends the optimizer step (its gradients are then
        averaged over the replicas, Stage.step's sync)."""
        import contextlib

        @contextlib.contextmanager
        def marked():
            self.boundary = boundary
            try:
                yield
            finally:
                self.boundary = True

        return marked()

    def compiled(self, forward):
        return forward

    def evaluation(self, module: nn.Module):
        """A batch through the stages in evaluation mode: the output on the last stage, None on the others (called
        once per validation pass: under fsdp the evaluation pieces are gathered whole for it)."""
        self.stage.gather_for_evaluation()
        return self.stage.evaluate
