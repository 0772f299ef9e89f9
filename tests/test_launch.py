"""Launch modes: the torchrun command trainer-launch builds, its bad-environment errors, a real
trainer-launch run, and a Slurm-style world formed by plain processes without torchrun."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    BAD_INPUT_TIMEOUT_S,
    RUN_TIMEOUT_S,
    assert_usage_error,
    checkpoint_steps,
    clean_env,
    dirs_args,
    files_under,
    free_port,
    read_summary,
    skip_or_fail_in_ci,
    srun_task_env,
)

from trainer.cluster.launch import build_command, torchrun_command
from trainer.config import launcher
from trainer.cluster.topology import LAUNCHER, resolve
from trainer.core.errors import UsageError


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # build_command validates the training options too, which reads ./.env: keep that in a clean dir.
    monkeypatch.chdir(tmp_path)


def no_gpus() -> int:
    return 0


def test_single_node_defaults():
    assert build_command({}, ["--model", "cnn"], gpu_count=no_gpus).command == [
        "torchrun", "--nnodes=1", "--node-rank=0", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        "--master-port=29500", "--max-restarts=0", "--shutdown-timeout=55", "--rdzv-conf=timeout=900", "-m", "trainer", "--model", "cnn"]


def test_single_node_defaults_to_one_process_per_gpu():
    assert resolve({}, LAUNCHER, gpu_count=lambda: 4).nproc_per_node == 4


def test_multi_node():
    env = {"NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "4", "MASTER_ADDR": "10.0.0.5",
           "MASTER_PORT": "29400", "MAX_RESTARTS": "3", "RDZV_TIMEOUT": "60"}
    assert build_command(env, ["--epochs", "2", "--global-batch-size", "256"], gpu_count=no_gpus).command == [
        "torchrun", "--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--master-addr=10.0.0.5",
        "--master-port=29400", "--max-restarts=3", "--shutdown-timeout=55", "--rdzv-conf=timeout=60",
        "-m", "trainer", "--epochs", "2", "--global-batch-size", "256"]


def test_torchrun_command_of_a_topology():
    topology = resolve({"NNODES": "3", "NODE_RANK": "2", "MASTER_ADDR": "head"}, LAUNCHER, gpu_count=lambda: 8)
    assert topology.world_size == 24
    assert torchrun_command(topology, []) == [
        "torchrun", "--nnodes=3", "--node-rank=2", "--nproc-per-node=8", "--master-addr=head",
        "--master-port=29500", "--max-restarts=0", "--shutdown-timeout=55", "--rdzv-conf=timeout=900", "-m", "trainer"]


def test_rank_and_world_size_without_nnodes_run_one_worker():
    env = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"}
    assert build_command(env, ["--model", "cnn"], gpu_count=no_gpus).command == [
        sys.executable, "-m", "trainer", "--model", "cnn"]


def test_global_batch_is_checked_against_the_whole_world():
    env = {"NNODES": "2", "MASTER_ADDR": "10.0.0.5", "NPROC_PER_NODE": "3"}
    with pytest.raises(UsageError, match="world size 6"):
        build_command(env, ["--global-batch-size", "64"], gpu_count=no_gpus)


def test_more_processes_than_gpus():
    with pytest.raises(UsageError, match="NPROC_PER_NODE"):
        resolve({"NPROC_PER_NODE": "3"}, LAUNCHER, gpu_count=lambda: 2)


BAD_ENVIRONMENTS = {
    "node rank not below nnodes": ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK (explicit)"),
    "master addr missing on two nodes": ({"NNODES": "2", "NODE_RANK": "0"}, "MASTER_ADDR (explicit)"),
    "non-integer nnodes": ({"NNODES": "two"}, "NNODES (explicit)"),
    "zero processes": ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE (explicit)"),
    "port out of range": ({"MASTER_PORT": "70000"}, "MASTER_PORT (explicit)"),
    "bad training option": ({"TRAIN_LR": "x"}, "TRAIN_LR"),
    "preflight typo": ({"PREFLIGHT": "flase"}, "PREFLIGHT: 'flase' is not a boolean"),
}


@pytest.mark.parametrize("env, setting", BAD_ENVIRONMENTS.values(), ids=BAD_ENVIRONMENTS.keys())
def test_launcher_bad_environment_is_one_line_exit_2(tmp_path, env, setting):
    # A free port: a rendezvous port in use elsewhere on this machine is another (one-line) error.
    env = {"MASTER_PORT": str(free_port()), **env}
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", *dirs_args(tmp_path)], cwd=tmp_path,
                            env=clean_env(env), capture_output=True, text=True, timeout=BAD_INPUT_TIMEOUT_S)
    assert_usage_error(result, setting)
    assert files_under(tmp_path) == set()


def test_nccl_flag_without_a_gpu_is_the_workers_one_line(tmp_path):
    """Caught before torchrun starts (clean_env hides every GPU), in the words the worker uses."""
    env = clean_env({"MASTER_PORT": str(free_port())})
    run = [sys.executable, "-m", "trainer.cli.launch", "--backend", "nccl", *dirs_args(tmp_path)]
    result = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=BAD_INPUT_TIMEOUT_S)
    assert assert_usage_error(result, "--backend") == (
        "error: --backend: nccl needs a CUDA GPU and none is visible "
        "(use --backend gloo (or auto) on CPU hosts, or give the container GPUs)")
    assert "torchrun" not in result.stdout + result.stderr


@pytest.mark.parametrize("word, enabled", [("", True), ("1", True), ("Yes", True), (" on ", True),
                                           ("0", False), ("false", False), ("NO", False), ("off", False)])
def test_preflight_words(word, enabled):
    assert launcher.read({"PREFLIGHT": word}, elastic=False).preflight is enabled


def test_preflight_runs_the_doctor(tmp_path):
    env = clean_env({"PREFLIGHT": "yes", "GLOO_SOCKET_IFNAME": "nosuch0", "MASTER_PORT": str(free_port())})
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", *dirs_args(tmp_path)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=BAD_INPUT_TIMEOUT_S)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith("error: preflight: GLOO_SOCKET_IFNAME: "), result.stderr


@pytest.mark.slow
def test_trainer_launch_trains_with_two_processes(tmp_path):
    launcher = shutil.which("trainer-launch")
    if launcher is None:
        skip_or_fail_in_ci("trainer-launch is not installed (pip install -e .)")
    env = clean_env({"NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())})
    args = ["--model", "cnn", "--synthetic-size", "128", "--batch-size", "8", "--max-steps", "3",
            "--checkpoint-every", "0", *dirs_args(tmp_path)]
    result = subprocess.run([launcher, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    # It prints the exact command it execs.
    assert "+ torchrun --nnodes=1 --node-rank=0 --nproc-per-node=2" in result.stderr
    summary = read_summary(tmp_path / "runs")
    assert (summary["world_size"], summary["backend"], summary["global_step"]) == (2, "gloo", 3)
    assert checkpoint_steps(tmp_path / "checkpoints") == [3]


@pytest.mark.slow
def test_slurm_plain_processes_form_a_world_of_two(tmp_path):
    """What `srun --ntasks 2 python -m trainer` does: no torchrun, rank facts from SLURM_* variables."""
    port = str(free_port())
    args = [sys.executable, "-m", "trainer", "--model", "cnn", "--synthetic-size", "128", "--batch-size", "8",
            "--max-steps", "3", "--checkpoint-every", "0", "--num-workers", "0", *dirs_args(tmp_path)]
    workers = [
        subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=clean_env({**srun_task_env(rank, 2), "MASTER_PORT": port}))
        for rank in range(2)]
    try:
        outputs = [w.communicate(timeout=RUN_TIMEOUT_S) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    assert [w.returncode for w in workers] == [0, 0], [err[-3000:] for _, err in outputs]
    summary = read_summary(tmp_path / "runs")
    assert (summary["world_size"], summary["backend"], summary["global_step"]) == (2, "gloo", 3)
    assert summary["samples_seen"] == 3 * 8 * 2


def test_the_sbatch_scripts_signal_lead_time_holds_the_default_stop_grace_period():
    """One grace period end to end: Slurm's SIGTERM before the time limit (--signal=TERM@N) leaves the launcher's
    STOP_GRACE_PERIOD, its workers' share and its room, before the limit."""
    import re
    from pathlib import Path

    scripts = sorted((Path(__file__).parents[1] / "slurm").glob("*.sbatch"))
    assert scripts
    for script in scripts:
        lead = int(re.search(r"^#SBATCH --signal=TERM@(\d+)$", script.read_text(), re.M).group(1))
        assert lead >= launcher.grace_s({}), script


@pytest.mark.parametrize("line, setting", [
    ("NNODES=3:2", "NNODES (explicit, .env line 2): '3:2' runs backwards"),
    ("NPROC_PER_NODE=0", "NPROC_PER_NODE (explicit, .env line 2): 0 is out of range"),
    ("MASTER_PORT=99999", "MASTER_PORT (explicit, .env line 2): 99999 is out of range"),
    ("HANG_TIMEOUT=-1", "HANG_TIMEOUT (.env line 2): -1 is out of range"),
    ("STOP_GRACE_PERIOD=0", "STOP_GRACE_PERIOD (.env line 2): '0' leaves no time to stop"),
], ids=["NNODES", "NPROC_PER_NODE", "MASTER_PORT", "HANG_TIMEOUT", "STOP_GRACE_PERIOD"])
def test_launcher_settings_in_dotenv_count_and_a_bad_one_is_the_same_one_line_naming_the_file_and_line(tmp_path, line,
                                                                                                      setting):
    """.env holds the launcher's settings as Compose reads them (.env.example lists them): each one counts, checked
    as from the environment, its error naming the file and the line. Before: only the trainer read .env, and each
    of these trained and exited 0."""
    (tmp_path / ".env").write_text(f"# the launcher's settings\n{line}\nTRAIN_EPOCHS=1\n")
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", *dirs_args(tmp_path)], cwd=tmp_path,
                            env=clean_env({"MASTER_PORT": str(free_port())} if "MASTER_PORT" not in line else {}),
                            capture_output=True, text=True, timeout=BAD_INPUT_TIMEOUT_S)
    assert_usage_error(result, setting)
    assert files_under(tmp_path) == {Path(".env")}


def test_the_environment_wins_over_dotenv_as_in_compose(tmp_path):
    """A variable set in the environment wins over the file's (Compose's precedence); the file's are taken, with
    where they came from, when the environment has none."""
    (tmp_path / ".env").write_text("NPROC_PER_NODE=1\nHANG_TIMEOUT=-1\n")
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--dry-run", "--model", "cnn"], cwd=tmp_path,
                            env=clean_env({"HANG_TIMEOUT": "60"}), capture_output=True, text=True,
                            timeout=BAD_INPUT_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["nproc_per_node"] == 1 and facts["sources"]["nproc_per_node"] == "NPROC_PER_NODE (explicit, .env line 1)"
