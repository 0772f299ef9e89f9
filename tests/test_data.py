"""Datasets from real files in their published formats, the two input paths, and augmentation keys."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
from helpers import (
    BAD_INPUT_TIMEOUT_S,
    assert_same_params,
    assert_usage_error,
    dirs_args,
    files_under,
    final_params,
    free_port,
    read_summary,
    run_trainer_forked,
    train_ok,
    write_cifar10,
    write_image_folder,
    write_mnist,
)

from trainer.cluster.topology import WORKER, resolve
from trainer.config.settings import load_config
from trainer.core.errors import UsageError
from trainer.data.datasets import DOWNLOAD_STALL_TIMEOUT_S, Batches, build_datasets, make_synthetic, random_crop_flip
from trainer.data.images import sample_keys
from trainer.parallel.context import DistContext

CPU = torch.device("cpu")


def context(rank: int = 0, world_size: int = 1) -> DistContext:
    """Rank facts without a process group: Batches only needs them to pick this rank's shard."""
    ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
             "LOCAL_WORLD_SIZE": str(world_size)} if world_size > 1 else {}
    return DistContext(resolve(ranks, WORKER), "none", CPU)


def config(tmp_path, *args: str, world_size: int = 1):
    return load_config(["--env-file", os.devnull, *args], {}, world_size)


def collect(batches: Batches, epoch: int, start_batch: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(batches.epoch(epoch, start_batch))


def assert_same_batches(a, b) -> None:
    assert len(a) == len(b) > 0
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ------------------------------------------------------------------------------------------ synthetic

def test_synthetic_is_deterministic_by_seed():
    train, val = make_synthetic(300, seed=3)
    again, _ = make_synthetic(300, seed=3)
    other, _ = make_synthetic(300, seed=4)
    assert train.images.shape == (300, 3, 32, 32) and train.images.dtype == torch.uint8
    assert len(val) == 60
    assert torch.equal(train.images, again.images) and torch.equal(train.labels, again.labels)
    assert not torch.equal(train.images, other.images)
    assert set(train.labels.tolist()) == set(range(10))


# ------------------------------------------------------------------------------ torchvision datasets

def test_cifar10_files_load_through_torchvision(tmp_path):
    images, labels = write_cifar10(tmp_path / "data")
    train, val, spec = build_datasets(config(tmp_path, "--dataset", "cifar10", "--data-dir", str(tmp_path / "data")),
                                      context())
    assert torch.equal(train.images, images) and torch.equal(train.labels, labels)
    assert len(val) == 10
    assert (spec.channels, spec.image_size, spec.num_classes) == (3, 32, 10)


def test_mnist_files_load_through_torchvision(tmp_path):
    images, labels = write_mnist(tmp_path / "data")
    train, val, spec = build_datasets(config(tmp_path, "--dataset", "mnist", "--data-dir", str(tmp_path / "data")),
                                      context())
    assert torch.equal(train.images, images.unsqueeze(1)) and torch.equal(train.labels, labels)
    assert len(val) == 12
    assert (spec.channels, spec.image_size, spec.num_classes) == (1, 28, 10)


@pytest.mark.slow
def test_two_process_run_on_cifar10_files(tmp_path):
    write_cifar10(tmp_path / "data", per_batch=8, test_size=10)
    before = files_under(tmp_path / "data")
    train_ok(["--model", "cnn", "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--batch-size", "4",
              "--epochs", "1", "--num-workers", "0", *dirs_args(tmp_path)], tmp_path, nproc=2)
    summary = read_summary(tmp_path / "runs")
    assert (summary["dataset"], summary["world_size"], summary["global_step"]) == ("cifar10", 2, 40 // 8)
    assert summary["val_acc1"] is not None
    assert files_under(tmp_path / "data") == before  # the files were trusted, nothing was downloaded


def unreachable_proxy(port: int) -> dict[str, str]:
    """Route the dataset download through a local port: no network, whatever the CI machine has."""
    proxy = f"http://127.0.0.1:{port}"
    return {"http_proxy": proxy, "https_proxy": proxy, "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy,
            "no_proxy": "", "NO_PROXY": ""}


def assert_missing_dataset_error(result) -> None:
    line = assert_usage_error(result, "--data-dir")
    assert "mount" in line and "--dataset synthetic" in line


@pytest.mark.parametrize("dataset", ["cifar10", "mnist"])
def test_missing_dataset_with_the_network_refused(tmp_path, dataset):
    result = run_trainer_forked(["--model", "cnn", "--dataset", dataset, "--data-dir", str(tmp_path / "data"),
                                 *dirs_args(tmp_path)], tmp_path, env=unreachable_proxy(free_port()),
                                timeout=BAD_INPUT_TIMEOUT_S)
    assert_missing_dataset_error(result)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "data").exists()  # torchvision made it for the download; nothing is left


@pytest.mark.slow
def test_missing_dataset_with_a_network_that_never_answers(tmp_path):
    """A firewall that swallows packets: the download must give up, not wait forever."""
    with socket.socket() as black_hole:  # accepts connections into its backlog, never replies
        black_hole.bind(("127.0.0.1", 0))
        black_hole.listen(16)
        started = time.monotonic()
        result = run_trainer_forked(["--model", "cnn", "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"),
                                     *dirs_args(tmp_path)], tmp_path, env=unreachable_proxy(black_hole.getsockname()[1]),
                                    timeout=DOWNLOAD_STALL_TIMEOUT_S + BAD_INPUT_TIMEOUT_S)
    assert_missing_dataset_error(result)
    assert time.monotonic() - started >= DOWNLOAD_STALL_TIMEOUT_S  # it did wait for the stalled download


# ------------------------------------------------------------------------------------- imagefolder

@pytest.mark.slow
def test_imagefolder_trains_through_the_dataloader_with_and_without_workers(tmp_path):
    write_image_folder(tmp_path / "data", per_class={"train": 4, "val": 2})
    runs = {}
    for workers in (0, 2):
        root = tmp_path / f"workers-{workers}"
        train_ok(["--model", "cnn", "--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"),
                  "--batch-size", "2", "--epochs", "1", "--num-workers", str(workers), *dirs_args(root)], tmp_path,
                 forked=True)
        runs[workers] = root
        summary = read_summary(root / "runs")
        assert (summary["dataset"], summary["global_step"], summary["epochs_completed"]) == ("imagefolder", 4, 1)
        assert 0 <= summary["val_acc1"] <= 1
        assert final_params(root / "checkpoints")["head.2.weight"].shape[0] == 2  # two classes
    # Random crops are seeded per sample, not per worker: the worker count cannot change the result.
    assert_same_params(final_params(runs[0] / "checkpoints"), final_params(runs[2] / "checkpoints"))


def test_imagefolder_val_classes_must_match_train(tmp_path):
    """Labels are class indices in sorted folder order: a val/ with other folders would be mislabelled."""
    write_image_folder(tmp_path / "data", per_class={"train": 1})
    write_image_folder(tmp_path / "data", classes=("cat", "cow"), per_class={"val": 1})
    cfg = config(tmp_path, "--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"))
    with pytest.raises(UsageError, match=r"different class folders \(cow, dog in only one of them\)"):
        build_datasets(cfg, context())


@pytest.mark.parametrize("workers", [0, 1])
def test_imagefolder_with_a_file_that_is_no_image(tmp_path, workers):
    """A stray file that is no image is skipped with one warning naming it, with or without loader workers."""
    write_image_folder(tmp_path / "data", per_class={"train": 4, "val": 1})
    broken = tmp_path / "data" / "train" / "dog" / "2.png"
    broken.write_text("not an image\n")
    result = run_trainer_forked(["--model", "cnn", "--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"),
                                 "--batch-size", "2", "--num-workers", str(workers), *dirs_args(tmp_path)], tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    # The start line says the policy --augment auto took for the default 224 px crops.
    assert "; augment imagenet (auto: 224 px crops): RandomResizedCrop + flip, as torchvision's reference crops\n" \
        in result.stderr, result.stderr[-3000:]
    warned = [line for line in result.stderr.splitlines() if "does not decode" in line]
    assert len(warned) == 1 and f"{broken} does not decode (not an image PIL can decode)" in warned[0], warned
    assert read_summary(tmp_path / "runs")["bad_files"] == 1


def test_the_image_extensions_the_option_check_knows_are_imagefolders():
    """The option check finds an empty class folder before torchvision is imported, with its own copy of the
    extensions ImageFolder takes."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    from trainer.config.catalog import IMAGE_EXTENSIONS

    assert IMAGE_EXTENSIONS == IMG_EXTENSIONS


def test_imagefolder_augmentation_leaves_the_global_rng_alone(tmp_path):
    """With --num-workers 0 the dataset runs in the training process, whose RNG the checkpoint saves."""
    write_image_folder(tmp_path / "data", per_class={"train": 2, "val": 1})
    train, _, _ = build_datasets(config(tmp_path, "--dataset", "imagefolder", "--data-dir",
                                        str(tmp_path / "data")), context())
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = train[(0, 0)][0]
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(train[(0, 0)][0], first)  # and the sample is still a function of its key


# ---------------------------------------------------------------------------------- input paths

@pytest.mark.parametrize("train", [True, False], ids=["train", "val"])
def test_memory_and_dataloader_paths_give_the_same_batches(tmp_path, train):
    common = ("--synthetic-size", "160", "--seed", "1", "--batch-size", "16", "--num-workers", "0")
    train_data, val_data, spec = build_datasets(config(tmp_path, *common), context())
    outputs = [collect(Batches(train_data if train else val_data, spec, config(tmp_path, *common, "--loader", loader),
                               context(), train=train), epoch=2)
               for loader in ("memory", "dataloader")]
    assert_same_batches(*outputs)


@pytest.mark.parametrize("loader", ["memory", "dataloader"])
def test_a_resumed_epoch_continues_with_the_next_batch(tmp_path, loader):
    cfg = config(tmp_path, "--synthetic-size", "160", "--batch-size", "16", "--loader", loader, "--num-workers", "0")
    train_data, _, spec = build_datasets(cfg, context())
    batches = Batches(train_data, spec, cfg, context(), train=True)
    whole = collect(batches, epoch=1)
    assert len(whole) == 10
    assert_same_batches(collect(batches, epoch=1, start_batch=3), whole[3:])
    assert not torch.equal(collect(batches, epoch=2)[0][1], whole[0][1])  # a new order every epoch


def test_augmentation_depends_on_the_sample_not_on_rank_or_batch(tmp_path):
    """World 1 x batch 8 and world 2 x batch 4 see the same augmented samples: rank r holds every
    other sample of the single process's batch (DistributedSampler's interleaving)."""
    cfg1 = config(tmp_path, "--synthetic-size", "160", "--batch-size", "8")
    cfg2 = config(tmp_path, "--synthetic-size", "160", "--global-batch-size", "8", world_size=2)
    train_data, _, spec = build_datasets(cfg1, context())
    single = collect(Batches(train_data, spec, cfg1, context(), train=True), epoch=3)
    ranks = [collect(Batches(train_data, spec, cfg2, context(rank, 2), train=True), epoch=3) for rank in (0, 1)]
    assert len(single) == len(ranks[0]) == len(ranks[1]) == 20
    for step, (x, y) in enumerate(single):
        for rank in (0, 1):
            assert torch.equal(ranks[rank][step][0], x[rank::2]) and torch.equal(ranks[rank][step][1], y[rank::2])


def test_augmentation_keys_are_a_function_of_seed_epoch_and_index():
    index = torch.arange(1000)
    keys = sample_keys(index, epoch=0, seed=0)
    assert torch.equal(keys, sample_keys(index.clone(), epoch=0, seed=0))
    for other in (sample_keys(index, epoch=1, seed=0), sample_keys(index, epoch=0, seed=1)):
        assert (keys != other).float().mean() > 0.99
    assert len(set(keys.tolist())) > 990  # well mixed, not a handful of values


def test_crop_and_flip_of_a_batch_is_per_sample():
    x = torch.randn(6, 3, 32, 32)
    keys = sample_keys(torch.arange(6), epoch=0, seed=5)
    together = random_crop_flip(x, keys)
    one_by_one = torch.cat([random_crop_flip(x[i:i + 1], keys[i:i + 1]) for i in range(6)])
    assert torch.equal(together, one_by_one)
    assert together.shape == x.shape
    # Different keys give different views of the same image.
    views = random_crop_flip(x[:1].expand(50, -1, -1, -1), sample_keys(torch.arange(50), epoch=0, seed=0))
    assert len({tuple(v.flatten().tolist()) for v in views}) > 10


def test_synthetic_images_can_be_imagenet_shaped(tmp_path):
    train, val, spec = build_datasets(config(tmp_path, "--synthetic-size", "20", "--batch-size", "4",
                                             "--synthetic-image-size", "224"),
                                      context())
    assert train.images.shape == (20, 3, 224, 224) and len(val) == 4
    assert spec.image_size == 224
    # Still learnable: a class's images are closer to their own class mean than to another's.
    means = torch.stack([train.images[train.labels == c].float().mean(0) for c in train.labels.unique()[:2]])
    assert (means[0] - means[1]).abs().mean() > 5
