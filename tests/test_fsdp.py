"""--strategy fsdp: real gloo processes under torchrun, sharded checkpoints on disk, read back as a user would.

Grouped by promise: fsdp trains as ddp does; its checkpoints resume exactly, at any world size, and
survive a crash mid-save; trainer-export turns any checkpoint into the plain model's state_dict; bad
input is one line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from fault_helpers import descendants, wait_until
from helpers import (
    assert_same_params,
    assert_usage_error,
    clean_env,
    dirs_args,
    files_under,
    final_params,
    free_port,
    read_scalars,
    read_summary,
    run_trainer_forked,
    train_ok,
)

from trainer.checkpoint import sharded
from trainer.checkpoint import store as checkpoint

STEPS = 20
# 20 optimizer steps of a small CNN, 2 micro-batches each (accumulation under both strategies), a
# checkpoint every 5 steps, all kept; 2 processes x 8 samples x 2 micro-batches per step. The 129
# validation samples give one rank a batch more than the other (fsdp's forwards are collectives).
RUN = ["--model", "cnn", "--synthetic-size", "645", "--batch-size", "8", "--grad-accum", "2", "--epochs", "1",
       "--lr", "0.05", "--warmup-steps", "4", "--checkpoint-every", "5", "--keep-checkpoints", "10",
       "--log-every", "1", "--num-workers", "0"]

# A user's model with its blocks named (fsdp_blocks) and a dataset whose inputs carry their sample
# index, which the model writes down in training: the samples each process trained on, on disk.
USER_MODULE = '''
import os
import torch
from torch import nn
from torch.utils.data import TensorDataset

SIZE = 320


def data(cfg):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SIZE, 2, 8, 8, generator=g)
    x[:, 0, 0, 0] = torch.arange(SIZE, dtype=torch.float32)  # the sample's index, exactly
    y = (x[:, 1].mean(dim=(1, 2)) > 0).long()
    return TensorDataset(x, y), TensorDataset(x[:64], y[:64]), {"channels": 2, "image_size": 8, "num_classes": 2}


class Net(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.stem = nn.Sequential(nn.Flatten(), nn.Linear(128, 32))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, spec.num_classes)

    def fsdp_blocks(self):
        return list(self.blocks)

    def forward(self, x):
        if self.training:
            os.makedirs("seen", exist_ok=True)
            with open(f"seen/{os.getpid()}.txt", "a") as f:
                f.write(" ".join(str(int(i)) for i in x[:, 0, 0, 0].tolist()) + "\\n")
        x = x.clone()
        x[:, 0, 0, 0] = 0  # the index is a label for the test, not a feature
        h = self.stem(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def net(spec):
    return Net(spec)


def one_val_sample(cfg):
    train, val, spec = data(cfg)
    return train, TensorDataset(*val[:1]), spec


def flat(spec):
    return nn.Sequential(nn.Flatten(), nn.Linear(128, spec.num_classes))
'''
USER_RUN = ["--model", "fsdpcode:net", "--dataset", "fsdpcode:data", "--global-batch-size", "16", "--epochs", "2",
            "--lr", "0.05", "--strategy", "fsdp", "--checkpoint-every", "7", "--log-every", "7", "--num-workers", "0"]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port()), "-m", "trainer"]


def fsdp_full_params(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    return sharded.full_model_state(checkpoint.list_checkpoints(checkpoint_dir)[0])


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    train_ok([*RUN, *dirs_args(root)], root, nproc=2, forked=True)
    return root


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    train_ok([*RUN, "--strategy", "fsdp", *dirs_args(root)], root, nproc=2, forked=True)
    return root


# ------------------------------------------------------------------------------- fsdp trains as ddp does

@pytest.mark.slow
def test_fsdp_loss_trajectory_and_weights_match_ddp(ddp_run, fsdp_run):
    ddp, fsdp = read_scalars(ddp_run / "runs")["Loss/train"], read_scalars(fsdp_run / "runs")["Loss/train"]
    assert [s for s, _ in fsdp] == [s for s, _ in ddp] == list(range(1, STEPS + 1))
    # The same sums in another order (reduce-scatter instead of all-reduce): equal up to float rounding.
    for (step, a), (_, b) in zip(ddp, fsdp):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5), f"step {step}: ddp {a}, fsdp {b}"
    assert ddp[-1][1] < ddp[0][1]  # it learned something, or the comparison says little
    (_, ddp_val), = read_scalars(ddp_run / "runs")["Loss/val"]
    (_, fsdp_val), = read_scalars(fsdp_run / "runs")["Loss/val"]
    assert fsdp_val == pytest.approx(ddp_val, rel=1e-4)
    assert read_summary(fsdp_run / "runs")["strategy"] == "fsdp"
    assert read_summary(ddp_run / "runs")["strategy"] == "ddp"
    fsdp_params, ddp_params = fsdp_full_params(fsdp_run / "checkpoints"), final_params(ddp_run / "checkpoints")
    assert fsdp_params.keys() == ddp_params.keys()
    for name in ddp_params:
        torch.testing.assert_close(fsdp_params[name], ddp_params[name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_fsdp_composes_with_compile_and_activation_checkpointing(tmp_path):
    # ResNet-18's stages compiled one by one before sharding: BasicBlock.forward meets four channel
    # widths, which torch.compile's default would retrace with symbolic shapes, where Inductor fails
    # on the CPU (BatchNorm's backward). Against eager fsdp: the same first loss (the compiled forward
    # at the same weights), and the second within 1% (one update from the compiled, recomputed blocks'
    # gradients; compiled kernels sum in another order, and this small-batch BatchNorm net amplifies
    # that from step to step under ddp as well).
    run = ["--model", "resnet18", "--synthetic-size", "128", "--batch-size", "8", "--grad-accum", "2",
           "--max-steps", "2", "--lr", "0.01", "--log-every", "1", "--val-every", "0", "--num-workers", "0", "--strategy", "fsdp",
           "--activation-checkpointing"]
    losses = {}
    for compiled in ("false", "true"):
        train_ok([*run, "--compile", compiled, *dirs_args(tmp_path / compiled)], tmp_path, nproc=2, forked=True)
        losses[compiled] = read_scalars(tmp_path / compiled / "runs")["Loss/train"]
    assert [s for s, _ in losses["true"]] == [s for s, _ in losses["false"]] == [1, 2]
    (_, eager1), (_, eager2) = losses["false"]
    (_, compiled1), (_, compiled2) = losses["true"]
    assert compiled1 == pytest.approx(eager1, rel=1e-4)
    assert compiled2 == pytest.approx(eager2, rel=1e-2)
    assert abs(compiled2 - compiled1) > 1e-3  # it trained: the second comparison says something


def test_fsdp_checkpoints_are_committed_directories_of_shards(fsdp_run):
    directory = fsdp_run / "checkpoints"
    committed = checkpoint.list_checkpoints(directory)
    assert [p.name for p in committed] == [f"step-{s:08d}" for s in (20, 15, 10, 5)]
    for path in committed:
        assert (path / sharded.COMMIT_MARKER).is_file() and sharded.missing_parts(path) is None
        assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one per rank
    assert not list(directory.glob(".tmp-*"))


@pytest.mark.slow
def test_fsdp_resume_from_a_mid_run_checkpoint_equals_the_uninterrupted_run(fsdp_run, tmp_path):
    """Under --resume auto, with two damaged directories above step 10: step-00000017 lacks its marker (a save
    that did not finish: no checkpoint at all, passed over), step 15 lacks a shard (committed and corrupt: set
    aside with a warning, as a corrupt file is). Step 10 resumes, and the run ends as the uninterrupted one."""
    checkpoints = tmp_path / "checkpoints"
    for step in (10, 15):
        shutil.copytree(fsdp_run / "checkpoints" / f"step-{step:08d}", checkpoints / f"step-{step:08d}")
    (checkpoints / "step-00000015" / "__1_0.distcp").unlink()
    shutil.copytree(fsdp_run / "checkpoints" / "step-00000020", checkpoints / "step-00000017")
    (checkpoints / "step-00000017" / sharded.COMMIT_MARKER).unlink()
    result = train_ok([*RUN, "--strategy", "fsdp", "--resume", "auto", *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    warned = [line for line in result.stderr.splitlines() if "step-00000015 does not load" in line]
    assert len(warned) == 1 and "moved to step-00000015.corrupt, trying the previous one" in warned[0], \
        result.stderr[-3000:]
    assert "step-00000017 does not load" not in result.stderr  # never committed: not a candidate
    assert (checkpoints / "step-00000015.corrupt").is_dir()
    summary = read_summary(tmp_path / "runs")
    assert (summary["resumed_from_step"], summary["global_step"], summary["status"]) == (10, STEPS, "completed")
    assert_same_params(fsdp_full_params(checkpoints), fsdp_full_params(fsdp_run / "checkpoints"))


# ------------------------------------------------------------------------------- another world size

def seen_counts(root: Path) -> Counter:
    counts: Counter = Counter()
    for path in (root / "seen").glob("*.txt"):
        for line in path.read_text().split("\n"):
            counts.update(int(i) for i in line.split())
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 4])
def test_a_2_process_checkpoint_resumed_at_another_world_size_trains_every_sample_once_per_epoch(tmp_path_factory,
                                                                                                  nproc):
    first = tmp_path_factory.getbasetemp() / "world-2"
    if not first.exists():  # one 2-process run, resumed by each parameter
        first.mkdir()
        (first / "fsdpcode.py").write_text(USER_MODULE)
        train_ok([*USER_RUN, "--max-steps", "14", *dirs_args(first)], first, nproc=2, forked=True)
    assert read_summary(first / "runs")["global_step"] == 14  # mid-epoch: an epoch is 320 / 16 = 20 steps
    root = tmp_path_factory.mktemp(f"world-{nproc}")
    (root / "fsdpcode.py").write_text(USER_MODULE)
    shutil.copytree(first / "checkpoints", root / "checkpoints")
    resumed = subprocess.run([*(torchrun(nproc) if nproc > 1 else [sys.executable, "-m", "trainer"]), *USER_RUN,
                              *dirs_args(root)], cwd=root, env=clean_env(), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    summary = read_summary(root / "runs")
    assert (summary["resumed_from_step"], summary["global_step"], summary["world_size"]) == (14, 40, nproc)
    counts = seen_counts(first) + seen_counts(root)
    # Two epochs of 320 samples: every sample exactly twice, none replayed, none skipped.
    assert sorted(counts) == list(range(320)) and set(counts.values()) == {2}, \
        {i: n for i, n in counts.items() if n != 2}


@pytest.mark.slow
def test_a_rank_without_a_validation_batch_still_joins_fsdps_collectives(tmp_path):
    """One validation sample, two ranks: rank 1 has no batch of its own, yet every forward under fsdp is
    an all-gather, so it must forward something (zeros shaped like rank 0's inputs) or rank 0 hangs."""
    (tmp_path / "fsdpcode.py").write_text(USER_MODULE)
    args = [*USER_RUN, "--dataset", "fsdpcode:one_val_sample", "--epochs", "1"]  # validation ends an epoch
    done = train_ok([*args, *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    summary = read_summary(tmp_path / "runs")
    assert summary["global_step"] == 20 and summary["val_loss"] is not None, (summary, done.stderr[-2000:])


@pytest.mark.slow
def test_a_ddp_checkpoint_is_converted_for_an_fsdp_run(ddp_run, fsdp_run, tmp_path):
    """Documented: an fsdp run resumes a ddp checkpoint (each rank keeps its shard) and trains on as the
    fsdp run that wrote its own checkpoint did."""
    (tmp_path / "from").mkdir()
    shutil.copy(ddp_run / "checkpoints" / "step-00000015.pt", tmp_path / "from")
    train_ok([*RUN, "--strategy", "fsdp", "--resume", str(tmp_path / "from" / "step-00000015.pt"),
              *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    resumed = fsdp_full_params(tmp_path / "checkpoints")
    reference = fsdp_full_params(fsdp_run / "checkpoints")
    for name in reference:
        torch.testing.assert_close(resumed[name], reference[name], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------- a crash mid-save

SAVE_LOOP = """
import os, sys, torch
from trainer.checkpoint.checkpointer import Checkpointer, Labels
from trainer.checkpoint.state import Position
from trainer.parallel.context import setup
from trainer.config.settings import load_config
from trainer.engine.optim import build_optimizer, build_scheduler
from trainer.cluster.topology import WORKER, resolve

ctx = setup(resolve(os.environ, WORKER), "gloo", 60)
cfg = load_config(["--strategy", "fsdp", "--checkpoint-dir", sys.argv[1]], {}, ctx.world_size)
from trainer.parallel.strategy import for_run
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)])
for_run(cfg, ctx, model).wrap(model)
optimizer = build_optimizer(cfg, model)
saver = Checkpointer(ctx, sys.argv[1], keep=2, every=0, resume="never", sharded=True, door="built-in",
                     labels=Labels("--checkpoint-dir", "--log-dir", "--resume"))
saver.register({"model": model, "optimizer": optimizer, "scheduler": build_scheduler(cfg, optimizer, 1000)}, "test")
for step in range(1, 1000):  # 64 MiB of weights a save: long enough to be caught in the middle
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    saver.commit(Position(0, 0, step), 2, cfg.as_dict())
"""


@pytest.mark.slow
def test_a_crash_mid_save_leaves_the_previous_checkpoint_the_newest_valid_one(tmp_path):
    directory = tmp_path / "checkpoints"
    (tmp_path / "save_loop.py").write_text(SAVE_LOOP)
    writer = subprocess.Popen([*torchrun(2)[:-2], str(tmp_path / "save_loop.py"), str(directory)], cwd=tmp_path,
                              env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        # A committed checkpoint, and the next one with shard bytes on disk but no marker yet.
        wait_until(lambda: checkpoint.list_checkpoints(directory) and list(directory.glob(".tmp-*/*.distcp")), 180,
                   "a committed checkpoint and the next one being written")
        for pid in [*descendants(writer.pid), writer.pid]:  # every rank and torchrun, at once
            os.kill(pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    assert list(directory.glob(".tmp-*")), "killed between saves, not during one"
    committed = checkpoint.list_checkpoints(directory)
    state, newest = checkpoint.load_for_resume(directory, "auto")
    assert newest == committed[0]
    step = state["global_step"]
    assert newest.name == f"step-{step:08d}"
    weights = sharded.full_model_state(newest)
    assert all(t.eq(float(step)).all() for t in weights.values())
    assert not (directory / f"step-{step + 1:08d}").exists()


# ------------------------------------------------------------------------------- trainer-export

def export(src: Path, out: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.cli.export", str(src), str(out)], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_export_of_an_fsdp_resnet_loads_into_the_model_torchvision_builds(tmp_path):
    import torchvision
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    train_ok(["--model", "resnet18", "--synthetic-size", "16", "--batch-size", "2", "--max-steps", "2",
              "--strategy", "fsdp", "--activation-checkpointing", "--num-workers", "0", "--val-every", "0",
              *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    done = export(tmp_path / "checkpoints", tmp_path / "model.pt", tmp_path)  # a --checkpoint-dir: its newest
    assert done.returncode == 0, done.stderr
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    # torch's own converter of the same directory, as the reference
    dcp_to_torch_save(tmp_path / "checkpoints" / "step-00000002", tmp_path / "reference.pt")
    reference = torchvision.models.resnet18(num_classes=10)
    reference.load_state_dict(torch.load(tmp_path / "reference.pt", weights_only=False)["model"])
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model.eval()(images), reference.eval()(images))
    assert not torch.equal(model.conv1.weight, torchvision.models.resnet18(num_classes=10).conv1.weight)


@pytest.mark.slow
def test_export_of_a_ddp_file_and_of_an_fsdp_directory_give_the_models_weights(ddp_run, fsdp_run, tmp_path):
    from trainer.cli.export import main as trainer_export  # in this process: the resnet test runs the command

    for run, src in ((ddp_run, ddp_run / "checkpoints" / "step-00000020.pt"),
                     (fsdp_run, fsdp_run / "checkpoints" / "step-00000020")):
        assert trainer_export([str(src), str(tmp_path / "out.pt")]) == 0
        exported = torch.load(tmp_path / "out.pt", weights_only=True)
        expected = final_params(run / "checkpoints") if src.is_file() else fsdp_full_params(run / "checkpoints")
        assert_same_params(exported, expected)
    missing = export(tmp_path / "nowhere", tmp_path / "x.pt", tmp_path)
    assert_usage_error(missing, "SRC")
    assert not (tmp_path / "x.pt").exists()


# ------------------------------------------------------------------------------- bad input

def test_sync_bn_with_fsdp_is_one_line(tmp_path):
    result = run_trainer_forked(["--strategy", "fsdp", "--sync-bn", *dirs_args(tmp_path)], tmp_path, timeout=60)
    assert "--strategy ddp" in assert_usage_error(result, "--sync-bn")
    assert not files_under(tmp_path)


def test_a_model_without_blocks_is_refused_by_fsdp_before_anything_is_written(tmp_path):
    (tmp_path / "fsdpcode.py").write_text(USER_MODULE)
    result = run_trainer_forked(["--model", "fsdpcode:flat", "--dataset", "fsdpcode:data", "--strategy", "fsdp",
                                 "--num-workers", "0", *dirs_args(tmp_path)], tmp_path, timeout=60)
    assert "fsdp_blocks()" in assert_usage_error(result, "--strategy")
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["marker", "shard"])
def test_a_checkpoint_directory_missing_its_marker_or_a_shard_is_one_line(fsdp_run, tmp_path, damage):
    copy = tmp_path / "from" / "step-00000010"
    shutil.copytree(fsdp_run / "checkpoints" / "step-00000010", copy)
    gone = copy / (sharded.COMMIT_MARKER if damage == "marker" else "__1_0.distcp")
    gone.unlink()
    result = run_trainer_forked([*RUN, "--strategy", "fsdp", "--resume", str(copy), *dirs_args(tmp_path)], tmp_path,
                                timeout=60)
    assert str(gone) in assert_usage_error(result, "--resume")
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "runs").exists()


def test_every_world_size_reads_one_global_order_so_a_position_maps_exactly():
    """The fact the resume at another world size rests on: with the global batch fixed, global batch k holds
    the same samples at 1, 2 or 4 processes, and a checkpoint's position maps to the same sample."""
    from trainer.checkpoint import state as ckpt_state
    from trainer.data.sampling import epoch_shard

    def global_batches(world_size: int, global_batch: int = 8, size: int = 100) -> list[set[int]]:
        per_rank = global_batch // world_size
        shards = [epoch_shard(size, rank, world_size, seed=3, epoch=1) for rank in range(world_size)]
        return [{i for shard in shards for i in shard[k * per_rank:(k + 1) * per_rank]}
                for k in range(size // global_batch)]

    assert global_batches(1) == global_batches(2) == global_batches(4)
    saved = {"epoch": 1, "batch": 6, "samples_per_batch": 8}  # 2 processes x 4 samples, grad-accum 2
    assert ckpt_state.resized_batch(saved, 8, grad_accum=2) == 6  # 4 processes x 2 samples: unchanged
    assert ckpt_state.resized_batch(saved, 16, grad_accum=1) == 3  # 4 x 4, no accumulation: 48 samples in
