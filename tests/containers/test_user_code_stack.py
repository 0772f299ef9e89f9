"""Users' code in the containers, as the README shows it: factories and a training script in SRC_DIR
(mounted read-only at /workspace/src, on PYTHONPATH), named by TRAIN_MODEL / TRAIN_DATASET / TRAIN_SCRIPT,
run by `docker compose --profile cpu up`."""

from __future__ import annotations

import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

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
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer import api

with api.Run() as run:  # the directories from TRAIN_CHECKPOINT_DIR and TRAIN_LOG_DIR: the volumes
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
    assert project.summary()["global_step"] == 16


def test_a_script_under_fsdp_writes_its_checkpoints_and_runs_into_the_volumes(make_project, tmp_path):
    """tests/user_code/engine_loop.py as TRAIN_SCRIPT with the strategy and the trackers from TRAIN_* alone: its
    sharded checkpoints and its logs land in the volumes, and the summary service tells its truth."""
    src = source_dir(tmp_path)
    for name in ("engine_loop.py", "numbered.py"):
        (src / name).write_text((REPO / "tests" / "user_code" / name).read_text())
        (src / name).chmod(0o644)
    project = make_project("engine")
    project.env.update(SRC_DIR=str(src), TRAIN_SCRIPT="/workspace/src/engine_loop.py", TRAIN_STRATEGY="fsdp",
                       TRAIN_TRACKER="tensorboard,csv")
    project.up_attached("trainer-cpu", "summary-cpu")
    state = project.wait_exit("summary-cpu", timeout=600)
    logs = project.logs("trainer-cpu")
    assert project.container("trainer-cpu").attrs["State"]["ExitCode"] == 0, logs[-3000:]
    committed = sorted(p.name for p in project.checkpoints.glob("step-*") if (p / "COMMITTED").is_file())
    assert committed and committed[-1] == "step-00000012", logs[-3000:]  # 96 samples, global batch 8
    summary = project.summary()
    assert (summary["status"], summary["strategy"], summary["world_size"]) == ("completed", "fsdp", 2)
    assert [row["rank"] for row in summary["ranks"]] == [0, 1]
    assert (project.runs / "metrics.csv").is_file() and list(project.runs.glob("events.out.tfevents.*"))
    assert state["ExitCode"] == 0
    assert "completed at step 12, world size 2: train loss " in project.logs("summary-cpu")
