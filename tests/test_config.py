"""Configuration: precedence flag > environment > .env > default, --help, and the bad-input contract."""

from __future__ import annotations

import inspect

import dataclasses
import os
from pathlib import Path

import pytest
from helpers import (
    BAD_INPUT_TIMEOUT_S,
    assert_usage_error,
    dirs_args,
    files_under,
    free_port,
    run_trainer,
    run_trainer_forked,
)

from trainer.config.settings import OPTIONS, TrainConfig, env_name, flag_name, load_config
from trainer.core.errors import UsageError

DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig)}


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "settings.env"
    path.write_text("TRAIN_LR=0.3\nTRAIN_EPOCHS=7\nTRAIN_WARMUP_STEPS=11\nTRAIN_OPTIMIZER=adamw\n")
    return path


def test_precedence_flag_over_env_over_dotenv_over_default(env_file):
    environ = {"TRAIN_LR": "0.2", "TRAIN_EPOCHS": "6"}
    cfg = load_config(["--env-file", str(env_file), "--lr", "0.1"], environ, world_size=1)
    assert cfg.lr == 0.1  # flag, env and .env all set it
    assert cfg.epochs == 6  # env and .env
    assert (cfg.warmup_steps, cfg.optimizer) == (11, "adamw")  # .env only
    assert cfg.momentum == DEFAULTS["momentum"]  # nowhere
    assert cfg.seed == DEFAULTS["seed"]


def test_dotenv_does_not_override_the_real_environment_even_when_empty_elsewhere(env_file):
    cfg = load_config(["--env-file", str(env_file)], {"TRAIN_OPTIMIZER": "sgd"}, world_size=1)
    assert cfg.optimizer == "sgd"
    assert cfg.lr == 0.3


def test_default_env_file_is_dot_env_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("TRAIN_BATCH_SIZE=48\n")
    assert load_config([], {}, world_size=1).batch_size == 48
    assert load_config(["--batch-size", "12"], {}, world_size=1).batch_size == 12


def test_defaults_without_any_source(tmp_path):
    cfg = load_config(["--env-file", os.devnull], {}, world_size=1)
    assert {f.name: getattr(cfg, f.name) for f in OPTIONS} == {f.name: DEFAULTS[f.name] for f in OPTIONS}


@pytest.mark.parametrize("raw, expected", [("true", True), ("1", True), ("on", True), ("false", False),
                                           ("0", False), ("no", False)])
def test_booleans_from_environment(tmp_path, raw, expected):
    cfg = load_config(["--env-file", os.devnull], {"TRAIN_CHANNELS_LAST": raw}, world_size=1)
    assert cfg.channels_last is expected


def test_bare_boolean_flag_means_true_and_beats_environment(tmp_path):
    cfg = load_config(["--env-file", os.devnull, "--sync-bn", "--compile", "false"],
                      {"TRAIN_SYNC_BN": "0", "TRAIN_COMPILE": "1"}, world_size=1)
    assert (cfg.sync_bn, cfg.compile) == (True, False)


def test_global_batch_size_is_divided_by_world_size_and_grad_accum(tmp_path):
    cfg = load_config(["--env-file", os.devnull, "--global-batch-size", "256",
                       "--grad-accum", "2"], {}, world_size=4)
    assert (cfg.batch_size, cfg.world_size, cfg.samples_per_step) == (32, 4, 256)


def test_help_lists_every_option_with_its_env_name(tmp_path):
    result = run_trainer(["--help"], tmp_path, timeout=BAD_INPUT_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # undo argparse's line wrapping
    for f in OPTIONS:
        assert flag_name(f.name) in text, f.name
        assert f"env {env_name(f.name)}; default {f.default}" in text, f.name
    assert "--env-file" in text


def test_help_shows_the_value_each_option_has_from_the_environment_the_env_file_and_env_file(tmp_path):
    """docs/settings.md: --help shows the value each option has where it runs: the environment's, else .env's (or
    the file --env-file names), which the run would use."""
    (tmp_path / ".env").write_text("TRAIN_LR=0.25\nTRAIN_BATCH_SIZE=5\n")
    (tmp_path / "other.env").write_text("TRAIN_EPOCHS=7\n")
    shown = {}
    for args in (["--help"], ["--env-file", "other.env", "--help"]):
        result = run_trainer_forked(args, tmp_path, env={"TRAIN_BATCH_SIZE": "3"}, timeout=BAD_INPUT_TIMEOUT_S)
        assert result.returncode == 0, result.stderr
        shown[args[0]] = " ".join(result.stdout.split())
    assert "[env TRAIN_LR=0.25 here (in .env); default 0.1]" in shown["--help"]
    assert "[env TRAIN_BATCH_SIZE=3 here; default 64]" in shown["--help"]  # the environment wins over .env
    assert "[env TRAIN_EPOCHS; default 5]" in shown["--help"]
    assert "[env TRAIN_EPOCHS=7 here (in other.env); default 5]" in shown["--env-file"]
    assert "[env TRAIN_LR; default 0.1]" in shown["--env-file"]  # .env is not read when another file is named


# (arguments, environment, the setting the error must name)
BAD_INPUTS = {
    "non-numeric flag": (["--lr", "abc"], {}, "--lr"),
    "non-integer flag": (["--batch-size", "2.5"], {}, "--batch-size"),
    "non-numeric env": ([], {"TRAIN_EPOCHS": "many"}, "TRAIN_EPOCHS"),
    "infinite lr": (["--lr", "inf"], {}, "--lr"),
    "below range": (["--batch-size", "0"], {}, "--batch-size"),
    "env below range": ([], {"TRAIN_KEEP_CHECKPOINTS": "1"}, "TRAIN_KEEP_CHECKPOINTS"),
    "momentum 1 or more": (["--momentum", "1.5"], {}, "--momentum"),
    "not a boolean": (["--channels-last", "maybe"], {}, "--channels-last"),
    "unknown model": (["--model", "vgg"], {}, "--model"),
    "unknown dataset": (["--dataset", "imagenet"], {}, "--dataset"),
    "unknown optimizer in env": ([], {"TRAIN_OPTIMIZER": "lamb"}, "TRAIN_OPTIMIZER"),
    "imagefolder without data": (["--dataset", "imagefolder", "--data-dir", "missing"], {}, "--data-dir"),
    "indivisible global batch": (["--global-batch-size", "33", "--grad-accum", "2"], {}, "--global-batch-size"),
    "missing resume file": (["--resume", "nowhere/step-00000001.pt"], {}, "--resume"),
    "unknown flag": (["--bogus", "1"], {}, "arguments"),
    "autoencoder channels-last": (["--model", "autoencoder", "--channels-last"], {}, "--channels-last"),
}


@pytest.mark.parametrize("args, environ, setting", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, environ, setting):
    result = run_trainer_forked([*args, *dirs_args(tmp_path)], tmp_path, env=environ, timeout=BAD_INPUT_TIMEOUT_S)
    assert_usage_error(result, setting)
    assert files_under(tmp_path) == set()


def test_bad_value_in_dotenv_names_the_file(tmp_path):
    (tmp_path / ".env").write_text("TRAIN_LR=fast\n")
    result = run_trainer_forked(dirs_args(tmp_path), tmp_path, timeout=BAD_INPUT_TIMEOUT_S)
    line = assert_usage_error(result, "TRAIN_LR")
    assert ".env" in line
    assert files_under(tmp_path) == {Path(".env")}


def test_indivisible_global_batch_fails_before_the_process_group_forms(tmp_path):
    # Rank 0 of a world of 2 whose peer never comes: a late check would wait in the rendezvous instead.
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    result = run_trainer_forked(["--global-batch-size", "63", *dirs_args(tmp_path)], tmp_path, env=env,
                                timeout=BAD_INPUT_TIMEOUT_S)
    line = assert_usage_error(result, "--global-batch-size")
    assert "world size 2" in line
    assert files_under(tmp_path) == set()


def test_nccl_without_gpu(tmp_path):  # the test environment hides any GPU
    result = run_trainer_forked(["--backend", "nccl", *dirs_args(tmp_path)], tmp_path, timeout=BAD_INPUT_TIMEOUT_S)
    line = assert_usage_error(result, "--backend")
    assert "gloo" in line  # the fix it offers
    assert files_under(tmp_path) == set()



def test_resume_never_becomes_auto_when_torchrun_restarts_the_workers(tmp_path):
    """The first attempt started afresh (setting aside what was there): what is there now is this run's own."""
    (tmp_path / "step-00000010.pt").touch()
    args = ["--env-file", os.devnull, "--resume", "never", "--checkpoint-dir", str(tmp_path)]
    assert load_config(args, {"TORCHELASTIC_RESTART_COUNT": "0"}, world_size=1).resume == "never"
    assert load_config(args, {"TORCHELASTIC_RESTART_COUNT": "1"}, world_size=1).resume == "auto"


def test_dotenv_written_with_a_byte_order_mark(tmp_path):
    path = tmp_path / ".env"
    path.write_bytes("TRAIN_MODEL=cnn\n".encode("utf-8-sig"))
    assert load_config(["--env-file", str(path)], {}, world_size=1).model == "cnn"


def test_the_settings_page_is_what_the_code_says():
    """docs/settings.md is generated from TrainConfig and the launcher's table; --check (a real process) fails
    on any drift, and every option and launcher variable has its row, with its variable and default."""
    import subprocess
    import sys

    from trainer.cli.settings_page import PAGE, render, shown_default
    from trainer.config import launcher
    from trainer.config.launcher import LAUNCHER_SETTINGS

    check = subprocess.run([sys.executable, "-m", "trainer.cli.settings_page", "--check"], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    page = PAGE.read_text()
    assert page == render()
    rows = {line.split("|")[1].strip(" `"): line for line in page.splitlines() if line.startswith("| `")}
    for f in OPTIONS:
        row = rows.get(flag_name(f.name))
        assert row is not None, f"docs/settings.md has no row for {flag_name(f.name)}"
        assert f"`{env_name(f.name)}`" in row and shown_default(f.default) in row, row
    # Each launcher variable is one trainer/cluster/ or the launcher's settings reader reads by that name (a renamed
    # variable fails here).
    cluster_source = "".join(p.read_text() for p in (Path(__file__).parents[1] / "trainer" / "cluster").glob("*.py"))
    cluster_source += inspect.getsource(launcher.read)
    for var in LAUNCHER_SETTINGS:
        assert f"| `{var.name}` | {var.default} |" in page
        assert f'"{var.name}"' in cluster_source, f"nothing in trainer/cluster reads {var.name}"


def test_the_settings_page_check_fails_on_a_stale_page(tmp_path, monkeypatch):
    from trainer.cli import settings_page

    stale = tmp_path / "settings.md"
    stale.write_text(settings_page.render().replace("`TRAIN_EPOCHS` | `5`", "`TRAIN_EPOCHS` | `7`"))
    monkeypatch.setattr(settings_page, "PAGE", stale)
    assert settings_page.main(["--check"]) == 1
    assert settings_page.main([]) == 0 and settings_page.main(["--check"]) == 0


@pytest.mark.parametrize("args, env, setting, suggested", [
    ([], {"TRAIN_LEARNING_RATE": "0.01"}, "TRAIN_LEARNING_RATE", "did you mean TRAIN_LR?"),
    ([], {"TRAIN_LOGDIR": "runs"}, "TRAIN_LOGDIR", "did you mean TRAIN_LOG_DIR?"),
    ([], {"TRAIN_GRADIENT_ACCUMULATION_STEPS": "2"}, "TRAIN_GRADIENT_ACCUMULATION_STEPS", "did you mean TRAIN_GRAD_ACCUM?"),
    ([], {"TRAIN_NUM_TRAIN_EPOCHS": "2"}, "TRAIN_NUM_TRAIN_EPOCHS", "did you mean TRAIN_EPOCHS?"),
    ([], {"TRAIN_SCRIPTS": "train.py"}, "TRAIN_SCRIPTS", "did you mean TRAIN_SCRIPT?"),
    (["--learning-rate", "0.01"], {}, "arguments", "did you mean --lr?"),
    (["--wd", "0"], {}, "arguments", "did you mean --weight-decay?"),
], ids=["learning rate", "logdir", "HF's gradient accumulation", "HF's epochs", "launcher variable",
        "flag --learning-rate", "torchvision's --wd"])
def test_a_name_users_type_elsewhere_suggests_the_option_it_means(tmp_path, args, env, setting, suggested):
    """Names from other tools are what users type: the suggestion is the option they mean (TRAIN_LEARNING_RATE
    used to get "did you mean TRAIN_LOG_DIR?", the closest spelling with the shared prefix counted)."""
    result = run_trainer_forked([*args, *dirs_args(tmp_path)], tmp_path, env=env, timeout=BAD_INPUT_TIMEOUT_S)
    assert suggested in assert_usage_error(result, setting)
    assert files_under(tmp_path) == set()


def test_a_script_s_keyword_argument_users_type_elsewhere_suggests_the_setting(tmp_path):
    from trainer.config.settings import script_settings

    with pytest.raises(UsageError, match=r"^learning_rate: is not a setting of Run\(\) \(did you mean lr\? "):
        script_settings({"learning_rate": 0.01}, {}, 1)
