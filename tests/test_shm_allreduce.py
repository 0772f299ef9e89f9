"""The shared-memory gradient all-reduce (CPU, every process on one host) trains as gloo's does."""
from __future__ import annotations

import pytest
from helpers import assert_same_params, dirs_args, final_params, max_param_difference, train_ok

from trainer.parallel.shm_allreduce import SHM_DIR, local_problem

RUN = ["--model", "cnn", "--synthetic-size", "576", "--batch-size", "16", "--max-steps", "6", "--lr", "0.05",
       "--warmup-steps", "2", "--log-every", "3", "--val-every", "0", "--num-workers", "0"]
USED = "gradients are all-reduced through shared memory"


def train_both_ways(tmp_path, nproc: int, extra: list[str]) -> tuple[dict, dict]:
    params = {}
    for shm in ("true", "false"):
        result = train_ok([*RUN, *extra, "--shm-allreduce", shm, *dirs_args(tmp_path / shm)], tmp_path, nproc=nproc, forked=True)
        assert (USED in result.stderr) == (shm == "true"), result.stderr[-2000:]
        params[shm] = final_params(tmp_path / shm / "checkpoints")
    return params["true"], params["false"]


def test_two_processes_train_bit_for_bit_as_with_gloo(tmp_path):
    # 6 steps: DDP rebuilds its buckets after the first, so the hook maps new ones mid-run. With gradient
    # accumulation, whose no_sync micro-batches skip the hook: a sum every step is the simpler case of the same path
    # (one run for CI's time).
    shm, gloo = train_both_ways(tmp_path, 2, ["--grad-accum", "2"])
    assert_same_params(shm, gloo)


def test_three_processes_sum_in_another_order_only(tmp_path):
    # With 3 ranks a slice is summed from its owner's rank on, gloo's ring starts elsewhere: the same
    # sums up to float rounding, far below a slice left unsummed (5e-3 and more here).
    shm, gloo = train_both_ways(tmp_path, 3, [])
    assert max_param_difference(shm, gloo) < 1e-5


def test_too_little_shared_memory_is_named_with_both_sizes():
    # The trainer then falls back to gloo with this reason in a warning (a collective decision).
    problem = local_problem(2**60)
    assert problem.startswith(f"{SHM_DIR} has ") and "MiB free and the gradients need" in problem
    assert local_problem(1) is None


FSDP_USED = "fsdp's all-gathers and reduce-scatters go through shared memory"


@pytest.mark.parametrize("nproc, extra", [(2, ["--grad-accum", "2", "--amp", "bf16"]), (3, [])],
                         ids=["2-grad-accum-bf16", "3"])
def test_fsdp_gathers_and_reduce_scatters_through_shared_memory_train_as_through_gloo(tmp_path, nproc, extra):
    # bf16 gathers bf16 weights and fp32 norm weights together, as bytes. All-gathers copy, so they are
    # exact; a reduce-scatter sums in rank order where gloo's ring starts elsewhere (3 processes).
    from trainer.checkpoint import sharded, store as checkpoint

    params = {}
    for shm in ("true", "false"):
        args = [*RUN, "--strategy", "fsdp", "--checkpoint-every", "3", *extra, "--shm-allreduce", shm,
                *dirs_args(tmp_path / shm)]
        result = train_ok(args, tmp_path, nproc=nproc, forked=True)
        assert (FSDP_USED in result.stderr) == (shm == "true"), result.stderr[-2000:]
        newest = checkpoint.list_checkpoints(tmp_path / shm / "checkpoints")[0]
        params[shm] = sharded.full_model_state(newest)
    assert max_param_difference(params["true"], params["false"]) < 1e-5
    halfway = sharded.full_model_state(checkpoint.list_checkpoints(tmp_path / "true" / "checkpoints")[-1])
    assert max_param_difference(params["true"], halfway) > 1e-3  # it trained on: the comparison says something
