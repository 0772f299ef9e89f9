"""--checkpoint-async (docs/reliability.md, "asynchronous checkpoints" rows): the cadence's checkpoints are
written by a thread while training goes on, and they are the checkpoints a synchronous run writes, bit for
bit; a process killed while one is being written leaves only whole checkpoints, and the next start resumes
from the newest of them. Real trainer processes, real files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from fault_helpers import wait_until
from helpers import (
    checkpoint_steps,
    clean_env,
    dirs_args,
    load_checkpoint,
    read_summary,
    run_trainer_forked,
    train_ok,
)

from trainer.checkpoint import sharded, store

# resnet18's 11 M parameters and their momentum take long enough to write that the next steps run meanwhile:
# a write of the live tensors instead of a copy would catch them half-updated.
# 10 steps, a checkpoint every 3: 3, 6, 9 and the last step's, 10.
RUN = ["--model", "resnet18", "--synthetic-size", "160", "--synthetic-image-size", "16", "--image-size", "16",
       "--batch-size", "16", "--epochs", "1", "--checkpoint-every", "3", "--keep-checkpoints", "10",
       "--warmup-steps", "2"]


def tensors(state) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint dict, by its path in the dict."""
    found = {}

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}/{i}")
    walk(state, "")
    return found


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys(), what
    for key in ta:
        assert torch.equal(ta[key], tb[key]), f"{what}: {key}"


@pytest.mark.slow
def test_background_checkpoints_are_the_synchronous_ones_and_resume_the_same(tmp_path):
    """Each checkpoint written while later steps ran holds the state of its own step: the same tensors as a
    synchronous run's checkpoint at that step, and a run resumed from one ends where an uninterrupted one does."""
    sync = run_trainer_forked([*RUN, *dirs_args(tmp_path / "sync")], tmp_path)
    background = run_trainer_forked([*RUN, "--checkpoint-async", *dirs_args(tmp_path / "async")], tmp_path)
    assert sync.returncode == 0 and background.returncode == 0, (sync.stderr[-2000:], background.stderr[-2000:])
    steps = checkpoint_steps(tmp_path / "sync" / "checkpoints")
    assert steps == checkpoint_steps(tmp_path / "async" / "checkpoints") and len(steps) == 4
    for step in steps:
        name = f"step-{step:08d}.pt"
        assert_same_tensors(load_checkpoint(tmp_path / "sync" / "checkpoints" / name),
                            load_checkpoint(tmp_path / "async" / "checkpoints" / name), name)
    assert background.stderr.count("checkpoint committed: ") == len(steps)

    # Resume from a background checkpoint mid-epoch: the end is the synchronous run's end.
    for later in checkpoint_steps(tmp_path / "async" / "checkpoints"):
        if later > 6:
            (tmp_path / "async" / "checkpoints" / f"step-{later:08d}.pt").unlink()
    resumed = run_trainer_forked([*RUN, "--checkpoint-async", *dirs_args(tmp_path / "async")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert read_summary(tmp_path / "async" / "runs")["resumed_from_step"] == 6
    end = f"step-{steps[-1]:08d}.pt"
    assert_same_tensors(load_checkpoint(tmp_path / "sync" / "checkpoints" / end),
                        load_checkpoint(tmp_path / "async" / "checkpoints" / end), f"{end} after resume")


@pytest.mark.slow
def test_a_crash_during_a_background_write_leaves_the_previous_checkpoint_the_newest(tmp_path):
    """SIGKILL while the thread writes a checkpoint (a temp file exists): no half-written file is named
    step-*.pt, every committed one loads, and the next start resumes from the newest and completes."""
    args = ["--model", "resnet18", "--synthetic-size", "2560", "--synthetic-image-size", "16", "--image-size", "16",
            "--batch-size", "8", "--epochs", "1", "--checkpoint-every", "2", "--keep-checkpoints", "3",
            "--checkpoint-async", *dirs_args(tmp_path)]
    directory = tmp_path / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=tmp_path, env=clean_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: store.list_checkpoints(directory) and list(directory.glob(".tmp-step-*")), 240,
                   "a committed checkpoint and the next one being written in the background")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert list(directory.glob(".tmp-step-*")), "killed between writes, not during one"
    committed = store.list_checkpoints(directory)
    for path in committed:
        state = store.load(path)
        assert path.name == f"step-{state['global_step']:08d}.pt"
    newest = int(committed[0].stem.split("-")[1])

    again = run_trainer_forked([*args, "--max-steps", str(newest + 2)], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert read_summary(tmp_path / "runs")["resumed_from_step"] == newest
    assert not list(directory.glob(".tmp-step-*"))


@pytest.mark.slow
def test_fsdp_background_checkpoints_are_the_synchronous_ones(tmp_path):
    """Under fsdp every rank's shard is copied at the step and written by DCP's async_save while later steps
    run (its collectives on a group of their own); rank 0 commits once every shard is on disk. Each committed
    directory holds the same model and optimizer tensors as a synchronous run's directory at that step, and
    none is left uncommitted."""
    run = ["--model", "resnet18", "--synthetic-size", "160", "--synthetic-image-size", "16", "--image-size", "16",
           "--batch-size", "8", "--epochs", "1", "--checkpoint-every", "3", "--keep-checkpoints", "10",
           "--warmup-steps", "2", "--strategy", "fsdp", "--num-workers", "0"]
    train_ok([*run, *dirs_args(tmp_path / "sync")], tmp_path, nproc=2, forked=True)
    background = train_ok([*run, "--checkpoint-async", *dirs_args(tmp_path / "async")], tmp_path, nproc=2, forked=True)
    def committed(root):
        return sorted(int(p.name.split("-")[1]) for p in store.list_checkpoints(root / "checkpoints"))
    steps = committed(tmp_path / "sync")
    assert steps == committed(tmp_path / "async") and len(steps) == 4, steps
    assert background.stderr.count("checkpoint committed: ") == len(steps), background.stderr[-3000:]
    assert not list((tmp_path / "async" / "checkpoints").glob(".tmp-*"))
    for step in steps:
        name = f"step-{step:08d}"
        for key in ("model", "optimizer"):
            a = sharded.full_model_state(tmp_path / "sync" / "checkpoints" / name, key)
            b = sharded.full_model_state(tmp_path / "async" / "checkpoints" / name, key)
            assert a.keys() == b.keys() and a, (name, key)
            for tensor in a:
                assert torch.equal(a[tensor], b[tensor]), f"{name}: {key}.{tensor}"
