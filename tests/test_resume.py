"""Exact resume: a run stopped mid-epoch and resumed ends with the weights of an uninterrupted run."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    RUN_TIMEOUT_S,
    assert_same_params,
    assert_usage_error,
    checkpoint_steps,
    clean_env,
    dirs_args,
    final_params,
    finished_run,
    load_checkpoint,
    mid_epoch_copy,
    read_scalars,
    read_summary,
    run_trainer_forked,
    train_ok,
    trainer_command,
)

STEPS_PER_EPOCH = 800 // (2 * 8)
TOTAL_STEPS = 2 * STEPS_PER_EPOCH
CHECKPOINT_EVERY = 15
# Two epochs of 2 processes x 8 samples, a checkpoint every 15 steps (all kept): 15, 30, 45 are in
# epoch 0, 50 ends it, 60, 75, 90 are in epoch 1. (Twice as many steps showed nothing more, at twice the time.)
RUN = ["--model", "cnn", "--synthetic-size", "800", "--batch-size", "8", "--epochs", "2", "--lr", "0.05",
       "--warmup-steps", "10", "--checkpoint-every", str(CHECKPOINT_EVERY), "--keep-checkpoints", "20",
       "--log-every", "10", "--num-workers", "0"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return finished_run(tmp_path_factory.mktemp("uninterrupted"), RUN, TOTAL_STEPS, forked=True)


@pytest.mark.slow
@pytest.mark.parametrize("step", [30, 75], ids=["epoch-0", "epoch-1"])
def test_resume_from_a_mid_epoch_checkpoint(uninterrupted, tmp_path, step):
    copy = mid_epoch_copy(uninterrupted, tmp_path, step, STEPS_PER_EPOCH)

    train_ok([*RUN, "--resume", str(copy), *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)
    summary = read_summary(tmp_path / "runs")
    assert (summary["resumed_from_step"], summary["global_step"]) == (step, TOTAL_STEPS)
    assert summary["status"] == "completed"
    assert_same_params(final_params(tmp_path / "checkpoints"), final_params(uninterrupted / "checkpoints"))


@pytest.mark.slow
def test_sigterm_mid_training_then_rerun_resumes_exactly(uninterrupted, tmp_path):
    """docker stop / a pre-empted node: torchrun gets SIGTERM; the same command run again finishes the job."""
    checkpoints = tmp_path / "checkpoints"
    command = trainer_command([*RUN, *dirs_args(tmp_path)], nproc=2)
    torchrun = subprocess.Popen(command, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not checkpoint_steps(checkpoints) and torchrun.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        torchrun.send_signal(signal.SIGTERM)
        _, stderr = torchrun.communicate(timeout=RUN_TIMEOUT_S)
    finally:  # on a failure, leave no worker behind: they share torchrun's new session
        if torchrun.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(torchrun.pid, signal.SIGKILL)
    stopped = read_summary(tmp_path / "runs")
    assert stopped["status"] == "stopped", stderr[-3000:]
    stop_step = stopped["global_step"]
    assert CHECKPOINT_EVERY <= stop_step < TOTAL_STEPS
    assert max(checkpoint_steps(checkpoints)) == stop_step  # the graceful stop committed its step

    train_ok([*RUN, *dirs_args(tmp_path)], tmp_path, nproc=2, forked=True)  # the same command: --resume auto
    summary = read_summary(tmp_path / "runs")
    assert (summary["status"], summary["global_step"]) == ("completed", TOTAL_STEPS)
    assert summary["resumed_from_step"] == stop_step
    assert summary["samples_seen"] == TOTAL_STEPS * 16
    assert_same_params(final_params(checkpoints), final_params(uninterrupted / "checkpoints"))


def test_checkpoint_of_another_model_is_refused(uninterrupted, tmp_path):
    cnn_checkpoint = uninterrupted / "checkpoints" / "step-00000030.pt"
    result = run_trainer_forked(["--model", "autoencoder", "--synthetic-size", "64", "--batch-size", "8", "--max-steps", "1",
                                 "--resume", str(cnn_checkpoint), "--num-workers", "0", *dirs_args(tmp_path)], tmp_path)
    line = assert_usage_error(result, "--resume")
    assert "cnn" in line and "autoencoder" in line
    assert not (tmp_path / "checkpoints").exists()


def test_resume_never_sets_another_runs_checkpoints_aside_and_starts_afresh(uninterrupted, tmp_path):
    """A fresh run in a folder holding another run's checkpoints sets them aside (rotation keeps the highest steps,
    so it would otherwise delete its own first, and --resume auto would go back to them): one line, nothing lost."""
    shutil.copytree(uninterrupted / "checkpoints", tmp_path / "checkpoints")
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").glob("step-*")}
    result = train_ok(["--model", "cnn", "--synthetic-size", "64", "--batch-size", "8", "--max-steps", "2",
                       "--resume", "never", "--num-workers", "0", *dirs_args(tmp_path)], tmp_path, forked=True)
    aside, = (tmp_path / "checkpoints").glob("abandoned-after-step-00000000-*")
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before
    said = [line for line in result.stderr.splitlines() if "set aside" in line]
    assert len(said) == 1 and f"--resume never starts afresh: the {len(before)} checkpoint(s) above it" in said[0] \
        and aside.name in said[0], result.stderr[-3000:]
    assert checkpoint_steps(tmp_path / "checkpoints") == [2]
    assert read_summary(tmp_path / "runs")["resumed_from_step"] is None


def test_resume_auto_after_a_rollback_follows_the_rollback_not_the_abandoned_future(tmp_path):
    """A run rolled back to step 20 (--resume step-20.pt) and ended at 25; a later --resume auto goes on from 25,
    not from the abandoned run's 40, which the rollback set aside with one line (nothing deleted). The rollback's
    line is exact: from 20 to 40 through 25 it ends on the abandoned line's very weights at 40."""
    run = ["--model", "cnn", "--synthetic-size", "256", "--batch-size", "16", "--epochs", "3", "--val-every", "0",
           "--checkpoint-every", "10", "--num-workers", "0", "--lr-schedule", "constant", "--warmup-steps", "0",
           *dirs_args(tmp_path)]  # a schedule that --max-steps does not stretch: the lines can end alike
    checkpoints = tmp_path / "checkpoints"
    train_ok([*run, "--max-steps", "40", "--keep-checkpoints", "10"], tmp_path, forked=True)
    abandoned = {p.name: p.read_bytes() for p in checkpoints.glob("step-*") if int(p.stem.split("-")[1]) > 20}
    assert sorted(abandoned) == ["step-00000030.pt", "step-00000032.pt", "step-00000040.pt"]
    rollback = train_ok([*run, "--max-steps", "25", "--resume", str(checkpoints / "step-00000020.pt")], tmp_path, forked=True)
    aside, = checkpoints.glob("abandoned-after-step-00000020-*")
    said = [line for line in rollback.stderr.splitlines() if "set aside" in line]
    assert len(said) == 1 and "goes back to step 20: the 3 checkpoint(s) above it" in said[0], rollback.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == abandoned
    assert checkpoint_steps(checkpoints) == [16, 20, 25]  # the rotation kept the rollback's own
    later = train_ok([*run, "--max-steps", "40"], tmp_path, forked=True)  # --resume auto
    assert f"resuming from {checkpoints}/step-00000025.pt" in later.stderr, later.stderr[-3000:]
    assert read_summary(tmp_path / "runs")["resumed_from_step"] == 25
    assert_same_params(final_params(checkpoints), load_checkpoint(aside / "step-00000040.pt")["model"])


def test_the_fix_the_wrong_model_error_names_works(uninterrupted, tmp_path):
    """Another model in a folder of a cnn's checkpoints: the launcher refuses it before torchrun, in one line naming
    --resume never; with --resume never the run starts afresh there, the cnn's checkpoints set aside (it used to be
    refused in turn, the folder holding another run's checkpoints)."""
    shutil.copytree(uninterrupted / "checkpoints", tmp_path / "checkpoints")
    run = [sys.executable, "-m", "trainer.cli.launch", "--model", "autoencoder", "--synthetic-size", "64",
           "--batch-size", "8", "--max-steps", "2", "--num-workers", "0", *dirs_args(tmp_path)]
    env = clean_env({"PREFLIGHT": "0", "NPROC_PER_NODE": "2"})
    refused = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    line = assert_usage_error(refused, "--resume")
    assert "holds a cnn trained on synthetic 32x32, this run is a autoencoder" in line and \
        line.endswith("(use another --checkpoint-dir or --resume never)"), line
    fixed = subprocess.run([*run, "--resume", "never"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert read_summary(tmp_path / "runs")["model"] == "autoencoder"
    aside = {p.name for p in (tmp_path / "checkpoints").glob("abandoned-after-step-00000000-*/step-*.pt")}
    assert aside == {p.name for p in (uninterrupted / "checkpoints").glob("step-*.pt")}


def test_resume_never_starts_fresh(tmp_path):
    train_ok(["--model", "cnn", "--synthetic-size", "64", "--batch-size", "8", "--max-steps", "2", "--resume", "never",
              "--num-workers", "0", *dirs_args(tmp_path)], tmp_path, forked=True)
    summary = read_summary(tmp_path / "runs")
    assert (summary["resumed_from_step"], summary["global_step"]) == (None, 2)


def test_a_finished_run_started_again_changes_nothing(tmp_path):
    """`docker compose up` after the job completed: nothing trains, the summary and checkpoints stay."""
    run = ["--model", "cnn", "--synthetic-size", "64", "--batch-size", "16", *dirs_args(tmp_path)]
    train_ok([*run, "--epochs", "2"], tmp_path, forked=True)
    summary = (tmp_path / "runs" / "summary.json").read_bytes()
    checkpoints = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").iterdir()}
    logs = {p.relative_to(tmp_path): (p.stat().st_size, p.stat().st_mtime_ns) for p in (tmp_path / "runs").rglob("*")}
    events = [p for p in logs if p.name.startswith("events.out.tfevents.")]
    assert events, sorted(logs)
    again = train_ok([*run, "--epochs", "2"], tmp_path, forked=True)
    # The one wording of a finished run started again, a script's too (tests/test_api.py).
    assert (f"nothing to do: {tmp_path / 'checkpoints' / 'step-00000008.pt'} is at step 8 of 8, the run's end "
            "(raise --epochs or --max-steps to train on)") in again.stderr, again.stderr[-3000:]
    assert (tmp_path / "runs" / "summary.json").read_bytes() == summary
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "checkpoints").iterdir()} == checkpoints
    # TensorBoard's events (and everything else in the log directory): no new file, none written to.
    assert {p.relative_to(tmp_path): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in (tmp_path / "runs").rglob("*")} == logs
    longer = train_ok([*run, "--epochs", "3"], tmp_path, forked=True)  # more epochs: it trains on from step 8
    assert "resuming from" in longer.stderr and read_summary(tmp_path / "runs")["global_step"] == 12


@pytest.mark.parametrize("before, after", [(1, 2), (2, 1)], ids=["grown", "shrunk"])
def test_a_resume_at_another_world_size_trains_every_epoch_left_at_the_new_size(tmp_path, before, after):
    """--batch-size is per process, so the global batch follows the world size: a job that trained epoch 0 at
    `before` processes and resumes at `after` for --epochs 3 trains the two epochs left at the new size, its plan
    and progress counting the steps done at the old one (the plan once took 3 epochs at the new size for the
    whole run: grown, it ended a whole epoch early, "completed" with epochs_completed 2; shrunk, its total was 20
    steps past the end). The schedule's end is the run's end: the rate reaches 0 at the last step, not before. The
    samples seen are the samples trained (once the step count times the last step's global batch)."""
    run = ["--model", "cnn", "--synthetic-size", "320", "--batch-size", "8", "--val-every", "0", "--log-every", "1",
           "--num-workers", "0", *dirs_args(tmp_path)]
    first = 320 // (8 * before)
    train_ok([*run, "--epochs", "1"], tmp_path, nproc=before, forked=True)
    assert read_summary(tmp_path / "runs")["global_step"] == first
    per_epoch = 320 // (8 * after)
    total = first + 2 * per_epoch
    resumed = train_ok([*run, "--epochs", "3"], tmp_path, nproc=after, forked=True)
    assert f"{total} steps, {per_epoch} per epoch" in resumed.stderr, resumed.stderr[-3000:]
    assert (f"(step {first}, epoch 1, batch 0); a micro-batch over all ranks is {8 * after} samples, {8 * before} "
            "at the checkpoint (the batch size is per process, and the world size changed)") in resumed.stderr
    summary = read_summary(tmp_path / "runs")
    assert (summary["resumed_from_step"], summary["global_step"], summary["epochs_completed"]) == (first, total, 3)
    # Three epochs of 320 samples, whatever the steps' sizes (not the last step times its global batch), in the
    # summary and in the checkpoint a further resume counts on from.
    saved = load_checkpoint(tmp_path / "checkpoints" / f"step-{total:08d}.pt")
    assert summary["samples_seen"] == saved["samples_seen"] == 3 * 320, (summary, saved["samples_seen"])
    rates = {step: rate for step, rate in read_scalars(tmp_path / "runs")["lr"] if step > first}  # the resumed run's
    assert sorted(rates) == list(range(first + 1, total + 1)), rates
    assert all(rate > 0 for step, rate in rates.items() if step < total) and rates[total] == 0, rates


# ------------------------------------------------------------------ settings changed on resume
CHANGED = ["--model", "cnn", "--synthetic-size", "256", "--batch-size", "16", "--epochs", "2", "--val-every", "0",
           "--log-every", "2", "--checkpoint-every", "8", "--num-workers", "0"]


def test_a_resume_applies_a_changed_lr_weight_decay_momentum_schedule_and_warmup_and_says_so(tmp_path):
    """The checkpoint's optimizer and scheduler state would override a new --lr (and the rest) in silence: the new
    values are applied, the schedule goes on from the new base rate at the checkpoint's step, one line says so."""
    from trainer.engine.optim import lr_factor

    train_ok([*CHANGED, "--lr", "0.1", "--warmup-steps", "4", "--max-steps", "8", *dirs_args(tmp_path)], tmp_path, forked=True)
    resumed = train_ok([*CHANGED, "--lr", "0.01", "--weight-decay", "0", "--momentum", "0.5", "--warmup-steps", "0",
                        "--lr-schedule", "step", *dirs_args(tmp_path)], tmp_path, forked=True)
    lines = [line for line in resumed.stderr.splitlines() if "settings changed since" in line]
    assert len(lines) == 1, resumed.stderr[-3000:]
    assert lines[0].endswith("settings changed since step-00000008.pt, applied: --lr 0.1 -> 0.01, --momentum 0.9 -> "
                             "0.5, --weight-decay 0.0005 -> 0.0, --lr-schedule cosine -> step, --warmup-steps 4 -> 0 "
                             "(the schedule goes on from step 8 with them)"), lines[0]
    logged = dict(read_scalars(tmp_path / "runs")["lr"])
    for step in (10, 16, 24, 32):  # the new schedule of the new base rate, from the checkpoint's step on
        assert logged[step] == pytest.approx(0.01 * lr_factor(step, 32, 0, "step")), (step, logged)
    final = load_checkpoint(tmp_path / "checkpoints" / "step-00000032.pt")
    decay, no_decay = final["optimizer"]["param_groups"]
    assert (decay["weight_decay"], decay["momentum"], no_decay["weight_decay"]) == (0.0, 0.5, 0.0)
    assert final["scheduler"]["base_lrs"] == [0.01, 0.01]
    again = train_ok([*CHANGED, "--lr", "0.01", "--weight-decay", "0", "--momentum", "0.5", "--warmup-steps", "0",
                      "--lr-schedule", "step", "--epochs", "3", *dirs_args(tmp_path)], tmp_path, forked=True)
    assert "settings changed" not in again.stderr  # the same settings again: nothing to say


def test_a_resume_onto_the_references_per_epoch_schedule_applies_it_from_the_checkpoints_step_and_says_so(tmp_path):
    """A run on the per-step schedule resumed with the reference's --lr-scheduler: its per-epoch rates from the
    checkpoint's step on (epoch 1 of 16 steps each at lr x gamma), the line naming what was unset before."""
    train_ok([*CHANGED, "--max-steps", "8", *dirs_args(tmp_path)], tmp_path, forked=True)
    resumed = train_ok([*CHANGED, "--lr-scheduler", "steplr", "--lr-step-size", "1", "--lr-gamma", "0.5",
                        *dirs_args(tmp_path)], tmp_path, forked=True)
    assert "applied: --lr-scheduler unset -> steplr, --lr-step-size 30 -> 1, --lr-gamma 0.1 -> 0.5 (the schedule " \
        "goes on from step 8 with them)" in resumed.stderr, resumed.stderr[-3000:]
    logged = dict(read_scalars(tmp_path / "runs")["lr"])
    for step in (10, 14):  # epoch 0 of 16 steps (256 / 16): lr
        assert logged[step] == pytest.approx(0.1), (step, logged)
    for step in (16, 24, 30):  # epoch 1: lr x 0.5, one step of the schedule
        assert logged[step] == pytest.approx(0.05), (step, logged)


def test_a_changed_lr_on_a_checkpoint_that_does_not_record_its_settings_is_refused_in_one_line(tmp_path):
    """A checkpoint written before checkpoints recorded what their run built cannot tell a changed setting from the
    schedule's own moves: a changed --lr is refused in one line naming the way on, not ignored."""
    import torch

    train_ok([*CHANGED, "--lr", "0.1", "--max-steps", "8", *dirs_args(tmp_path)], tmp_path, forked=True)
    path = tmp_path / "checkpoints" / "step-00000008.pt"
    state = load_checkpoint(path)
    del state["hyperparameters"]
    torch.save(state, path)
    result = run_trainer_forked([*CHANGED, "--lr", "0.01", *dirs_args(tmp_path)], tmp_path)
    line = assert_usage_error(result, "--lr")
    assert "0.01 on resume, and " in line and "was trained with 0.1 (resume with --lr 0.1 until it commits a " \
        "checkpoint, then change it" in line, line
    same = train_ok([*CHANGED, "--lr", "0.1", "--max-steps", "10", *dirs_args(tmp_path)], tmp_path, forked=True)
    assert "settings changed" not in same.stderr and read_summary(tmp_path / "runs")["global_step"] == 10
