"""Users' own models and data: torchvision models by name, `module:function` model and dataset factories,
image folders of any size, and the examples that use them, through the built-in loop.

User code lives in a module the test writes into the run's working directory (where `python -m trainer`
and torchrun's workers import from, as a user's would)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    REPO,
    assert_same_params,
    assert_usage_error,
    checkpoint_steps,
    clean_env,
    dirs_args,
    final_params,
    free_port,
    load_checkpoint,
    read_summary,
    run_trainer,
    run_trainer_forked,
    train_ok,
    write_image_folder,
)

from trainer.config.catalog import DataSpec, torchvision_models
from trainer.core.errors import UsageError
from trainer.engine.models import build_model

MNIST_T10K = REPO.parent / "shared" / "data" / "mnist-t10k"
EXAMPLES = REPO / "examples"

# A model factory and a dataset factory as a user writes them. The dataset's transform is random
# (noise from torch's RNG), the DataLoader runs it in worker processes: resume is exact only if the
# trainer seeds it per sample.
USER_MODULE = '''
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset


class Noisy(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(self.x[i].shape), self.y[i]


def tensors(n, seed, shape=(2, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    return x, (x.mean(dim=tuple(range(1, x.ndim))) > 0).long()


def data(cfg):
    return Noisy(*tensors(320, cfg.seed)), Noisy(*tensors(64, cfg.seed + 1)), {"channels": 2, "image_size": 8,
                                                                               "num_classes": 2}


def model(spec):
    return nn.Sequential(nn.Conv2d(spec.channels, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * spec.image_size ** 2, spec.num_classes))


class Reconstruct(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(128, 16), nn.ReLU(), nn.Linear(16, 128))

    def forward(self, x):
        return self.net(x).view_as(x)

    def compute_loss(self, output, inputs, targets):
        return (output - inputs).pow(2).mean()   # a scalar: the trainer spreads it over the samples


def not_a_model(spec):
    return "resnet"


def frozen(spec):
    return nn.Linear(128, 2).requires_grad_(False)


def broken(spec):
    return helper_that_fails(spec)


def helper_that_fails(spec):
    raise ZeroDivisionError("the user's bug")


def wrong_shape(cfg):
    return TensorDataset(*tensors(64, 0, (3, 8, 8))), None, DataSpec(channels=2, image_size=8, num_classes=2)


def labels_out_of_range(cfg):
    x, y = tensors(64, 0)
    return TensorDataset(x, y + 5), None, {"channels": 2, "image_size": 8, "num_classes": 2}


def streaming(cfg):
    class Stream(IterableDataset):
        def __iter__(self):
            yield from zip(*tensors(64, 0))
    return Stream(), None, {"num_classes": 2}


def two_things(cfg):
    return TensorDataset(*tensors(64, 0)), None


def bad_spec_keys(cfg):
    return TensorDataset(*tensors(64, 0)), None, {"classes": 2}


not_callable = 42
from trainer import DataSpec
'''

USER_RUN = ["--model", "usercode:model", "--dataset", "usercode:data", "--batch-size", "8", "--epochs", "2",
            "--lr", "0.05", "--warmup-steps", "4", "--checkpoint-every", "7", "--keep-checkpoints", "20",
            "--log-every", "5", "--num-workers", "2"]
USER_STEPS = 2 * (320 // (2 * 8))  # two epochs at 2 processes x 8 samples


def with_user_module(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "usercode.py").write_text(USER_MODULE)
    return folder


# ------------------------------------------------------------------------------------ the catalogue

def test_list_models_shows_builtins_and_every_torchvision_classifier(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trainer", "--list-models"], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listed = set(done.stdout.split())
    expected = {"cnn", "autoencoder", "cifar_resnet18", "imagefolder", "synthetic", *torchvision_models()}
    assert expected <= listed, sorted(expected - listed)
    assert {"vit_b_16", "efficientnet_b0", "convnext_tiny", "mobilenet_v3_small", "regnet_y_400mf"} <= listed


def test_every_built_in_model_of_the_catalogue_has_a_builder_and_says_its_task():
    from trainer.config.catalog import MODELS
    from trainer.engine.models import BUILT_IN, Objective

    assert set(BUILT_IN) == set(MODELS)
    for name, entry in MODELS.items():
        model = build_model(name, DataSpec(channels=1, image_size=28, num_classes=10))
        output = model(torch.zeros(2, 1, 28, 28))
        assert Objective.classifies(output, torch.zeros(2, dtype=torch.long)) != entry.reconstructs, name


# One of each torchvision family: the classifier must be sized to the data and the first convolution
# must read its channels (here 1, as MNIST's). Built on the meta device (no memory) where they can be.
FAMILIES = ["alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet",
            "inception_v3", "maxvit_t", "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small", "regnet_y_400mf",
            "resnext50_32x4d", "shufflenet_v2_x0_5", "squeezenet1_1", "swin_t", "swin_v2_t", "vgg11_bn",
            "vit_b_16", "wide_resnet50_2", "resnet34"]


@pytest.mark.parametrize("name", FAMILIES)
def test_torchvision_models_are_sized_to_the_data(name):
    assert name in torchvision_models()
    device = "cpu" if name.startswith("regnet") else "meta"  # RegNets cannot be built on meta
    with torch.device(device):
        model = build_model(name, DataSpec(channels=1, image_size=224, num_classes=7))
        model.train()
        assert tuple(model(torch.zeros(2, 1, 224, 224)).shape) == (2, 7)


@pytest.mark.parametrize("name", ["alexnet", "inception_v3", "maxvit_t"])
def test_torchvision_model_too_big_for_small_images_is_one_line(name):
    with pytest.raises(UsageError) as caught:
        build_model(name, DataSpec(channels=3, image_size=32, num_classes=10))
    setting, problem, fix = caught.value.parts
    assert setting == "--model" and f"{name} cannot take 3x32x32 inputs" in problem and "--image-size" in fix


@pytest.mark.slow
def test_torchvision_model_by_name_trains_on_two_ranks(tmp_path):
    train_ok(["--model", "mobilenet_v3_small", "--synthetic-size", "128", "--batch-size", "16", "--epochs", "1",
              "--num-workers", "0", *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    summary = read_summary(tmp_path / "runs")
    assert (summary["status"], summary["model"], summary["global_step"]) == ("completed", "mobilenet_v3_small", 4)
    assert summary["val_acc1"] is not None
    state = load_checkpoint(next((tmp_path / "checkpoints").glob("step-*.pt")))
    assert state["config"]["model"] == "mobilenet_v3_small"
    # The plain torchvision model, as users load it for inference, takes the weights as they are.
    import torchvision

    torchvision.models.get_model("mobilenet_v3_small", num_classes=10).load_state_dict(state["model"])


# ------------------------------------------------------------------------------- the factory doors

@pytest.fixture(scope="module")
def uninterrupted_user_run(tmp_path_factory):
    root = with_user_module(tmp_path_factory.mktemp("user-uninterrupted"))
    train_ok([*USER_RUN, *dirs_args(root)], root, nproc=2, forked=True)
    summary = read_summary(root / "runs")
    assert (summary["status"], summary["global_step"]) == ("completed", USER_STEPS)
    return root


@pytest.mark.slow
def test_user_model_and_dataset_learn_and_resume_exactly(uninterrupted_user_run, tmp_path):
    summary = read_summary(uninterrupted_user_run / "runs")
    assert summary["val_acc1"] > 0.8, summary  # the task (sign of the mean) is learnable
    assert summary["model"] == "usercode:model" and summary["dataset"] == "usercode:data"
    step = 7  # mid-epoch 0 (20 steps per epoch)
    saved = load_checkpoint(uninterrupted_user_run / "checkpoints" / f"step-{step:08d}.pt")
    assert (saved["epoch"], saved["batch"], saved["config"]["model"]) == (0, 7, "usercode:model")
    root = with_user_module(tmp_path / "resumed")
    (root / "from").mkdir()
    shutil.copy(uninterrupted_user_run / "checkpoints" / f"step-{step:08d}.pt", root / "from")
    train_ok([*USER_RUN, "--resume", str(root / "from" / f"step-{step:08d}.pt"), *dirs_args(root)], root, nproc=2, forked=True)
    resumed = read_summary(root / "runs")
    assert (resumed["resumed_from_step"], resumed["global_step"]) == (step, USER_STEPS)
    assert_same_params(final_params(root / "checkpoints"), final_params(uninterrupted_user_run / "checkpoints"))


@pytest.mark.slow
def test_sigterm_with_dataloader_workers_checkpoints_and_resumes_exactly(uninterrupted_user_run, tmp_path):
    """docker stop / a pre-empted node while DataLoader workers run (the default for users' datasets):
    torchrun signals each worker's process group, the DataLoader workers too; the stop still checkpoints."""
    root = with_user_module(tmp_path)
    launcher = Path(sys.executable).with_name("trainer-launch")
    command = [str(launcher), *USER_RUN, *dirs_args(root)]
    env = clean_env({"MASTER_PORT": str(free_port())})
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not checkpoint_steps(root / "checkpoints") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    assert "DataLoader worker" not in stderr, stderr[-3000:]
    stopped = read_summary(root / "runs")
    assert stopped["status"] == "stopped", stderr[-3000:]
    assert 7 <= stopped["global_step"] < USER_STEPS
    assert max(checkpoint_steps(root / "checkpoints")) == stopped["global_step"]  # the stop committed its step
    assert stderr.count("received SIGTERM") <= 2, stderr[-3000:]  # the two ranks, not their workers

    train_ok([*USER_RUN, *dirs_args(root)], root, nproc=2, forked=True)
    resumed = read_summary(root / "runs")
    assert (resumed["resumed_from_step"], resumed["global_step"]) == (stopped["global_step"], USER_STEPS)
    assert_same_params(final_params(root / "checkpoints"), final_params(uninterrupted_user_run / "checkpoints"))


def test_checkpoint_of_a_user_model_is_refused_for_another_model(uninterrupted_user_run, tmp_path):
    with_user_module(tmp_path)
    checkpoint = uninterrupted_user_run / "checkpoints" / "step-00000007.pt"
    result = run_trainer_forked([*USER_RUN, "--model", "cnn", "--resume", str(checkpoint), *dirs_args(tmp_path)], tmp_path)
    line = assert_usage_error(result, "--resume")
    assert "usercode:model" in line and "cnn" in line


@pytest.mark.slow
def test_model_with_its_own_scalar_loss_trains_without_classes(tmp_path):
    with_user_module(tmp_path)
    train_ok(["--model", "usercode:Reconstruct", "--dataset", "usercode:data", "--batch-size", "16", "--epochs", "3",
              "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0", "--warmup-steps", "2", "--num-workers",
              "0", *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    summary = read_summary(tmp_path / "runs")
    assert summary["val_acc1"] is None  # outputs are no class logits: no accuracy
    assert summary["val_loss"] < 1.0, summary  # the inputs' variance, what predicting zeros would cost


@pytest.mark.parametrize("setting, value, words", [
    ("--model", "nosuchmodule:build", "cannot import 'nosuchmodule'"),
    ("--model", "usercode:modle", "did you mean usercode:model"),
    ("--model", "usercode:not_callable", "not a callable"),
    ("--model", "resnet181", "did you mean resnet18"),
    ("--model", "a:b:c", "neither a known model nor module:callable"),
    ("--dataset", "usercode:nothing", "has no attribute 'nothing'"),
    ("--dataset", "cifar100", "neither a known dataset"),
])
def test_names_that_do_not_resolve_fail_before_anything_starts(tmp_path, setting, value, words):
    with_user_module(tmp_path)
    other = {"--model": ["--dataset", "usercode:data"], "--dataset": ["--model", "cnn"]}[setting]
    result = run_trainer_forked([setting, value, *other, *dirs_args(tmp_path)], tmp_path)
    assert words in assert_usage_error(result, setting)
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("setting, value, words", [
    ("--model", "usercode:not_a_model", "returned str, not a torch.nn.Module"),
    ("--model", "usercode:frozen", "without trainable parameters"),
    ("--dataset", "usercode:wrong_shape", "have shape (3, 8, 8) but its spec describes (2, 8, 8)"),
    ("--dataset", "usercode:labels_out_of_range", "outside the 2 classes"),
    ("--dataset", "usercode:streaming", "IterableDataset"),
    ("--dataset", "usercode:two_things", "not (train, val, spec)"),
    ("--dataset", "usercode:bad_spec_keys", "unknown keys classes"),
])
def test_factories_that_return_the_wrong_thing_fail_in_one_line_on_every_rank(tmp_path, setting, value, words):
    """Two ranks, each building the model and the data: one line (and the launcher's naming the rank), exit 2,
    no hang, nothing written."""
    with_user_module(tmp_path)
    other = {"--model": ["--dataset", "usercode:data"], "--dataset": ["--model", "usercode:model"]}[setting]
    result = run_launcher([setting, value, *other, "--num-workers", "0", *dirs_args(tmp_path)], tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"error: {setting}")]
    assert len(errors) == 1 and words in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "runs").exists()


def test_a_factory_that_raises_shows_the_users_traceback_then_one_line(tmp_path):
    with_user_module(tmp_path)
    result = run_trainer(["--model", "usercode:broken", "--dataset", "usercode:data", "--num-workers", "0",
                          *dirs_args(tmp_path)], tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert 'usercode.py", line' in result.stderr and "helper_that_fails" in result.stderr
    assert "trainer/" not in result.stderr.replace(str(tmp_path), "")  # the user's frames, not ours
    assert lines[-1] == ("error: --model: usercode:broken raised ZeroDivisionError when called: the user's bug "
                         "(fix the code; its traceback is above)")
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------- image folders of any size

@pytest.mark.slow
@pytest.mark.parametrize("augment", ["light", "none", "imagenet"])
def test_image_folder_trains_at_the_size_asked(tmp_path, augment):
    write_image_folder(tmp_path / "data", per_class={"train": 8, "val": 2})
    train_ok(["--model", "cnn", "--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"), "--image-size",
              "32", "--augment", augment, "--batch-size", "4", "--epochs", "1", "--num-workers", "1",
              *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    summary = read_summary(tmp_path / "runs")
    assert summary["status"] == "completed" and summary["global_step"] == 2


def test_image_folder_augmentation_policies(tmp_path):
    """light: padded random crops and flips that change with the epoch; none: the same image every epoch;
    both at the size asked, whatever the files' sizes, and the same for the same (epoch, index)."""
    from trainer.data.images import ImageFolderWithKeys

    write_image_folder(tmp_path / "data", per_class={"train": 6})
    light = ImageFolderWithKeys(tmp_path / "data" / "train", True, 24, "light", seed=0)
    plain = ImageFolderWithKeys(tmp_path / "data" / "train", True, 24, "none", seed=0)
    for index in range(len(light)):
        image = light[(index, 0)][0]
        assert image.shape == (3, 24, 24) and image.dtype == torch.uint8
        assert torch.equal(image, light[(index, 0)][0])  # a function of (seed, epoch, index)
        assert torch.equal(plain[(index, 0)][0], plain[(index, 3)][0])
    assert any(not torch.equal(light[(i, 0)][0], light[(i, 1)][0]) for i in range(len(light)))


def test_augment_auto_is_light_for_small_images_and_imagenet_for_large():
    from torchvision import transforms

    from trainer.data.images import image_transforms

    small = [type(t) for t in image_transforms(True, 32, "auto").transforms]
    large = [type(t) for t in image_transforms(True, 224, "auto").transforms]
    assert transforms.RandomCrop in small and transforms.RandomResizedCrop not in small
    assert transforms.RandomResizedCrop in large


# ------------------------------------------------------------------------------------------ examples

def run_launcher(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`trainer-launch ARGS` as a user types it in `cwd` (2 CPU processes, preflight on)."""
    launcher = Path(sys.executable).with_name("trainer-launch")
    return subprocess.run([str(launcher), *args], cwd=cwd, env=clean_env({"MASTER_PORT": str(free_port())}),
                          capture_output=True, text=True, timeout=timeout)


def example_run(example: str, out: Path, args: list[str]) -> subprocess.CompletedProcess:
    """An example as its docstring shows it: trainer-launch run from the example's folder."""
    done = run_launcher([*args, *dirs_args(out)], EXAMPLES / example)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.slow
def test_example_mnist_autoencoder_reconstructs_real_digits(tmp_path):
    example_run("mnist_autoencoder", tmp_path, [
        "--model", "mnist_ae:build_model", "--dataset", "mnist_ae:build_data", "--data-dir", str(MNIST_T10K),
        "--optimizer", "adamw", "--lr", "2e-3", "--weight-decay", "0", "--epochs", "1", "--batch-size", "128",
        "--warmup-steps", "5"])
    summary = read_summary(tmp_path / "runs")
    assert summary["status"] == "completed" and summary["world_size"] == 2
    # Predicting the mean image costs about 1 (normalised pixels); a code of 32 numbers does far better.
    assert summary["val_loss"] < 0.75 and summary["val_acc1"] is None, summary


@pytest.mark.slow
def test_example_char_lm_is_not_an_image_model(tmp_path):
    sys.path.insert(0, str(EXAMPLES / "char_lm"))
    try:
        import char_lm

        char_lm.write_text(tmp_path / "data", sentences=1500)
    finally:
        sys.path.remove(str(EXAMPLES / "char_lm"))
    example_run("char_lm", tmp_path, [
        "--model", "char_lm:build_model", "--dataset", "char_lm:build_data", "--data-dir", str(tmp_path / "data"),
        "--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.01", "--epochs", "2", "--batch-size", "32",
        "--warmup-steps", "5"])
    summary = read_summary(tmp_path / "runs")
    # Uniform guessing over the ~30 characters costs ln(30) = 3.4 nats and is right 1 time in 30.
    assert summary["train_loss"] < 2.0 and summary["val_acc1"] > 0.4, json.dumps(summary)


def test_a_scripts_checkpoint_is_refused_by_the_built_in_trainer(tmp_path):
    """trainer.api writes step-N.pt files too; the built-in trainer pointed at one holding less than it resumes
    says what is missing."""
    script = textwrap.dedent("""
        import torch
        from trainer import api
        with api.Run(checkpoint_dir="checkpoints", log_dir="runs") as run:
            model = torch.nn.Linear(2, 2)
            run.resume(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
            run.save()
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and list((tmp_path / "checkpoints").glob("step-*.pt")), done.stderr
    result = run_trainer_forked(["--model", "cnn", "--synthetic-size", "64", "--batch-size", "8", "--max-steps", "1",
                                 *dirs_args(tmp_path)], tmp_path)
    assert "this run resumes model, optimizer, scheduler, scaler (scheduler, scaler missing)" in \
        assert_usage_error(result, "--resume")
