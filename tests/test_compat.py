"""Private torch APIs behind guards: the public path each one falls back to trains to the same result.

TRAINER_PUBLIC_TORCH_ONLY=1 takes every public path (what a torch without the private names runs): gloo's
collectives instead of the shared-memory ones, torch.utils.checkpoint instead of the composable checkpoint,
torchvision's own CIFAR-10 checks. Real 2-process gloo runs, compared weight for weight.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import assert_same_params, clean_env, dirs_args, final_params, max_param_difference, train_ok

from trainer.checkpoint import sharded
from trainer.checkpoint.store import list_checkpoints

PUBLIC = {"TRAINER_PUBLIC_TORCH_ONLY": "1"}
RUN = ["--model", "cnn", "--synthetic-size", "256", "--batch-size", "16", "--epochs", "1", "--max-steps", "6",
       "--activation-checkpointing", "--val-every", "0", "--checkpoint-every", "0"]


@pytest.mark.slow
def test_ddp_on_public_apis_only_trains_bit_for_bit_as_on_the_private_ones(tmp_path):
    """Shared-memory all-reduce vs gloo's (2 processes: the same sums), composable checkpoint vs
    torch.utils.checkpoint (the same recomputation): the same weights, bit for bit."""
    private = train_ok([*RUN, *dirs_args(tmp_path / "private")], tmp_path, nproc=2, forked=True)
    public = train_ok([*RUN, *dirs_args(tmp_path / "public")], tmp_path, nproc=2, env=PUBLIC, forked=True)
    assert "all-reduced through shared memory" in private.stderr
    assert "all-reduced through shared memory" not in public.stderr
    assert_same_params(final_params(tmp_path / "public" / "checkpoints"),
                       final_params(tmp_path / "private" / "checkpoints"))


@pytest.mark.slow
def test_fsdp_on_public_apis_only_trains_as_on_the_private_ones(tmp_path):
    """FSDP2's custom collectives (shared memory) vs gloo's all-gathers and reduce-scatters, composable vs public
    checkpointing; the sharded checkpoints read back through DCP's public load (trainer-export's path)."""
    args = [*RUN, "--strategy", "fsdp"]
    private = train_ok([*args, *dirs_args(tmp_path / "private")], tmp_path, nproc=2, forked=True)
    public = train_ok([*args, *dirs_args(tmp_path / "public")], tmp_path, nproc=2, env=PUBLIC, forked=True)
    assert "go through shared memory" in private.stderr and "go through shared memory" not in public.stderr
    weights = [sharded.full_model_state(list_checkpoints(tmp_path / name / "checkpoints")[0])
               for name in ("private", "public")]
    assert weights[0].keys() == weights[1].keys() and weights[0]
    assert max_param_difference(*weights) < 1e-5  # a reduce-scatter's sums in another order: float rounding


def test_the_other_guards_take_their_public_path():
    """bf16 under fsdp without the per-parameter override (norm layers as fp32 units of their own), torchvision's
    own CIFAR-10 class, the bf16 probe assumed true: each fallback as a torch without the private name gets it."""
    probe = """
import torch, torchvision
from trainer.data.datasets import cifar10_class
from trainer.parallel.strategy import bf16_policy
from trainer.engine.process import cpu_has_bf16
model = torchvision.models.resnet18()
policy, units = bf16_policy(model, per_parameter=False)
assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
assert len(units) == sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules()) == 20
print(cifar10_class() is torchvision.datasets.CIFAR10, cpu_has_bf16(torch))
"""
    public = subprocess.run([sys.executable, "-c", probe], env=clean_env(PUBLIC), capture_output=True, text=True,
                            timeout=120)
    assert public.returncode == 0 and public.stdout.split() == ["True", "True"], public.stderr
    private = subprocess.run([sys.executable, "-c", probe], env=clean_env(), capture_output=True, text=True,
                             timeout=120)
    assert private.returncode == 0 and private.stdout.split()[0] == "False", private.stderr
