"""torchvision's reference recipe (issue 34): each technique against its library's own result, exact resume with
every technique on at once, the script door, and the recipe's bad input.

Real processes (the built-in loop under torchrun, scripts on trainer.api) where the promise is the run's; the
library comparisons call torchvision and torch themselves, on the same draws.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    BAD_INPUT_TIMEOUT_S,
    assert_identical,
    assert_usage_error,
    clean_env,
    dirs_args,
    files_under,
    load_checkpoint,
    mid_epoch_copy,
    read_scalars,
    read_summary,
    run_trainer_forked,
    train_ok,
)

from trainer.checkpoint.store import list_checkpoints
from trainer.data.augment import MixUpCutMix, SampleAugment, mix_key, policy_transform
from trainer.data.images import sample_key, synthetic_spec
from trainer.data.sampling import epoch_shard, sample_of
from trainer.engine.models import build_model

# ------------------------------------------------------------------------------- exact resume, everything on

STEPS_PER_EPOCH = 640 // (2 * 8)  # 2 processes x 8 samples: 40 steps per epoch, 80 in all
EVERYTHING = ["--model", "cnn", "--synthetic-size", "640", "--batch-size", "8", "--epochs", "2", "--lr", "0.05",
              "--warmup-steps", "10", "--checkpoint-every", "25", "--keep-checkpoints", "20", "--log-every", "5",
              "--num-workers", "0", "--val-every", "2",
              "--clip-grad-norm", "0.5", "--label-smoothing", "0.1", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
              "--model-ema", "--model-ema-steps", "3", "--auto-augment", "ta_wide", "--random-erase", "0.25",
              "--ra-sampler", "--ra-reps", "2", "--train-crop-size", "28", "--val-crop-size", "28",
              "--norm-weight-decay", "0", "--bias-weight-decay", "0.0001"]


@pytest.fixture(scope="module")
def everything_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("everything")
    train_ok([*EVERYTHING, *dirs_args(root)], root, nproc=2, forked=True)
    return root


def newest(checkpoint_dir: Path) -> dict:
    return load_checkpoint(list_checkpoints(checkpoint_dir)[0])


@pytest.mark.slow
@pytest.mark.parametrize("step", [25, 50], ids=["epoch-0", "epoch-1"])
def test_everything_on_resumed_mid_epoch_at_two_processes_ends_bit_identical(everything_run, tmp_path, step):
    """Clipping, smoothing, mixup and cutmix, the EMA, TrivialAugmentWide and erasing on the device (the in-memory,
    GPU-resident input path), repeated augmentation, crops, split weight decays: a run resumed from a mid-epoch
    checkpoint ends with the uninterrupted run's model, optimizer and EMA, bit for bit."""
    copy = mid_epoch_copy(everything_run, tmp_path, step, STEPS_PER_EPOCH)

    resumed_run = train_ok([*EVERYTHING, "--resume", str(copy), *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    # The EMA's line says what it does from here: the warm-up (10 steps) is behind a run resumed at step 25 or 50.
    assert (f"every update averages (resumed at step {step}, past the LR warm-up's 10 steps)\n"
            in resumed_run.stderr), resumed_run.stderr[-3000:]
    summary = read_summary(tmp_path / "runs")
    assert (summary["resumed_from_step"], summary["global_step"]) == (step, 2 * STEPS_PER_EPOCH)
    resumed, uninterrupted = newest(tmp_path / "checkpoints"), newest(everything_run / "checkpoints")
    for name in ("model", "optimizer", "model_ema", "scheduler"):
        assert_identical(resumed[name], uninterrupted[name], name)
    assert int(resumed["model_ema"]["n_averaged"]) > 1  # it averaged (after the warm-up's copies)
    # The EMA was validated beside the model, and both went to summary.json.
    assert summary["val_acc1"] is not None and summary["val_ema_acc1"] is not None, summary
    assert "Grad/norm" in read_scalars(tmp_path / "runs")


@pytest.mark.slow
def test_an_image_folder_with_the_policy_in_its_workers_and_repeats_resumes_bit_identical(tmp_path):
    """The loader's workers draw each copy's crop, AugMix and erasure from its key (--ra-sampler: each copy its own),
    at --train-crop-size and bicubic: a run resumed mid-epoch ends with the uninterrupted run's weights and EMA."""
    from helpers import write_jpeg_folder

    write_jpeg_folder(tmp_path / "data", per_class={"train": 12, "val": 2}, size=(96, 72))
    run = ["--model", "cnn", "--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"), "--image-size", "40",
           "--train-crop-size", "32", "--val-resize-size", "44", "--interpolation", "bicubic", "--batch-size", "4",
           "--epochs", "2", "--num-workers", "2", "--auto-augment", "augmix", "--random-erase", "0.5",
           "--ra-sampler", "--ra-reps", "2", "--model-ema", "--model-ema-steps", "2", "--warmup-steps", "1",
           "--checkpoint-every", "4", "--keep-checkpoints", "10", "--val-every", "2"]
    (tmp_path / "through").mkdir()
    through = train_ok([*run, *dirs_args(tmp_path / "through")], tmp_path / "through", forked=True)
    assert read_summary(tmp_path / "through" / "runs")["global_step"] == 12  # 24 samples, 4 a step, 2 epochs
    # --augment auto's choice, in the start line: the light policy for crops this small, not the reference's crop.
    assert "12 steps, 6 per epoch; augment light (auto: 32 px crops are below 128): a padded random crop + flip, " \
           "the CIFAR recipe's, where torchvision's reference takes RandomResizedCrop at any size (--augment " \
           "imagenet)\n" in through.stderr, through.stderr[-3000:]
    copy = tmp_path / "from" / "step-00000008.pt"  # epoch 1, batch 2 of 6
    copy.parent.mkdir()
    shutil.copy(tmp_path / "through" / "checkpoints" / copy.name, copy)
    (tmp_path / "resumed").mkdir()
    train_ok([*run, "--resume", str(copy), *dirs_args(tmp_path / "resumed")], tmp_path / "resumed", forked=True)
    resumed, through = newest(tmp_path / "resumed" / "checkpoints"), newest(tmp_path / "through" / "checkpoints")
    for name in ("model", "optimizer", "model_ema"):
        assert_identical(resumed[name], through[name], name)


# ------------------------------------------------------------------------------- each technique, its library's

def test_mixup_and_cutmix_are_torchvisions_for_the_same_generator_state():
    """The batch mix is v2.RandomChoice([v2.MixUp, v2.CutMix]) drawn from torch's generator seeded by the batch's key;
    torch's global random state is left as it was; another key draws another mix."""
    from torchvision.transforms import v2

    x = torch.rand(8, 3, 16, 16)
    y = torch.randint(0, 10, (8,))
    ours = MixUpCutMix(0.2, 1.0, num_classes=10)
    for key in [mix_key(0, 0, batch, rank) for batch in range(6) for rank in range(2)]:
        torch.manual_seed(1234)
        before = torch.get_rng_state()
        mixed, soft = ours(x, y, key)
        assert torch.equal(torch.get_rng_state(), before)
        torch.manual_seed(key)
        reference = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=10), v2.CutMix(alpha=1.0, num_classes=10)])
        expected_x, expected_y = reference(x, y)
        assert torch.equal(mixed, expected_x) and torch.equal(soft, expected_y)
    assert not torch.equal(ours(x, y, mix_key(0, 0, 0, 0))[0], ours(x, y, mix_key(0, 0, 0, 1))[0])
    only_mixup = MixUpCutMix(0.4, 0.0, num_classes=10)
    torch.manual_seed(7)
    assert torch.equal(only_mixup(x, y, 7)[1], v2.MixUp(alpha=0.4, num_classes=10)(x, y)[1])


def test_a_samples_policy_and_erasure_are_torchvisions_drawn_from_its_key():
    """--auto-augment and --random-erase: the v2 transforms, applied sample by sample from torch's generator seeded
    by the sample's key (what every input path calls); the reference erases normalised images with 0, the mean
    colour, which is the uint8 image erased with the mean."""
    from torchvision.transforms import v2

    images = torch.randint(0, 256, (6, 3, 24, 24), dtype=torch.uint8)
    keys = [sample_key(i, 3, 0) for i in range(6)]
    ours = SampleAugment(policy_transform("ta_wide", 9, 3, "bilinear"), 0.5, (0.5, 0.25, 0.125)).batch(images, keys)
    for image, key, got in zip(images, keys, ours):
        torch.manual_seed(key)
        expected = v2.TrivialAugmentWide(interpolation=v2.InterpolationMode.BILINEAR)(image)  # the reference's
        expected = v2.RandomErasing(p=0.5, value=[128, 64, 32])(expected)
        assert torch.equal(got, expected)
    assert not all(torch.equal(a, b) for a, b in zip(ours, images))  # it changed something


def test_the_image_folders_apply_the_policy_in_their_workers_and_the_gpu_path_leaves_it_to_the_device(tmp_path):
    """The PIL and fast CPU paths (and packs) augment their training views where they make them, from the sample's
    key: the same view as the policy applied to the plain view. --decode gpu's views are augmented on the device
    (data.Batches, as in-memory data are); validation views never are."""
    from trainer.data import jpeg
    from trainer.data.images import ImageFolderWithKeys

    from helpers import write_jpeg_folder

    write_jpeg_folder(tmp_path, per_class={"train": 3, "val": 1}, size=(90, 70))
    samples = SampleAugment(policy_transform("augmix", 9, 3, "bicubic"), 0.5, (0.485, 0.456, 0.406))
    for kind in (ImageFolderWithKeys, jpeg.FastImageFolder):
        plain = kind(tmp_path / "train", True, 40, "imagenet", 3, interpolation="bicubic")
        augmented = kind(tmp_path / "train", True, 40, "imagenet", 3, interpolation="bicubic", samples=samples)
        assert augmented.augments_samples
        for index in range(len(plain)):
            view = plain[(index, 5)][0]
            assert torch.equal(augmented[(index, 5)][0], samples(view, sample_key(index, 5, 3)))
        val = kind(tmp_path / "val", False, 40, "imagenet", 3, resize=60, samples=samples)
        assert torch.equal(val[(0, 5)][0], kind(tmp_path / "val", False, 40, "imagenet", 3, resize=60)[(0, 5)][0])
    assert not jpeg.GpuImageFolder.augments_samples


def test_repeated_augmentation_order_is_the_references_and_each_copy_has_a_key_of_its_own():
    """--ra-sampler: the epoch's shuffled order (DistributedSampler's) with every sample repeated ra_reps times in a
    row, dealt to the ranks in turn, cut to an epoch's length; a copy's key epoch differs from its sibling's."""
    size, reps, world, seed, epoch = 50, 3, 3, 5, 2
    shards = [epoch_shard(size, rank, world, seed, epoch, reps) for rank in range(world)]
    assert all(len(shard) == size // world for shard in shards)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    order = torch.randperm(size, generator=generator).tolist()
    dealt = [v % size for position in range(size // world) for v in (shard[position] for shard in shards)]
    assert dealt == [s for s in order for _ in range(reps)][:size // world * world]
    # With as many ranks as copies, each rank gets one copy of each of the same samples.
    assert [sorted(v % size for v in shard) for shard in shards] == [sorted(order[:size // world])] * world
    keys = {sample_of(v, size, reps, epoch) for shard in shards for v in shard}
    assert len(keys) == size // world * world  # every copy its own (index, key epoch)
    assert epoch_shard(size, 1, world, seed, epoch) == epoch_shard(size, 1, world, seed, epoch, 1)


def test_the_ema_after_n_steps_is_averaged_models_on_the_same_sequence(tmp_path):
    """The run's EMA, checkpointed after step 10, against torch.optim.swa_utils.AveragedModel fed the model of every
    step as the reference does: the decay adjusted for the global batch, --model-ema-steps and --epochs, an update
    every 2 steps, the warm-up's updates copying."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    done = train_ok(["--model", "cnn", "--synthetic-size", "320", "--batch-size", "16", "--epochs", "4",
                     "--max-steps", "10", "--warmup-steps", "3", "--model-ema", "--model-ema-steps", "2",
                     "--model-ema-decay", "0.999", "--checkpoint-every", "1", "--keep-checkpoints", "20",
                     "--val-every", "0", "--num-workers", "0", *dirs_args(tmp_path)], tmp_path, forked=True)
    assert "--model-ema: an average of the weights every 2 steps, decay 0.992 (0.999 adjusted for a global batch of " \
           "16 over 4 epochs); updates up to step 3 (the LR warm-up) copy the weights\n" in done.stderr, done.stderr
    states = {step: load_checkpoint(tmp_path / "checkpoints" / f"step-{step:08d}.pt") for step in range(1, 11)}
    decay = 1 - min(1.0, (1 - 0.999) * 16 * 2 / 4)  # (1 - decay) x world x batch x ema steps / epochs
    model = build_model("cnn", synthetic_spec(32))
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    for step in range(2, 11, 2):
        model.load_state_dict(states[step]["model"])
        reference.update_parameters(model)
        if step <= 3:
            reference.n_averaged.fill_(0)
    assert_identical(states[10]["model_ema"], reference.state_dict(), "model_ema")
    assert not torch.equal(states[10]["model_ema"]["module.head.2.weight"], states[10]["model"]["head.2.weight"])
    # trainer-export --ema: the average as the model's own state_dict, what loads into the model for inference.
    done = subprocess.run([sys.executable, "-m", "trainer.cli.export", "--ema", str(tmp_path / "checkpoints"),
                           str(tmp_path / "ema.pt")], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    model.load_state_dict(exported)
    assert_identical(exported, reference.module.state_dict(), "exported")


def test_clipping_is_clip_grad_norm_on_the_unscaled_gradients_and_fp16s_clipped_norm_is_within_the_bound():
    """fp16's order, nanoGPT's: the scaler unscales, then torch.nn.utils.clip_grad_norm_; against the same model's
    fp32 gradients clipped by clip_grad_norm_ itself. (The CPU's GradScaler: fp16 training itself needs CUDA.)"""
    from trainer.engine.optim import clip_gradients

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    twin.load_state_dict(model.state_dict())
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    scaler.scale(torch.nn.functional.cross_entropy(model(x), y) * 50).backward()
    scaler.unscale_(optimizer)  # what run.clip_gradients() does first
    norm = clip_gradients(optimizer, 0.25)
    torch.nn.functional.cross_entropy(twin(x), y).mul(50).backward()
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.25)
    assert norm.item() == pytest.approx(expected.item(), rel=1e-5) and norm.item() > 0.25  # it clipped
    for ours, theirs in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped.item() <= 0.25 * (1 + 1e-5)


def test_parameter_groups_are_the_references(tmp_path):
    """A ResNet's optimizer groups in the built-in loop's checkpoint: every bias (a norm layer's too: the reference's
    custom key comes first) at --bias-weight-decay, the norm layers' weights at --norm-weight-decay, the rest at
    --weight-decay, in that order, each in the model's order; with the defaults (0 for both), the two groups earlier
    checkpoints hold (weights; norms and biases). A checkpoint numbers parameters group after group: each group is
    read back as its decay and its parameters' shapes (their momentum buffers')."""
    def groups(*flags: str) -> list[tuple[float, list[tuple[int, ...]]]]:
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        root.mkdir()
        train_ok(["--model", "resnet18", "--synthetic-size", "16", "--batch-size", "4", "--max-steps", "1",
                  "--val-every", "0", "--num-workers", "0", *flags, *dirs_args(root)], root, forked=True)
        saved = newest(root / "checkpoints")["optimizer"]
        return [(group["weight_decay"], [tuple(saved["state"][i]["momentum_buffer"].shape) for i in group["params"]])
                for group in saved["param_groups"]]

    model = build_model("resnet18", synthetic_spec(32))
    kinds = {}
    for owner, module in model.named_modules():
        for name, _param in module.named_parameters(recurse=False):
            kinds[f"{owner}.{name}".lstrip(".")] = ("bias" if name == "bias" else
                                                   "norm" if isinstance(module, torch.nn.BatchNorm2d) else "other")
    params = list(model.named_parameters())

    def shapes(*wanted: str) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for name, p in params if kinds[name] in wanted]

    assert groups("--weight-decay", "0.3", "--norm-weight-decay", "0.1", "--bias-weight-decay", "0.2") == [
        (0.3, shapes("other")), (0.1, shapes("norm")), (0.2, shapes("bias"))]
    assert len(shapes("norm")) == 20 and len(shapes("bias")) == 21  # 20 BatchNorms' weights; their biases, fc's
    assert groups() == [(5e-4, [tuple(p.shape) for _, p in params if p.ndim > 1]),
                        (0.0, [tuple(p.shape) for _, p in params if p.ndim <= 1])]


@pytest.mark.slow
def test_fsdp_with_clipping_agrees_with_ddp_with_clipping(tmp_path):
    """At 2 processes, a bound that clips every step: the Grad/norm fsdp logs (the norm over both ranks' shards) and
    its final weights agree with ddp's within 1e-5."""
    from trainer.checkpoint import sharded

    run = ["--model", "cnn", "--synthetic-size", "320", "--batch-size", "8", "--max-steps", "12", "--lr", "0.05",
           "--warmup-steps", "2", "--clip-grad-norm", "0.05", "--log-every", "1", "--val-every", "0",
           "--num-workers", "0"]
    for strategy in ("ddp", "fsdp"):
        (tmp_path / strategy).mkdir()
        train_ok([*run, "--strategy", strategy, *dirs_args(tmp_path / strategy)], tmp_path / strategy, nproc=2, forked=True)
    ddp, fsdp = (read_scalars(tmp_path / s / "runs")["Grad/norm"] for s in ("ddp", "fsdp"))
    assert [s for s, _ in ddp] == [s for s, _ in fsdp] == list(range(1, 13))
    assert min(v for _, v in ddp) > 0.05  # every step clipped
    for (step, a), (_, b) in zip(ddp, fsdp):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-5), f"step {step}: ddp {a}, fsdp {b}"
    fsdp_params = sharded.full_model_state(list_checkpoints(tmp_path / "fsdp" / "checkpoints")[0])
    ddp_params = newest(tmp_path / "ddp" / "checkpoints")["model"]
    for name in ddp_params:
        torch.testing.assert_close(fsdp_params[name], ddp_params[name], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- resuming with and without an EMA

@pytest.mark.slow
def test_an_ema_starts_from_resumed_weights_and_one_left_off_is_kept_untouched(tmp_path):
    """A checkpoint without an EMA resumed with --model-ema: the average starts from the resumed weights, said in one
    line. That checkpoint (with an EMA) resumed without --model-ema: the EMA is carried along as it was."""
    base = ["--model", "cnn", "--synthetic-size", "320", "--batch-size", "16", "--epochs", "1", "--val-every", "0",
            "--num-workers", "0", "--warmup-steps", "0", *dirs_args(tmp_path)]
    train_ok([*base, "--max-steps", "4"], tmp_path, forked=True)
    plain = newest(tmp_path / "checkpoints")
    assert "model_ema" not in plain
    started = train_ok([*base, "--max-steps", "6", "--model-ema", "--model-ema-steps", "100"], tmp_path, forked=True)
    said = [line for line in started.stderr.splitlines() if "holds no average of the weights" in line]
    assert len(said) == 1 and "step-00000004.pt" in said[0], started.stderr[-3000:]
    assert "every update averages (no LR warm-up)\n" in started.stderr, started.stderr[-3000:]  # --warmup-steps 0
    with_ema = newest(tmp_path / "checkpoints")
    assert with_ema["global_step"] == 6
    for name, value in plain["model"].items():  # no update in steps 5 and 6 (every 100): the resumed weights
        assert torch.equal(with_ema["model_ema"][f"module.{name}"], value), name
    refused = subprocess.run([sys.executable, "-m", "trainer.cli.export", "--ema", str(tmp_path / "checkpoints" /
                              "step-00000004.pt"), str(tmp_path / "ema.pt")], env=clean_env(), capture_output=True,
                             text=True, timeout=120)
    assert "holds no average of the weights" in assert_usage_error(refused, "--ema")
    train_ok([*base, "--max-steps", "8"], tmp_path, forked=True)
    kept = newest(tmp_path / "checkpoints")
    assert kept["global_step"] == 8
    assert_identical(kept["model_ema"], with_ema["model_ema"], "model_ema")


# ------------------------------------------------------------------------------- the script door

API_SCRIPT = '''
import sys
import torch
from trainer import api

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(96, 1, 4, 4), torch.randint(0, 3, (96,)))  # images: mixup's input
norms = []


class Recording(torch.optim.SGD):
    """The gradients' norm as the optimizer sees them, after the run clipped them."""
    def step(self, closure=None):
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.param_groups[0]["params"]])))
        return super().step(closure)


with api.Run(max_steps=int(sys.argv[1])) as run:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    forward = run.wrap(model)
    optimizer = Recording(model.parameters(), lr=0.5)
    run.resume(model=model, optimizer=optimizer)
    torch.save(run.ema.state_dict(), f"ema-after-resume-{run.step_count}.pt")
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=run.sampler(data, 8), drop_last=True)
    for epoch in run.epochs(2):
        for micro_batches in run.steps(loader):
            for x, y in micro_batches:
                x, y = run.mixup_cutmix(x, y, 3)
                with run.autocast():
                    loss = torch.nn.functional.cross_entropy(forward(x), y)
                run.backward(loss)
            run.optimizer_step(optimizer)
    evaluated = api.evaluate(run, run.ema, [(x, y) for x, y in torch.utils.data.DataLoader(data, batch_size=32)])
print("largest norm seen by the optimizer", max(float(n) for n in norms))
print("ema acc1", evaluated["acc1/val"])
'''


@pytest.mark.slow
def test_a_script_with_clipping_and_an_ema_from_the_environment_clips_and_resumes_its_ema(tmp_path):
    """TRAIN_CLIP_GRAD_NORM and TRAIN_MODEL_EMA (and TRAIN_MIXUP_ALPHA) only: run.optimizer_step clips (the optimizer
    never sees a larger norm; Grad/norm is logged), run.ema is in every checkpoint, and a script stopped at step 5
    and run again ends with the EMA of a run that went through."""
    (tmp_path / "train.py").write_text(API_SCRIPT)
    env = {"TRAIN_CLIP_GRAD_NORM": "0.1", "TRAIN_MODEL_EMA": "true", "TRAIN_MODEL_EMA_STEPS": "2",
           "TRAIN_MIXUP_ALPHA": "0.4", "TRAIN_LOG_EVERY": "1", "TRAIN_WARMUP_STEPS": "2"}

    def script(where: Path, steps: int) -> subprocess.CompletedProcess:
        where.mkdir(exist_ok=True)
        done = subprocess.run([sys.executable, str(tmp_path / "train.py"), str(steps)], cwd=where,
                              env=clean_env({**env, "TRAIN_CHECKPOINT_DIR": str(where / "checkpoints"),
                                             "TRAIN_LOG_DIR": str(where / "runs")}),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    through = script(tmp_path / "through", 24)
    # The script's learning rate is constant (no scheduler): the EMA's line says its copies follow warmup_steps, and
    # announces no LR warm-up.
    assert "model_ema: an average of the weights every 2 steps, decay 0.99984 (0.99998 adjusted for a global batch " \
           "of 8 over 2 epochs); updates up to step 2 copy the weights (warmup_steps 2; the script's learning rate " \
           "is its own: warmup_steps=0 averages from the first)\n" in through.stderr, through.stderr[-3000:]
    largest = float(through.stdout.split("largest norm seen by the optimizer")[1].split()[0])
    assert largest <= 0.1 * (1 + 1e-5)
    logged = [value for _, value in read_scalars(tmp_path / "through" / "runs")["Grad/norm"]]
    assert len(logged) == 24 and max(logged) > 0.1  # the norms before clipping: it did clip
    assert "ema acc1" in through.stdout
    script(tmp_path / "stopped", 5)
    at_five = newest(tmp_path / "stopped" / "checkpoints")
    assert at_five["global_step"] == 5 and "model_ema" in at_five
    resumed = script(tmp_path / "stopped", 24)
    assert "every update averages (resumed at step 5, past the 2 steps of warmup_steps 2)\n" in resumed.stderr, \
        resumed.stderr[-3000:]
    assert_identical(torch.load(tmp_path / "stopped" / "ema-after-resume-5.pt", weights_only=True),
                     at_five["model_ema"], "the EMA resumed")
    assert_identical(newest(tmp_path / "stopped" / "checkpoints")["model_ema"],
                     newest(tmp_path / "through" / "checkpoints")["model_ema"], "the final EMA")
    assert_identical(newest(tmp_path / "stopped" / "checkpoints")["model"],
                     newest(tmp_path / "through" / "checkpoints")["model"], "the final model")


# ------------------------------------------------------------------------------- the reference's LR schedule

SCHEDULE_RUN = ["--model", "cnn", "--synthetic-size", "64", "--batch-size", "16", "--epochs", "6", "--lr", "0.05",
                "--log-every", "1", "--val-every", "0", "--num-workers", "0", "--tracker", "csv"]
SCHEDULE_STEPS_PER_EPOCH = 64 // 16  # one process: 4 optimizer steps per epoch, 24 in all


def logged_rates(log_dir: Path) -> dict[int, float]:
    """The run's learning rate after each logged step, from metrics.csv (as written: TensorBoard keeps float32)."""
    with open(log_dir / "metrics.csv", newline="") as f:
        return {int(row["step"]): float(row["value"]) for row in csv.DictReader(f) if row["tag"] == "lr"}


def references_lr_by_epoch(epochs: int, lr: float, scheduler: str = "steplr", warmup_epochs: int = 0,
                           warmup_method: str = "constant", warmup_decay: float = 0.01, step_size: int = 30,
                           gamma: float = 0.1, lr_min: float = 0.0) -> list[float]:
    """The learning rate of each epoch, and of the one after the last, as torchvision's
    references/classification/train.py gets it from its flags (their defaults here): torch's main scheduler, its
    warm-up scheduler chained before it by SequentialLR at the warm-up's end, stepped once after each epoch."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedulers = torch.optim.lr_scheduler
    main = {"steplr": lambda: schedulers.StepLR(optimizer, step_size=step_size, gamma=gamma),
            "cosineannealinglr": lambda: schedulers.CosineAnnealingLR(optimizer, T_max=epochs - warmup_epochs,
                                                                       eta_min=lr_min),
            "exponentiallr": lambda: schedulers.ExponentialLR(optimizer, gamma=gamma)}[scheduler]()
    schedule = main
    if warmup_epochs > 0:
        warmup = schedulers.LinearLR(optimizer, start_factor=warmup_decay, total_iters=warmup_epochs) \
            if warmup_method == "linear" else schedulers.ConstantLR(optimizer, factor=warmup_decay,
                                                                    total_iters=warmup_epochs)
        schedule = schedulers.SequentialLR(optimizer, [warmup, main], milestones=[warmup_epochs])
    rates = []
    for _ in range(epochs + 1):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


# (flags, TRAIN_* environment, references_lr_by_epoch's keyword arguments for the same run)
REFERENCE_SCHEDULES = {
    "steplr by default, linear warm-up": (
        ["--lr-warmup-epochs", "2", "--lr-warmup-method", "linear", "--lr-warmup-decay", "0.1", "--lr-step-size", "2",
         "--lr-gamma", "0.5"], {},
        {"warmup_epochs": 2, "warmup_method": "linear", "warmup_decay": 0.1, "step_size": 2, "gamma": 0.5}),
    "cosineannealinglr as the reference spells it, constant warm-up, lr-min": (
        ["--lr-scheduler", "CosineAnnealingLR", "--lr-warmup-epochs", "1", "--lr-min", "0.005"], {},
        {"scheduler": "cosineannealinglr", "warmup_epochs": 1, "lr_min": 0.005}),
    "exponentiallr from the environment": (
        [], {"TRAIN_LR_SCHEDULER": "exponentiallr", "TRAIN_LR_GAMMA": "0.7"},
        {"scheduler": "exponentiallr", "gamma": 0.7}),
}


@pytest.mark.parametrize("flags, environment, reference", REFERENCE_SCHEDULES.values(),
                         ids=REFERENCE_SCHEDULES.keys())
def test_the_references_schedule_flags_train_each_epoch_at_the_rate_of_torchs_sequentiallr_built_as_the_reference(
        tmp_path, flags, environment, reference):
    """The reference's scheduler flags, as its users type them, step once per epoch: every optimizer step of an
    epoch trains at the rate the reference's SequentialLR(LinearLR or ConstantLR, StepLR, CosineAnnealingLR or
    ExponentialLR) holds in that epoch (the warm-up's whole first epoch at --lr-warmup-decay x lr). Before: the
    flags were unknown (exit 2), and the mapped --warmup-steps rose every step from lr/N."""
    train_ok([*SCHEDULE_RUN, *flags, *dirs_args(tmp_path)], tmp_path, env=environment, forked=True)
    expected = references_lr_by_epoch(6, 0.05, **reference)
    logged = logged_rates(tmp_path / "runs")  # after step S: the rate of the step after it
    assert sorted(logged) == list(range(1, 6 * SCHEDULE_STEPS_PER_EPOCH + 1))
    for step, rate in logged.items():
        assert rate == pytest.approx(expected[step // SCHEDULE_STEPS_PER_EPOCH], rel=1e-12, abs=0), (step, logged)
    if reference.get("warmup_epochs"):
        assert logged[1] == pytest.approx(0.05 * reference.get("warmup_decay", 0.01))


def test_the_references_schedule_resumed_mid_epoch_ends_bit_identical_and_the_ema_copies_through_its_warmup(tmp_path):
    """A run on the reference's schedule resumed from a mid-epoch checkpoint goes on at the uninterrupted run's rate
    and ends with its model, optimizer, scheduler and EMA, bit for bit; the EMA copies the weights through the
    warm-up's epochs (the reference's), and averages every step after them."""
    run = [*SCHEDULE_RUN, "--lr-scheduler", "cosineannealinglr", "--lr-warmup-epochs", "2", "--lr-warmup-method",
           "linear", "--checkpoint-every", "6", "--keep-checkpoints", "10", "--model-ema", "--model-ema-steps", "1"]
    through = tmp_path / "through"
    through.mkdir()
    train_ok([*run, *dirs_args(through)], through, forked=True)
    copy = mid_epoch_copy(through, tmp_path, 6, SCHEDULE_STEPS_PER_EPOCH)  # epoch 1, the warm-up's second
    train_ok([*run, "--resume", str(copy), *dirs_args(tmp_path)], tmp_path, forked=True)
    assert read_summary(tmp_path / "runs")["resumed_from_step"] == 6
    resumed, uninterrupted = newest(tmp_path / "checkpoints"), newest(through / "checkpoints")
    for name in ("model", "optimizer", "scheduler", "model_ema"):
        assert_identical(resumed[name], uninterrupted[name], name)
    assert int(uninterrupted["model_ema"]["n_averaged"]) == (6 - 2) * SCHEDULE_STEPS_PER_EPOCH
    expected = references_lr_by_epoch(6, 0.05, "cosineannealinglr", 2, "linear")
    logged = logged_rates(tmp_path / "runs")
    assert min(logged) == 7, logged
    for step, rate in logged.items():
        assert rate == pytest.approx(expected[step // SCHEDULE_STEPS_PER_EPOCH], rel=1e-12, abs=0), (step, logged)


# ------------------------------------------------------------------------------- bad input

USER_DATA = '''
import torch
from torch.utils.data import TensorDataset


def soft_targets(cfg):
    x = torch.randn(64, 3, 8, 8)
    return TensorDataset(x, torch.rand(64, 4)), None, {"channels": 3, "image_size": 8, "num_classes": 4}
'''

# (arguments, the setting the line names, words it says)
RECIPE_BAD_INPUT = {
    "clip 0": (["--clip-grad-norm", "0"], "--clip-grad-norm", "scale every gradient to zero"),
    "clip negative": (["--clip-grad-norm", "-1"], "--clip-grad-norm", "is below 0"),
    "clip nan": (["--clip-grad-norm", "nan"], "--clip-grad-norm", "not a finite number"),
    "label smoothing 1": (["--label-smoothing", "1"], "--label-smoothing", "is not below 1"),
    "label smoothing negative": (["--label-smoothing", "-0.1"], "--label-smoothing", "is below 0"),
    "negative mixup": (["--mixup-alpha", "-0.2"], "--mixup-alpha", "is below 0"),
    "negative cutmix": (["--cutmix-alpha", "-1"], "--cutmix-alpha", "is below 0"),
    "mixup, targets not class indices": (["--mixup-alpha", "0.2", "--dataset", "recipedata:soft_targets"],
                                         "--mixup-alpha", "targets are torch.float32 of shape (4,)"),
    "unknown auto-augment": (["--auto-augment", "ta-wide"], "--auto-augment", "did you mean ta_wide?"),
    "ema decay 1": (["--model-ema", "--model-ema-decay", "1"], "--model-ema-decay", "is not between 0 and 1"),
    "ema decay 0": (["--model-ema-decay", "0"], "--model-ema-decay", "is not between 0 and 1"),
    "ra reps 0": (["--ra-sampler", "--ra-reps", "0"], "--ra-reps", "is below 1"),
    "random erase above 1": (["--random-erase", "1.5"], "--random-erase", "is above 1"),
    "crop larger than the images": (["--dataset", "synthetic", "--train-crop-size", "40"], "--train-crop-size",
                                    "larger than the 32x32 images of synthetic"),
    "unknown lr scheduler": (["--lr-scheduler", "cosine"], "--lr-scheduler", "did you mean cosineannealinglr?"),
    "per-epoch and per-step schedules mixed": (["--lr-scheduler", "steplr", "--lr-schedule", "step"],
                                               "--lr-schedule", "--lr-scheduler selects torchvision's reference"),
    "reference warm-up and per-step warm-up mixed": (["--lr-warmup-epochs", "2", "--warmup-steps", "5"],
                                                     "--warmup-steps", "--lr-warmup-epochs selects torchvision's"),
    "unknown warm-up method": (["--lr-warmup-method", "cosine"], "--lr-warmup-method", "choose one of linear, constant"),
    "warm-up decay above 1": (["--lr-warmup-decay", "1.5"], "--lr-warmup-decay", "is above 1"),
    "linear warm-up from 0": (["--lr-warmup-epochs", "1", "--lr-warmup-method", "linear", "--lr-warmup-decay", "0"],
                              "--lr-warmup-decay", "start from nothing"),
    "lr gamma 0": (["--lr-gamma", "0"], "--lr-gamma", "is not above 0"),
    "lr step size 0": (["--lr-step-size", "0"], "--lr-step-size", "is below 1"),
    "negative lr min": (["--lr-scheduler", "cosineannealinglr", "--lr-min", "-0.1"], "--lr-min", "is below 0"),
    "a cosine left no epoch": (["--lr-scheduler", "cosineannealinglr", "--lr-warmup-epochs", "5", "--epochs", "5"],
                               "--lr-warmup-epochs", "leave the cosine none"),
}


@pytest.mark.parametrize("args, setting, words", RECIPE_BAD_INPUT.values(), ids=RECIPE_BAD_INPUT.keys())
def test_recipe_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, setting, words):
    (tmp_path / "recipedata.py").write_text(USER_DATA)
    result = run_trainer_forked(["--model", "cnn", "--synthetic-size", "64", "--batch-size", "16", *args,
                                 *dirs_args(tmp_path)], tmp_path, timeout=BAD_INPUT_TIMEOUT_S)
    assert words in assert_usage_error(result, setting)
    assert {p for p in files_under(tmp_path) if "__pycache__" not in p.parts} == {Path("recipedata.py")}
