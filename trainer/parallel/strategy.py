"""How the model is spread over the processes (--strategy): ddp or fsdp, behind one small interface.

ddp: every process holds the whole model, its gradients and its optimizer state; gradients are
all-reduced after each backward. Checkpoints are one file, written by rank 0.
fsdp: FSDP2 (torch.distributed.fsdp.fully_shard): each of N processes holds 1/N of the parameters,
gradients and optimizer state. A block's parameters are all-gathered just before it runs and freed
after; its gradients are reduce-scattered. Checkpoints are directories of shards (trainer.checkpoint.sharded).

Blocks, found by the first rule that applies (fsdp shards each one on its own; activation
checkpointing recomputes each one's activations in the backward pass, under either strategy):
1. the model's own `fsdp_blocks()` method, returning a list of its submodules (for your own models);
2. torchvision's ResNets: the four residual stages (layer1 .. layer4); torchvision's ViTs: each
   encoder block (encoder.layers);
3. the children of the first nn.Sequential or nn.ModuleList met walking the model top-down whose
   children with parameters are at least two and all of one type (a stack of repeated blocks).
Whatever lies outside the blocks (stem, head, embeddings) is sharded with the root. A model in
which no rule finds blocks is refused under fsdp: sharding it whole would all-gather every
parameter at once, as much memory as ddp and slower.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, ContextManager, Iterable, Iterator

import torch
from torch import nn

from trainer.config.settings import TrainConfig, flag_name
from trainer.core.errors import UsageError
from trainer.parallel.compat import private
from trainer.parallel.context import DistContext

log = logging.getLogger("trainer")


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of the rules above; [] when none applies."""
    own = getattr(model, "fsdp_blocks", None)
    if callable(own):
        return list(own())
    import torchvision

    if isinstance(model, torchvision.models.ResNet):
        return [model.layer1, model.layer2, model.layer3, model.layer4]
    if isinstance(model, torchvision.models.VisionTransformer):
        return list(model.encoder.layers)

    def search(module: nn.Module) -> list[nn.Module]:
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            stacked = [child for child in module.children() if any(True for _ in child.parameters())]
            if len(stacked) >= 2 and len({type(child) for child in stacked}) == 1:
                return stacked
        for child in module.children():
            found = search(child)
            if found:
                return found
        return []

    return search(model)


def is_sharded(model: nn.Module) -> bool:
    """Whether this process holds a part of the model: fsdp's shards, or a pipeline's stage (each rank's part of the
    model's state dict, under the model's names: checkpoints of both are DCP directories)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or getattr(model, "pipeline_stage", None) is not None


def local_tensors(model: nn.Module) -> list[torch.Tensor]:
    """This rank's floating-point weights and buffers: its shards under fsdp, everything under ddp."""
    return [t.to_local() if hasattr(t, "to_local") else t for t in model.state_dict().values()
            if t.is_floating_point()]


def weights_are_finite(ctx: DistContext, model: nn.Module) -> bool:
    """Whether every rank's weights and buffers are finite; a collective, so every rank calls it."""
    from trainer.parallel.collectives import all_reduce_sum

    tensors = [t for t in local_tensors(model) if t.numel()]  # an fsdp shard may be empty
    if not tensors:
        return True
    # A tensor's least and greatest elements are finite only if all its elements are (both carry a NaN): one
    # pass that allocates nothing, where isfinite(t).all() makes several and a mask the size of t.
    bad = torch.stack([~torch.isfinite(torch.stack(torch.aminmax(t))).all() for t in tensors])
    bad = bad.sum(dtype=torch.float32).reshape(1)
    return all_reduce_sum(ctx, bad.to(ctx.device)).item() == 0


class Strategy:
    """--strategy ddp, and the interface fsdp shares: wrap the model, skip gradient sync between
    accumulated micro-batches, compile."""

    # The group over which the model's gradient norm is summed (clipping): None, each process holds every parameter
    # or (fsdp) a DTensor shard whose norm is reduced already; pipeline stages: the stages of a replica.
    norm_group = None

    def __init__(self, cfg: TrainConfig, ctx: DistContext, blocks: list[nn.Module], replicate: bool | None = None):
        self.cfg, self.ctx, self.blocks = cfg, ctx, blocks
        self.wrapped: nn.Module | None = None
        # DistributedDataParallel over the process group. In-place recovery replicates across hosts itself
        # (trainer/engine/inplace.py): a host of one process has nothing for DDP to do.
        self.replicate = ctx.distributed if replicate is None else replicate
        # Who registers DDP's comm hook instead (in-place recovery, which sums the host-averaged buckets over the
        # hosts as they come): called with the DDP module and the hook it would have had ((state, hook) of
        # shm_allreduce's, or None: the default all-reduce). None: the strategy's own.
        self.comm_hook: Callable | None = None

    def wrap(self, model: nn.Module, memory_format: torch.memory_format = torch.contiguous_format, example=None,
             **ddp_options) -> nn.Module:
        """Place the model on the device and return the module the training step calls; the optimizer
        is built on `model` after this. ddp_options: DistributedDataParallel's own keyword arguments; example: an
        input, which pipeline stages trace (trainer.parallel.pipeline) and the other strategies do not need."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        model.to(self.ctx.device, memory_format=memory_format)
        self._checkpoint_activations()
        self.wrapped = model
        if self.replicate:
            cuda = self.ctx.device.type == "cuda"
            self.wrapped = DDP(model, device_ids=[self.ctx.device.index] if cuda else None,
                               **{"gradient_as_bucket_view": True, **ddp_options})
            chained = None
            if self.cfg.shm_allreduce:
                from trainer.parallel.shm_allreduce import register_if_usable

                chained = register_if_usable(self.wrapped, self.ctx, register=self.comm_hook is None)
            if self.comm_hook is not None:
                self.comm_hook(self.wrapped, chained)
        return self.wrapped

    def _checkpoint_activations(self) -> None:
        if not self.cfg.activation_checkpointing:
            return
        # The composable checkpoint keeps the parameter names (checkpoints stay interchangeable); its public
        # fallback recomputes the same forward through torch.utils.checkpoint, names kept too.
        checkpoint = private("torch.distributed._composable.checkpoint",
                             lambda: __import__("torch.distributed._composable", fromlist=["checkpoint"]).checkpoint)
        for block in self.blocks:
            if checkpoint is not None:
                checkpoint(block)
            else:
                _recompute_in_backward(block)

    def no_sync(self, boundary: bool) -> ContextManager:
        """Around a micro-batch's forward and backward: no gradient exchange unless it ends a step."""
        if self.replicate and not boundary:
            return self.wrapped.no_sync()
        return contextlib.nullcontext()

    def compiled(self, forward: Callable) -> Callable:
        return torch.compile(forward) if self.cfg.compile else forward

    def evaluation(self, module: nn.Module) -> Callable:
        """What validation calls on a batch's inputs: the module (its output); a pipeline's stages give theirs."""
        return module


class FSDPStrategy(Strategy):
    def wrap(self, model: nn.Module, memory_format: torch.memory_format = torch.contiguous_format, example=None,
             **ddp_options) -> nn.Module:
        if ddp_options:
            raise UsageError("wrap()", f"{', '.join(ddp_options)} are DistributedDataParallel's options, and this "
                             "run shards the model (strategy fsdp)", "drop them, or use strategy ddp")
        self._checkpoint_activations()
        self.wrapped = model
        if not self.ctx.distributed:
            model.to(self.ctx.device, memory_format=memory_format)
            log.info("--strategy fsdp in one plain process: nothing to shard over, the model stays whole "
                     "(its checkpoints are sharded directories all the same)")
            return model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        # Not moved to the device whole: fully_shard moves each rank's shards there (or, offloaded, keeps
        # them in host memory), so a model larger than one GPU never has to fit on one. The weights stay
        # contiguous (fully_shard refuses channels_last ones); --channels-last inputs still make the
        # convolutions run channels_last.
        mesh = init_device_mesh(self.ctx.device.type, (self.ctx.world_size,))
        precision, fp32_units = MixedPrecisionPolicy(), []
        if self.cfg.amp == "bf16":
            precision, fp32_units = bf16_policy(model)
        offload = CPUOffloadPolicy(pin_memory=self.ctx.device.type == "cuda") if self.cfg.fsdp_cpu_offload \
            else OffloadPolicy()
        for unit in fp32_units:  # before the blocks that hold them: an inner unit is sharded first
            fully_shard(unit, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32),
                        offload_policy=offload)
        for block in self.blocks:
            if self.cfg.compile:  # per block, before sharding, as torchtitan does: the hooks stay outside
                # Static shapes: blocks of one class at several widths (ResNet's stages) would otherwise be
                # retraced with symbolic shapes, which Inductor fails to compile on the CPU (BatchNorm's
                # backward, torch 2.15); each width compiles once instead.
                block.compile(dynamic=False)
            # The last block stays gathered after its forward, as in torchtitan: the backward pass
            # begins with it and would gather it again at once.
            fully_shard(block, mesh=mesh, mp_policy=precision, offload_policy=offload,
                        reshard_after_forward=block is not self.blocks[-1])
        fully_shard(model, mesh=mesh, mp_policy=precision, offload_policy=offload)
        if self.cfg.shm_allreduce:
            shm = private("FSDP2's custom collectives (torch.distributed.fsdp._fully_shard._fsdp_api)",
                          lambda: __import__("trainer.parallel.shm_fsdp", fromlist=["register_if_usable"]))
            if shm is not None:  # else gloo's all-gathers and reduce-scatters
                shm.register_if_usable([*self.blocks, model], self.ctx)
        return model

    def no_sync(self, boundary: bool) -> ContextManager:
        if not is_sharded(self.wrapped):
            return contextlib.nullcontext()
        return _accumulating(self.wrapped, boundary)

    def compiled(self, forward: Callable) -> Callable:
        if not is_sharded(forward):  # one process: the model is whole, compiled as a whole
            return super().compiled(forward)
        return forward  # the blocks were compiled in wrap()


def _recompute_in_backward(block: nn.Module) -> None:
    """Activation checkpointing through the public torch.utils.checkpoint: the block's forward runs without
    keeping its activations and again in the backward pass (the instance's forward; its parameters keep their
    names)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    @functools.wraps(forward)
    def recomputed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed


NORM_LAYERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm, nn.GroupNorm,
               nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def bf16_policy(model: nn.Module, per_parameter: bool | None = None):
    """fsdp's policy for --amp bf16, and the modules to shard on their own in fp32 (none where torch can say
    it per parameter). bf16 compute, fp32 gradient reduction, fp32 master weights (the shards stay fp32);
    norm layers keep fp32 parameters: BatchNorm's fp32 running statistics need fp32 weights.

    MixedPrecisionPolicy's per-parameter override (param_dtype_override_fn) is newer than the oldest torch
    this trainer supports. Without it each norm layer becomes an fsdp unit of its own, gathered in fp32: the
    same numbers, in more and smaller all-gathers. per_parameter: None asks torch; False forces that path
    (its test)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    norms = [m for m in model.modules() if isinstance(m, NORM_LAYERS) and any(True for _ in m.parameters())]
    kept = {id(p) for m in norms for p in m.parameters()}
    if per_parameter is not False:
        try:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                        param_dtype_override_fn=lambda p: p.dtype if id(p) in kept else None), []
        except TypeError:  # this torch has no per-parameter override
            if per_parameter:
                raise
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), norms


@contextlib.contextmanager
def _accumulating(model, boundary: bool) -> Iterator[None]:
    """Between the micro-batches of one step the gradients accumulate unsharded and unreduced, and the
    parameters stay gathered (no reshard, no all-gather again); the step's last backward reduces."""
    if boundary:
        yield
        return
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def for_run(cfg: TrainConfig, ctx: DistContext, model: nn.Module, replicate: bool | None = None,
            label: Callable[[str], str] = flag_name, name: str | None = None) -> Strategy:
    """The run's strategy, its model checked before anything is written (replicate: see Strategy). label: a
    setting's name as its user wrote it (a script's keyword argument); name: the model's (--model's by default)."""
    name = cfg.model if name is None else name
    if cfg.pipeline_stages > 1:
        from trainer.parallel.pipeline import PipelineStrategy

        return PipelineStrategy(cfg, ctx, label, name)
    blocks = find_blocks(model) if cfg.strategy == "fsdp" or cfg.activation_checkpointing else []
    if not blocks:
        if cfg.strategy == "fsdp":
            raise UsageError(label("strategy"), f"fsdp finds no blocks to shard in {name} ({type(model).__name__} "
                             "has no stack of repeated submodules)", "give the model an fsdp_blocks() method "
                             f"returning its blocks, or use {label('strategy')} ddp")
        if cfg.activation_checkpointing:
            raise UsageError(label("activation_checkpointing"), f"finds no blocks in {name} to recompute",
                             "give the model an fsdp_blocks() method returning its blocks, or drop the setting")
    return (FSDPStrategy if cfg.strategy == "fsdp" else Strategy)(cfg, ctx, blocks, replicate)


def evaluation_batches(model: nn.Module, batches: Iterable, count: int, ctx: DistContext) -> Iterator:
    """Validation batches (`count` of them on this rank); under fsdp every forward is a collective, so a rank
    with fewer batches (the validation shards are not padded) runs forwards of its last batch, unused, until
    all are done."""
    if not is_sharded(model) or getattr(model, "pipeline_stage", None) is not None:
        # Pipeline stages evaluate within their replica's stages alone (fsdp's evaluation pieces are gathered whole
        # beforehand), so a replica with fewer batches waits for nothing; and their model is a part: it has no
        # forward of its own to run a spare batch through.
        yield from batches
        return
    from trainer.parallel import collectives

    epoch = iter(batches)
    last = next(epoch, None)
    # A rank may have no validation batch at all (fewer samples than ranks): it forwards zeros shaped
    # like another rank's inputs, so it still joins every all-gather.
    shape = None if last is None else (tuple(last[0].shape), str(last[0].dtype).removeprefix("torch."))
    facts = collectives.all_gather_objects(ctx, (count, shape))
    if last is not None:
        yield last
        for last in epoch:
            yield last
    missing = max(n for n, _ in facts) - count
    if missing > 0:
        if last is not None:
            spare = last[0]
        else:
            size, dtype = next(shape for _, shape in facts if shape is not None)
            spare = torch.zeros(size, dtype=getattr(torch, dtype), device=ctx.device)
        for _ in range(missing):
            model(spare)
