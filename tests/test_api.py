"""One engine, two doors: a script on trainer.api gets what the built-in loop has, from the same settings.

Real launcher, real torchrun, gloo; the script is tests/user_code/engine_loop.py, which records the samples
every rank trains on. Its strategy, trackers, step timing and directories come from TRAIN_* variables only.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fault_helpers import Launch, launcher_env, wait_until
from helpers import (
    REPO,
    RUN_TIMEOUT_S,
    assert_usage_error,
    clean_env,
    dirs_args,
    free_port,
    read_scalars,
    read_summary,
    run_trainer_forked,
    train_ok,
)

from trainer.checkpoint.sharded import COMMIT_MARKER
from trainer.checkpoint.store import list_checkpoints

LOOP = REPO / "tests" / "user_code" / "engine_loop.py"
SAMPLES = 96  # global micro-batches of 8: 12 steps per epoch at any world size


def engine_env(root: Path, nproc: int, **extra: str) -> dict[str, str]:
    return launcher_env(free_port(), NPROC_PER_NODE=str(nproc), TRAIN_STRATEGY="fsdp",
                        TRAIN_TRACKER="tensorboard,csv", TRAIN_CHECKPOINT_DIR=str(root / "ckpt"),
                        TRAIN_LOG_DIR=str(root / "runs"), TRAIN_LOG_EVERY="2", **extra)


def seen(root: Path, world: int) -> dict[int, list[list[int]]]:
    """{rank: [micro-batch indices, ...]} of epoch 0, as the ranks of a run at `world` processes recorded them."""
    out = {}
    for rank in range(world):
        path = root / f"seen-rank{rank}-world{world}.txt"
        lines = path.read_text().splitlines() if path.exists() else []
        out[rank] = [[int(i) for i in line.split()[1:]] for line in lines if line.split()[0] == "0"]
    return out


def launch(root: Path, nproc: int, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.cli.launch", str(LOOP), "--out", str(root), *args],
                          cwd=root, env=clean_env(engine_env(root, nproc, **extra)), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


@pytest.mark.slow
def test_a_script_under_fsdp_stopped_mid_epoch_resumes_at_one_process_with_every_sample_once(tmp_path):
    """2 processes, fsdp, trackers and directories from TRAIN_* only: SIGTERM mid-epoch exits 0 with a committed
    (sharded) checkpoint and summary.json with both ranks' step timing; the run resumed at 1 process trains on
    the rest of the epoch, so every sample of the epoch is trained on exactly once across the stop."""
    stopped = Launch([str(LOOP), "--out", str(tmp_path), "--step-seconds", "0.3"], tmp_path, engine_env(tmp_path, 2))
    try:
        wait_until(lambda: len(seen(tmp_path, 2)[0]) >= 3, 120, "three steps trained")
        os.kill(stopped.pid, signal.SIGTERM)
        assert stopped.wait(60) == 0, stopped.output()[-4000:]
    finally:
        if stopped.proc.poll() is None:
            stopped.stop_everything()
    committed = list_checkpoints(tmp_path / "ckpt")
    assert committed and committed[0].is_dir() and (committed[0] / COMMIT_MARKER).is_file(), stopped.output()[-3000:]
    stop_step = int(committed[0].name.split("-")[1])
    assert 3 <= stop_step < SAMPLES // 8, stop_step
    first = seen(tmp_path, 2)
    assert len(first[0]) == len(first[1]) == stop_step  # both ranks stopped after the same step
    summary = read_summary(tmp_path / "runs")
    assert (summary["status"], summary["strategy"], summary["global_step"]) == ("stopped", "fsdp", stop_step)
    assert [row["rank"] for row in summary["ranks"]] == [0, 1] and summary["ranks"][0]["compute_ms"] > 0, summary
    assert "Loss/train" in read_scalars(tmp_path / "runs")
    with open(tmp_path / "runs" / "metrics.csv", newline="") as f:
        assert {row["tag"] for row in csv.DictReader(f)} >= {"Loss/train", "lr", "time/compute_ms/rank1"}

    resumed = launch(tmp_path, 1)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming from {tmp_path / 'ckpt'}/step-{stop_step:08d} (step {stop_step}, epoch 0, batch {stop_step}" \
        in resumed.stderr
    second = seen(tmp_path, 1)[0]
    trained = [i for batch in first[0] + first[1] + second for i in batch]
    assert sorted(trained) == list(range(SAMPLES))  # every sample once: none replayed, none skipped
    summary = read_summary(tmp_path / "runs")
    assert (summary["status"], summary["world_size"], summary["global_step"]) == ("completed", 1, SAMPLES // 8)
    assert summary["resumed_from_step"] == stop_step and [row["rank"] for row in summary["ranks"]] == [0]


SCRIPT = """
import torch
from trainer import api

with api.Run({kwargs}) as run:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
{body}
"""


def script(tmp_path: Path, body: str, kwargs: str = "", name: str = "s.py") -> Path:
    path = tmp_path / name
    path.write_text(SCRIPT.format(kwargs=kwargs, body=textwrap.indent(textwrap.dedent(body), "    ")))
    return path


def run_script(path: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(path)], cwd=cwd, env=clean_env(env), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


@pytest.mark.parametrize("kwargs, env, setting", [
    ("checkpoint_every=-1", {}, "checkpoint_every: -1 is below 0"),
    ("batch_size=-1", {}, "batch_size: -1 is below 1"),
    ("strategy='fsdp', sync_bn=True", {}, "sync_bn: SyncBatchNorm is for strategy ddp (fsdp shards the norm layers) "
                                        "(drop sync_bn, or use strategy ddp)"),
    ("", {"TRAIN_KEEP_CHECKPOINTS": "1"}, "TRAIN_KEEP_CHECKPOINTS: 1 is below 2"),
    ("strategy='zero'", {}, "strategy: unknown value 'zero'"),
    ("tracker='tensorbored'", {}, "tracker: unknown tracker 'tensorbored'"),
    ("checkpoint_evry=5", {}, "checkpoint_evry: is not a setting of Run() (did you mean checkpoint_every?"),
    ("", {"TRAIN_LOG_EVRY": "5"}, "TRAIN_LOG_EVRY: in the environment is not a training setting"),
])
def test_every_setting_run_reads_is_checked_as_the_built_in_loop_checks_it(tmp_path, kwargs, env, setting):
    result = run_script(script(tmp_path, "pass", kwargs), tmp_path, **env)
    assert setting in assert_usage_error(result, setting.split(":")[0])
    assert list(tmp_path.iterdir()) == [tmp_path / "s.py"]  # nothing written


OWN_DATA = """
import json, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from trainer import api

with api.Run(checkpoint_dir="ckpt", log_dir="runs", epochs=1, **json.loads(sys.argv[1])) as run:
    model = run.wrap(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    run.resume(model=model, optimizer=optimizer)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16000, 8, generator=g), torch.randint(0, 2, (16000,), generator=g))
    batch = run.settings.batch_size
    loader = DataLoader(data, batch_size=batch, sampler=run.sampler(data, batch), drop_last=True)
    for epoch in run.epochs():
        for micro_batches in run.steps(loader):
            for x, y in micro_batches:
                run.backward(torch.nn.functional.cross_entropy(model(x), y))
            run.optimizer_step(optimizer)
"""


@pytest.mark.parametrize("kwargs, steps", [
    ('{"batch_size": 2000, "grad_accum": 4}', 1),  # 8,000 samples a rank: 4 micro-batches of 2,000, one step
    ('{"train_crop_size": 224}', 125),            # the built-in loop's crop: the script's own to read
], ids=["a large batch over its own data", "a crop size for its own transforms"])
def test_a_script_with_its_own_data_is_not_checked_against_the_built_in_loops(tmp_path, kwargs, steps):
    """A script's Run checks the run's settings, not the built-in loop's data: a batch of 2,000 in 4 micro-batches
    over the script's 16,000 samples was refused as too large for the built-in synthetic set's 10,000 (naming
    --batch-size), and train_crop_size=224 as larger than its 32x32 images. At 2 processes, the real launcher."""
    path = tmp_path / "own_data.py"
    path.write_text(OWN_DATA)
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", str(path), kwargs], cwd=tmp_path,
                            env=clean_env(launcher_env(free_port())), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = read_summary(tmp_path / "runs")
    assert (summary["status"], summary["world_size"], summary["global_step"]) == ("completed", 2, steps)


@pytest.mark.parametrize("body, first", [
    ("""
     for epoch in run.epochs(1):
         pass
     """, "error: run.epochs(): called before run.resume(...) (call run.resume(model=..., optimizer=...) first"),
    ("""
     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
     run.resume(model=model, optimizer=optimizer)
     """, "error: resume(): called before run.wrap(model), and strategy fsdp shards the model in place (call "
         "run.wrap(model) first"),
    ("""
     optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
     run.wrap(model)
     run.resume(model=model, optimizer=optimizer)
     """, "error: resume(): optimizer was built before run.wrap(model): fsdp replaced the model's parameters by "
         "their shards"),
])
def test_wrong_api_use_says_what_to_call_first(tmp_path, body, first):
    """Asked for in the wrong order, the API's answer is one line naming the call that must come first: a stop
    before resume(), an fsdp resume before wrap(), an optimizer built before an fsdp wrap()."""
    path = script(tmp_path, body, "strategy='fsdp'")
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", str(path)], cwd=tmp_path,
                            env=clean_env(launcher_env(free_port())), capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors and errors[0].startswith(first), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


BUILT_IN_RUN = ["--model", "cnn", "--synthetic-size", "64", "--batch-size", "8", "--epochs", "1", "--val-every", "0"]


def test_a_built_in_checkpoint_resumes_in_a_script_that_registers_what_it_holds(tmp_path):
    """The built-in loop's checkpoint holds model, optimizer, scheduler and scaler: a script registering a subset
    of them resumes it (at its step); one registering another name is refused in one line."""
    train_ok([*BUILT_IN_RUN, *dirs_args(tmp_path)], tmp_path)
    body = """
        from trainer.engine.models import build_model
        from trainer import DataSpec
        net = build_model("cnn", DataSpec(3, 32, 10))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        print("resumed at", run.resume({names}))
        """
    ok = run_script(script(tmp_path, body.format(names="model=net"), "checkpoint_dir="
                           "'checkpoints', log_dir='runs'", "ok.py"), tmp_path)
    assert ok.returncode == 0 and "resumed at 8" in ok.stdout, ok.stderr[-3000:]
    refused = run_script(script(tmp_path, body.format(names="net=net"), "checkpoint_dir='checkpoints', "
                                "log_dir='runs'", "refused.py"), tmp_path)
    line = assert_usage_error(refused, "resume")
    assert "holds model, optimizer, scheduler, scaler; this run resumes net (net missing)" in line


def test_a_scripts_checkpoint_resumes_in_the_built_in_loop_only_when_it_holds_what_the_loop_registers(tmp_path):
    """The reverse door: a script's checkpoint of a model and its optimizer lacks the loop's scheduler and scaler,
    and is refused in one line naming them; nothing is trained."""
    body = """
        run.resume(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        run.save()
        """
    done = run_script(script(tmp_path, body, "checkpoint_dir='checkpoints', log_dir='runs'"), tmp_path)
    assert done.returncode == 0, done.stderr
    result = run_trainer_forked([*BUILT_IN_RUN, *dirs_args(tmp_path)], tmp_path)
    line = assert_usage_error(result, "--resume")
    assert "holds model, optimizer; this run resumes model, optimizer, scheduler, scaler (scheduler, scaler " \
           "missing)" in line


def test_steps_group_micro_batches_and_drop_a_short_last_group_and_every_step_counts(tmp_path):
    """run.steps() gives grad_accum micro-batches per optimizer step, from a sized loader or a bare generator; a
    last group too short to end in a gradient sync is dropped, not stepped on."""
    body = """
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        forward = run.wrap(model)
        run.resume(model=model, optimizer=optimizer)
        data = [(torch.randn(2, 4), torch.randint(0, 2, (2,))) for _ in range(5)]
        for source in (data, (batch for batch in data)):
            for micro_batches in run.steps(source):
                sizes = [len(x) for x, y in micro_batches]
                for x, y in micro_batches:
                    pass
                counted = run.optimizer_step(optimizer)
                print("step", run.step_count, "micro", len(sizes), "counted", counted)
        """
    result = run_script(script(tmp_path, body, "grad_accum=2, checkpoint_dir='c', log_dir='r'"), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    # 5 batches, 2 per step: two steps from each source (steps done before each one printed), the fifth dropped;
    # every step counts (only in-place recovery abandons one)
    assert result.stdout.split() == " ".join(f"step {n} micro 2 counted True" for n in range(4)).split()


def test_a_finished_script_started_again_trains_and_writes_nothing_and_says_so_as_the_built_in_loop_does(tmp_path):
    """The built-in loop's line (tests/test_resume.py), with the script's keyword arguments for the settings; no
    step past max_steps (one was trained, and committed), the checkpoint and summary.json left as they were."""
    body = """
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run.resume(model=model, optimizer=optimizer)
        for micro_batches in run.steps([(torch.randn(2, 4), torch.randint(0, 2, (2,)))] * 3):
            for x, y in micro_batches:
                run.backward(torch.nn.functional.cross_entropy(model(x), y))
            run.optimizer_step(optimizer)
        """
    path = script(tmp_path, body, "max_steps=2, checkpoint_dir='c', log_dir='r'")
    assert run_script(path, tmp_path).returncode == 0
    def written() -> dict:  # the checkpoints (not the directory's lock, each run's own) and the summary
        return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in [*(tmp_path / "c").glob("step-*"),
                                                                    tmp_path / "r" / "summary.json"]}

    before = written()
    again = run_script(path, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.splitlines()[-1].endswith("nothing to do: c/step-00000002.pt is at step 2 of 2, the run's end "
                                                  "(raise epochs or max_steps to train on)"), again.stderr[-3000:]
    assert "training Sequential" not in again.stderr  # no start line for a run with nothing to train
    assert written() == before and len(before) == 2


def test_a_bad_train_setting_for_a_script_is_one_line_from_the_launcher_before_torchrun(tmp_path):
    """A script on trainer.api reads the TRAIN_* settings, so trainer-launch checks them first, as it checks the
    built-in loop's: one line, exit 2, no worker started."""
    path = script(tmp_path, "pass")
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", str(path)], cwd=tmp_path,
                            env=clean_env(launcher_env(free_port(), TRAIN_STRATEGY="fdsp")), capture_output=True,
                            text=True, timeout=RUN_TIMEOUT_S)
    assert "TRAIN_STRATEGY: unknown value 'fdsp' (choose one of ddp, fsdp)" in assert_usage_error(result, "TRAIN_STRATEGY")
    assert "torchrun" not in result.stderr


def test_a_script_resumed_with_a_changed_learning_rate_weight_decay_and_step_size_trains_with_them(tmp_path):
    """run.resume() loads the optimizer's and the scheduler's state over what the script built: a learning rate,
    weight decay or scheduler setting the script changed since its checkpoint is applied after the load (the
    schedule's rate of the moment scaled by the new base rate), with one line; unchanged, nothing is said."""
    body = """
        import os
        optimizer = torch.optim.AdamW(model.parameters(), lr=float(os.environ["LR"]),
                                      weight_decay=float(os.environ["WD"]))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=int(os.environ["STEP"]), gamma=0.5)
        run.resume(model=model, optimizer=optimizer, scheduler=scheduler)
        for _ in range(int(os.environ["STEPS"])):
            optimizer.step()
            scheduler.step()
            run.step()
        group = optimizer.param_groups[0]
        print("lr", group["lr"], "weight_decay", group["weight_decay"], "step_size", scheduler.step_size,
              "base", scheduler.base_lrs[0])
        """
    path = script(tmp_path, body, "checkpoint_dir='c', log_dir='r'")
    first = run_script(path, tmp_path, LR="0.1", WD="0.01", STEP="2", STEPS="3")
    assert first.returncode == 0 and first.stdout.split() == "lr 0.05 weight_decay 0.01 step_size 2 base 0.1".split(), \
        first.stdout + first.stderr[-3000:]
    resumed = run_script(path, tmp_path, LR="0.01", WD="0", STEP="3", STEPS="0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The checkpoint's rate of step 3 (0.05, halved once) scaled by the new base rate: 0.005.
    assert resumed.stdout.split() == "lr 0.005 weight_decay 0.0 step_size 3 base 0.01".split(), resumed.stdout
    assert "settings changed since step-00000003.pt, applied: optimizer lr 0.1 -> 0.01, optimizer weight_decay " \
           "0.01 -> 0, scheduler step_size 2 -> 3 (the schedule goes on from step 3 with them)" in resumed.stderr, \
        resumed.stderr[-3000:]
    same = run_script(path, tmp_path, LR="0.1", WD="0.01", STEP="2", STEPS="0")
    assert same.stdout.split() == "lr 0.05 weight_decay 0.01 step_size 2 base 0.1".split(), same.stdout
    assert "settings changed" not in same.stderr
