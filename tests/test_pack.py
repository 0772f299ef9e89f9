"""trainer-pack and --dataset packed: a pack is written atomically and continues after an interruption,
trains at any world size with exact resume, and a damaged pack is one line naming the file before
training starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import (
    assert_usage_error,
    clean_env,
    dirs_args,
    read_summary,
    run_trainer_forked,
    train_ok,
    write_jpeg_folder,
)

from trainer.cluster.topology import WORKER, resolve
from trainer.config.settings import load_config
from trainer.data import pack
from trainer.data.datasets import Batches, build_datasets
from trainer.parallel.context import DistContext

CPU = torch.device("cpu")


def trainer_pack(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.data.pack", *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=300)


def context(rank: int = 0, world_size: int = 1) -> DistContext:
    """Rank facts without a process group (as tests/test_data.py makes them)."""
    ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
             "LOCAL_WORLD_SIZE": str(world_size)} if world_size > 1 else {}
    return DistContext(resolve(ranks, WORKER), "none", CPU)


@pytest.fixture
def packed(tmp_path):
    write_jpeg_folder(tmp_path / "folder", classes=("cat", "dog", "eel"), per_class={"train": 6, "val": 2},
                      size=(120, 90))
    done = trainer_pack(str(tmp_path / "folder"), str(tmp_path / "pack"), "--max-side", "64", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "packed train: 18 images, val: 6 images" in done.stdout
    return tmp_path / "pack"


def test_a_pack_holds_every_image_shrunk_with_its_label(packed):
    header = json.loads((packed / "pack.json").read_text())
    assert header["version"] == pack.PACK_VERSION and header["classes"] == ["cat", "dog", "eel"]
    assert sorted(p.name for p in packed.iterdir()) == ["pack.json", "train.index", "train.pixels", "val.index",
                                                        "val.pixels"]
    index = np.fromfile(packed / "train.index", dtype="<i8").reshape(-1, 4)
    assert index[:, 3].tolist() == [0] * 6 + [1] * 6 + [2] * 6  # ImageFolder's order and labels
    # 120, 128 and 136 x 90 pixels, the longer side shrunk to 64
    assert set(index[:, 2].tolist()) == {64} and set(index[:, 1].tolist()) == {48, 45, 42}
    assert (packed / "train.pixels").stat().st_size == int((index[:, 1] * index[:, 2] * 3).sum())


def test_packed_views_are_the_same_at_any_world_size_and_resume_exactly(packed, tmp_path):
    common = ["--env-file", os.devnull, "--dataset", "packed", "--data-dir", str(packed), "--image-size", "32",
              "--num-workers", "0"]
    cfg1 = load_config([*common, "--batch-size", "6"], {}, 1)
    cfg2 = load_config([*common, "--global-batch-size", "6"], {}, 2)
    train, val, spec = build_datasets(cfg1, context())
    assert spec.num_classes == 3 and len(train) == 18 and len(val) == 6
    single = list(Batches(train, spec, cfg1, context(), True).epoch(2))
    ranks = [list(Batches(train, spec, cfg2, context(rank, 2), True).epoch(2)) for rank in (0, 1)]
    assert len(single) == 3 and single[0][0].shape == (6, 3, 32, 32)
    for step, (x, y) in enumerate(single):
        for rank in (0, 1):
            assert torch.equal(ranks[rank][step][0], x[rank::2]) and torch.equal(ranks[rank][step][1], y[rank::2])
    resumed = list(Batches(train, spec, cfg1, context(), True).epoch(2, start_batch=1))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(resumed, single[1:])) and len(resumed) == 2
    assert not torch.equal(list(Batches(train, spec, cfg1, context(), True).epoch(3))[0][0], single[0][0])


@pytest.mark.slow
def test_trainer_trains_from_a_pack_on_two_processes(packed, tmp_path):
    train_ok(["--model", "cnn", "--dataset", "packed", "--data-dir", str(packed), "--image-size", "32",
              "--batch-size", "3", "--epochs", "1", *dirs_args(tmp_path / "run")], tmp_path, nproc=2)
    summary = read_summary(tmp_path / "run" / "runs")
    assert (summary["dataset"], summary["global_step"], summary["world_size"]) == ("packed", 3, 2)
    assert 0 <= summary["val_acc1"] <= 1


def test_an_interrupted_pack_continues_to_the_same_files(packed, tmp_path):
    """A bad file beyond --max-bad-files stops the pack (one line naming it); once it is replaced, the same command
    continues from the images already packed, also after a crash left half an image in the partial file, and the
    pack is byte for byte the one made in one go."""
    folder = tmp_path / "folder"
    victim = folder / "train" / "eel" / "2.jpg"
    good = victim.read_bytes()
    victim.write_text("not an image\n")
    first = trainer_pack(str(folder), str(tmp_path / "again"), "--max-side", "64", "--no-progress",
                         "--max-bad-files", "0", cwd=tmp_path)
    assert first.returncode == 2 and "Traceback" not in first.stderr, first.stderr
    line = first.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --max-bad-files: 1 file(s) of train/ do not decode, more than the 0 it allows; "
                           f"the last: {victim} (not an image PIL can decode)") and "run the same command" in line
    assert not (tmp_path / "again" / "pack.json").exists()
    partial = tmp_path / "again" / "train.pixels.partial"
    records = (tmp_path / "again" / "train.index.partial").stat().st_size // 32
    assert records >= 6  # cat's and dog's images are kept
    os.truncate(partial, partial.stat().st_size - 100)  # a crash in the middle of the last image's pixels
    victim.write_bytes(good)
    second = trainer_pack(str(folder), str(tmp_path / "again"), "--max-side", "64", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert f"{records - 1}/24" in second.stderr  # the progress bar starts after the whole images kept
    for name in ("train.pixels", "train.index", "val.pixels", "val.index"):
        assert (tmp_path / "again" / name).read_bytes() == (packed / name).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(p.name for p in packed.iterdir())


def test_a_file_that_does_not_decode_is_packed_as_a_placeholder_and_trained_on_as_one(packed, tmp_path):
    """Within --max-bad-files (default 0.1% of a split, at least 1), a file that does not decode is packed as a
    black placeholder with one warning and named in pack.json; training from the pack names it and counts it as an
    image folder does the file itself."""
    folder = tmp_path / "folder"
    victim = folder / "train" / "dog" / "4.jpg"
    victim.write_bytes(victim.read_bytes()[:200])
    done = trainer_pack(str(folder), str(tmp_path / "with-bad"), "--max-side", "64", "--no-progress", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stderr.splitlines() if "does not decode" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {victim} does not decode (") and \
        warned[0].endswith("packed as a black placeholder"), done.stderr
    assert "1 file(s) did not decode: black placeholders, named in pack.json" in done.stdout
    header = json.loads((tmp_path / "with-bad" / "pack.json").read_text())
    (index, (path, _)), = header["bad_files"]["train"].items()
    assert (int(index), path) == (10, str(victim))  # dog's fifth image in ImageFolder's order
    cfg = load_config(["--env-file", os.devnull, "--dataset", "packed", "--data-dir", str(tmp_path / "with-bad"),
                       "--image-size", "32", "--num-workers", "0", "--batch-size", "18"], {}, 1)
    train, _, spec = build_datasets(cfg, context())
    batches = Batches(train, spec, cfg, context(), True)
    (images, labels), = list(batches.epoch(0))
    at = list(batches.sampler).index(10)  # this epoch's order, as the loader got it
    black = (torch.zeros(1, 3, 32, 32) * batches.scale - batches.shift)[0]
    assert torch.equal(images[at], black) and labels[at] == 1
    assert list(batches.bad_files.named) == [str(victim)] and batches.bad_files.this_epoch == 1
    run = train_ok(["--model", "cnn", "--dataset", "packed", "--data-dir", str(tmp_path / "with-bad"), "--image-size",
                    "32", "--batch-size", "3", "--epochs", "2", *dirs_args(tmp_path / "run")], tmp_path)
    assert sum(f"{victim} does not decode" in line for line in run.stderr.splitlines()) == 1, run.stderr[-3000:]
    assert read_summary(tmp_path / "run" / "runs")["bad_files"] == 1


def test_packing_into_a_finished_pack_is_refused(packed, tmp_path):
    again = trainer_pack(str(tmp_path / "folder"), str(packed), cwd=tmp_path)
    assert "already holds a finished pack" in assert_usage_error(again, "DST")


def truncate_pixels(root):
    os.truncate(root / "train.pixels", (root / "train.pixels").stat().st_size - 10)
    return root / "train.pixels", "is truncated"


def another_version(root):
    header = json.loads((root / "pack.json").read_text())
    (root / "pack.json").write_text(json.dumps({**header, "version": 99}))
    return root / "pack.json", "version 99"


def index_off_its_data(root):
    index = np.fromfile(root / "val.index", dtype="<i8").reshape(-1, 4)
    index[2, 0] += 3  # an offset into the middle of another image; the sizes still agree
    index.tofile(root / "val.index")
    return root / "val.index", "does not match"


@pytest.mark.parametrize("damage", [truncate_pixels, another_version, index_off_its_data],
                         ids=["truncated", "another version", "index not matching its data"])
def test_a_damaged_pack_is_one_line_naming_the_file_before_training(packed, tmp_path, damage):
    path, problem = damage(packed)
    result = run_trainer_forked(["--model", "cnn", "--dataset", "packed", "--data-dir", str(packed), "--image-size", "32",
                                 "--batch-size", "3", *dirs_args(tmp_path / "run")], tmp_path)
    line = assert_usage_error(result, "--data-dir")
    assert str(path) in line and problem in line and "re-pack" in line, line
    assert not (tmp_path / "run").exists()  # before training: nothing written


def test_packed_without_a_pack_says_how_to_make_one(tmp_path):
    result = run_trainer_forked(["--dataset", "packed", "--data-dir", str(tmp_path)], tmp_path)
    assert "trainer-pack SRC" in assert_usage_error(result, "--data-dir")
