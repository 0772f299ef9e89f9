"""Users' code in the containers, as the README shows it: factories and a training script in SRC_DIR
(mounted read-only at /workspace/src, on PYTHONPATH), named by TRAIN_MODEL / TRAIN_DATASET / TRAIN_SCRIPT,
run by `docker compose --profile cpu up`."""

from __future__ import annotations

import textwrap
from pathlib import Path

MYMODELS = """
from torch import nn


def build(spec):
    return nn.Sequential(nn.Flatten(), nn.Linear(spec.channels * spec.image_size ** 2, 32), nn.ReLU(),
                         nn.Linear(32, spec.num_classes))
"""

MYDATA = """
import torch
from torch.utils.data import TensorDataset


def build(cfg):
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(1280, 1, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long()
    spec = {"channels": 1, "image_size": 8, "num_classes": 2}
    return TensorDataset(x[:1024], y[:1024]), TensorDataset(x[1024:], y[1024:]), spec
"""

TRAIN = """
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer import api

with api.Run(checkpoint_dir=os.environ["TRAIN_CHECKPOINT_DIR"], log_dir=os.environ["TRAIN_LOG_DIR"]) as run:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 2, (512,)))
    model = torch.nn.Linear(16, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=32, sampler=run.sampler(data, batch_size=32), drop_last=True)
    run.resume(model=model, optimizer=optimizer)
    ddp = run.wrap(model)
    for epoch in run.epochs(2):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if run.step(**{"Loss/train": loss.detach()}):
                break
    if run.is_main:
        print(f"my script: {run.step_count} steps on {run.world_size} processes")
"""


def source_dir(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name, text in (("mymodels.py", MYMODELS), ("mydata.py", MYDATA), ("train.py", TRAIN)):
        (src / name).write_text(textwrap.dedent(text))
        (src / name).chmod(0o644)
    src.chmod(0o755)  # the image's user (uid 1000) reads it
    return src


def test_model_and_dataset_factories_from_src_dir(make_project, tmp_path):
    project = make_project("factories")
    project.env.update(SRC_DIR=str(source_dir(tmp_path)), TRAIN_MODEL="mymodels:build", TRAIN_DATASET="mydata:build")
    project.up_attached("trainer-cpu")
    state = project.wait_exit("trainer-cpu", timeout=600)
    assert state["ExitCode"] == 0, project.logs("trainer-cpu")[-3000:]
    summary = project.summary()
    assert (summary["status"], summary["model"], summary["dataset"]) == ("completed", "mymodels:build",
                                                                         "mydata:build")
    assert summary["world_size"] == 2 and summary["val_acc1"] > 0.8, summary


def test_a_training_script_from_src_dir_runs_under_the_launcher(make_project, tmp_path):
    project = make_project("script")
    project.env.update(SRC_DIR=str(source_dir(tmp_path)), TRAIN_SCRIPT="/workspace/src/train.py")
    project.up_attached("trainer-cpu")
    state = project.wait_exit("trainer-cpu", timeout=600)
    logs = project.logs("trainer-cpu")
    assert state["ExitCode"] == 0, logs[-3000:]
    assert "my script: 16 steps on 2 processes" in logs, logs[-3000:]
    assert "/workspace/src/train.py" in logs  # the torchrun command the launcher printed
    assert sorted(p.name for p in project.checkpoints.glob("step-*.pt"))[-1] == "step-00000016.pt"
