"""Your own training script: `trainer-launch my_train.py`, `-m mypkg.train` and TRAIN_SCRIPT run it on
every process under the same launcher as the built-in trainer, and trainer.api gives its loop the
built-in trainer's exact resume and SIGTERM stop. Real launcher, real torchrun, 2 gloo ranks.

The user script is tests/user_code/loop.py: it records the sample indices of every batch per rank.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import Launch, launcher_env, wait_until
from helpers import (
    BAD_INPUT_TIMEOUT_S,
    REPO,
    RUN_TIMEOUT_S,
    assert_same_params,
    assert_usage_error,
    checkpoint_steps,
    clean_env,
    files_under,
    free_port,
    load_checkpoint,
    read_scalars,
    read_summary,
    srun_task_env,
)
from torch.utils.data import DistributedSampler

from trainer.checkpoint.store import list_checkpoints
from trainer.cluster.launch import build_command
from trainer.data.sampling import ResumableSampler

LOOP = REPO / "tests" / "user_code" / "loop.py"
# 48 samples, 2 ranks, batches of 4: 6 steps per epoch.
STEPS_PER_EPOCH = 6


def launch(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """`python -m trainer.cli.launch ARGS` (what the trainer-launch entry point runs), 2 CPU processes."""
    return subprocess.run([sys.executable, "-m", "trainer.cli.launch", *args], cwd=cwd,
                          env=clean_env(launcher_env(free_port(), **env)), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def launch_ok(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    result = launch(args, cwd, **env)
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-4000:]}"
    return result


def seen(out: Path, rank: int) -> list[list[int]]:
    """The batches (their sample indices) a rank trained on, in order, over every run into `out`."""
    path = out / f"seen-rank{rank}.txt"
    return [[int(i) for i in line.split()] for line in path.read_text().splitlines()] if path.exists() else []


def final_model(out: Path) -> dict:
    return load_checkpoint(list_checkpoints(out / "checkpoints")[0])["model"]


def user_package(root: Path) -> Path:
    """mypkg/train.py under root: the user's script, importable from the working directory, with the
    helper module it imports (numbered.py) where each form puts sys.path[0]: beside the script for a
    path, the working directory for `-m`."""
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    shutil.copy(LOOP, root / "mypkg" / "train.py")
    for where in (root, root / "mypkg"):
        shutil.copy(LOOP.with_name("numbered.py"), where / "numbered.py")
    return root


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """Two epochs of the user script, start to finish, by path: the reference the other runs must match."""
    out = tmp_path_factory.mktemp("uninterrupted")
    return out, launch_ok([str(LOOP), "--out", str(out), "--epochs", "2"], out)


# ------------------------------------------------------------------ the launcher runs the user's code

def test_script_command_is_torchrun_with_the_script_and_its_own_arguments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_train.py").write_text("")
    launch = build_command({}, ["my_train.py", "--lr", "x"], gpu_count=lambda: 0)
    assert launch.command[-4:] == ["--rdzv-conf=timeout=900", "my_train.py", "--lr", "x"]  # not the trainer's --lr check
    assert launch.cfg is None and launch.topology.world_size == 2
    user_package(tmp_path)
    assert build_command({"TRAIN_SCRIPT": "-m mypkg.train"}, ["--epochs", "1"], gpu_count=lambda: 0).command[-4:] == [
        "-m", "mypkg.train", "--epochs", "1"]


@pytest.mark.slow
def test_script_runs_on_two_processes_to_completion(uninterrupted):
    out, result = uninterrupted
    assert "+ torchrun --nnodes=1 --node-rank=0 --nproc-per-node=2" in result.stderr
    assert f"{LOOP} --out {out} --epochs 2" in result.stderr
    first, second = seen(out, 0), seen(out, 1)
    assert len(first) == len(second) == 2 * STEPS_PER_EPOCH
    for epoch in range(2):  # the ranks split each epoch's samples between them, none twice
        batches = first[epoch * STEPS_PER_EPOCH:][:STEPS_PER_EPOCH] + second[epoch * STEPS_PER_EPOCH:][:STEPS_PER_EPOCH]
        assert sorted(i for batch in batches for i in batch) == list(range(48))
    assert checkpoint_steps(out / "checkpoints") == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]  # the epoch ends
    # every log_every (10) steps, and the last, as the built-in loop logs
    assert [step for step, _ in read_scalars(out / "runs")["Loss/train"]] == [10, 12]


@pytest.mark.slow
def test_module_form_runs_a_module_from_the_working_directory(tmp_path):
    user_package(tmp_path)
    result = launch_ok(["-m", "mypkg.train", "--out", ".", "--epochs", "1"], tmp_path)
    assert "--rdzv-conf=timeout=900 -m mypkg.train --out . --epochs 1" in result.stderr
    assert len(seen(tmp_path, 0)) == len(seen(tmp_path, 1)) == STEPS_PER_EPOCH


@pytest.mark.slow
@pytest.mark.parametrize("form", ["path", "-m module"])
def test_train_script_selects_the_script_when_the_command_line_names_none(tmp_path, form):
    user_package(tmp_path)
    script = "mypkg/train.py" if form == "path" else "-m mypkg.train"
    launch_ok(["--out", ".", "--epochs", "1"], tmp_path, TRAIN_SCRIPT=script)
    assert len(seen(tmp_path, 0)) == len(seen(tmp_path, 1)) == STEPS_PER_EPOCH


BAD_SCRIPTS = {
    "missing script": ([["nosuch.py"]], {}, "script: 'nosuch.py' (in "),
    "a directory": ([["mypkg"]], {}, "script: 'mypkg' (in "),
    "missing module": ([["-m", "mypkg.nosuch"]], {}, "-m: no module named 'mypkg.nosuch'"),
    "missing package": ([["-m", "nopkg.train"]], {}, "-m: no module named 'nopkg.train'"),
    "package without __main__": ([["-m", "mypkg"]], {}, "-m: no module named 'mypkg'"),
    "a file given to -m": ([["-m", "mypkg/train.py"]], {}, "-m: no module named 'mypkg/train.py' (for a file, drop -m"),
    "-m alone": ([["-m"]], {}, "-m: names no module"),
    "TRAIN_SCRIPT missing file": ([[]], {"TRAIN_SCRIPT": "/nowhere/train.py"},
                                  "TRAIN_SCRIPT: '/nowhere/train.py' does"),
    "TRAIN_SCRIPT missing module": ([[]], {"TRAIN_SCRIPT": "-m mypkg.nosuch"}, "TRAIN_SCRIPT: no module named"),
    "TRAIN_SCRIPT with arguments": ([[]], {"TRAIN_SCRIPT": "-m mypkg.train --lr 1"}, "TRAIN_SCRIPT: '-m mypkg.train"),
}


@pytest.mark.parametrize("args, env, error", BAD_SCRIPTS.values(), ids=BAD_SCRIPTS.keys())
def test_bad_script_is_one_line_exit_2_before_torchrun(tmp_path, args, env, error):
    user_package(tmp_path)
    before = files_under(tmp_path)
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", *args[0], "--out", "."], cwd=tmp_path,
                            env=clean_env(launcher_env(free_port(), **env)), capture_output=True, text=True,
                            timeout=BAD_INPUT_TIMEOUT_S)
    line = assert_usage_error(result, error.split(":")[0])
    assert line.startswith(f"error: {error}"), line
    assert "torchrun" not in result.stderr
    assert files_under(tmp_path) == before  # not even the __pycache__ of the packages it looked into


def test_train_script_is_a_launcher_setting_not_an_unknown_training_option(tmp_path):
    """The worker reads TRAIN_* names strictly (a typo is an error); TRAIN_SCRIPT is the launcher's. The
    names are checked before the values, so a bad --lr is the error only once every name passed."""
    def worker(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trainer", "--lr", "-1"], cwd=tmp_path,
                              env=clean_env({name: "train.py"}), capture_output=True, text=True,
                              timeout=BAD_INPUT_TIMEOUT_S)

    assert_usage_error(worker("TRAIN_SCRIPT"), "--lr")
    assert_usage_error(worker("TRAIN_SCRIPTS"), "TRAIN_SCRIPTS")


def test_preflight_checks_the_host_for_a_script_not_the_built_in_trainers_options(tmp_path):
    """The doctor's host and network checks run before a script too; the built-in trainer's options
    (here a checkpoint directory that could not be written) are not the script's and are not read."""
    (tmp_path / "my_train.py").write_text("")
    env = launcher_env(free_port(), PREFLIGHT="1", GLOO_SOCKET_IFNAME="nosuch0", TRAIN_CHECKPOINT_DIR="/proc/no")
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "my_train.py"], cwd=tmp_path, env=clean_env(env),
                            capture_output=True, text=True, timeout=BAD_INPUT_TIMEOUT_S)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith("error: preflight: GLOO_SOCKET_IFNAME: "), result.stderr
    assert "checkpoint dir" not in result.stderr and "torchrun" not in result.stderr


def test_launcher_help_documents_the_script_forms():
    result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--help"], env=clean_env(), capture_output=True,
                            text=True, timeout=BAD_INPUT_TIMEOUT_S)
    assert result.returncode == 0
    for form in ("trainer-launch my_train.py [ARGS]", "trainer-launch -m mypkg.train [ARGS]", "TRAIN_SCRIPT"):
        assert form in result.stdout


@pytest.mark.slow
def test_the_api_joins_slurm_and_single_process_worlds_too(tmp_path):
    """The same script without torchrun: two plain processes as `srun --ntasks 2` starts them (rank facts
    from SLURM_* variables), then one plain process, which trains on the whole data set alone."""
    port = str(free_port())
    (tmp_path / "slurm").mkdir()
    slurm = [subprocess.Popen([sys.executable, str(LOOP), "--out", "slurm", "--epochs", "1"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=clean_env({**srun_task_env(rank, 2), "MASTER_PORT": port}))
             for rank in range(2)]
    try:
        outputs = [worker.communicate(timeout=RUN_TIMEOUT_S)[0] for worker in slurm]
    finally:
        for worker in slurm:
            if worker.poll() is None:
                worker.kill()
    assert [w.returncode for w in slurm] == [0, 0], [out[-2000:] for out in outputs]
    assert len(seen(tmp_path / "slurm", 0)) == len(seen(tmp_path / "slurm", 1)) == STEPS_PER_EPOCH

    (tmp_path / "alone").mkdir()
    alone = subprocess.run([sys.executable, str(LOOP), "--out", "alone", "--epochs", "1"], cwd=tmp_path,
                           env=clean_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert sorted(i for batch in seen(tmp_path / "alone", 0) for i in batch) == list(range(48))


def test_the_apis_process_group_that_cannot_form_is_one_line(tmp_path):
    """As for the built-in worker: a rendezvous port already taken is one line and exit 1, no traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, str(LOOP), "--out", "."], cwd=tmp_path, capture_output=True,
                                text=True, timeout=RUN_TIMEOUT_S,
                                env=clean_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(port)}))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: rendezvous at 127.0.0.1:{port}: ")
    assert "collective_timeout, now 300 s" in result.stderr
    assert files_under(tmp_path) == set()


# ------------------------------------------------------------------ failures inside user code

@pytest.mark.slow
def test_script_that_raises_keeps_its_traceback_then_the_rank_summary_and_its_checkpoints(tmp_path):
    result = launch([str(LOOP), "--out", ".", "--checkpoint-every", "2", "--fail-at-step", "4"], tmp_path)
    assert result.returncode == 1, result.stderr[-4000:]
    assert "Traceback (most recent call last)" in result.stderr
    assert 'loop.py", line' in result.stderr and "RuntimeError: user code failed in step 4" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training failed: rank 1 exited with code 1"), result.stderr[-4000:]
    # What was committed before the failure is whole, and the next run goes on from it.
    assert checkpoint_steps(tmp_path / "checkpoints") == [2]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    again = launch_ok([str(LOOP), "--out", ".", "--epochs", "1"], tmp_path)
    assert "resuming from checkpoints/step-00000002.pt (step 2, epoch 0, batch 2)" in again.stderr


# ------------------------------------------------------------------ exact resume and the SIGTERM stop

@pytest.mark.parametrize("size, world_size, batch_size", [(50, 2, 4), (48, 3, 5), (7, 1, 7)])
def test_resumable_sampler_is_torchs_distributed_order_from_the_resume_batch(size, world_size, batch_size):
    """The order users know (DistributedSampler, shuffle, seed, drop_last) in whole batches; an epoch
    begun at batch b yields exactly what the whole epoch yields from batch b on."""
    for rank in range(world_size):
        for epoch in (0, 3):
            torchs = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=True, seed=7,
                                        drop_last=True)
            torchs.set_epoch(epoch)
            whole = list(torchs)[:len(list(torchs)) // batch_size * batch_size]
            sampler = ResumableSampler(size, batch_size, rank, world_size, seed=7)
            sampler.set_epoch(epoch)
            assert list(sampler) == whole and len(sampler) == len(whole)
            for start in range(sampler.batches_per_epoch + 1):
                sampler.set_epoch(epoch, start)
                assert list(sampler) == whole[start * batch_size:]


@pytest.mark.slow
def test_sigterm_checkpoints_exits_0_and_the_next_run_resumes_exactly(tmp_path, uninterrupted):
    """A stop mid-epoch, then a resume: the same parameters bit for bit as the uninterrupted run, and
    every rank trains on exactly the batches it would have, none replayed or skipped."""
    reference, _ = uninterrupted
    args = [str(LOOP), "--out", ".", "--epochs", "2"]
    stopped = Launch([*args, "--step-seconds", "0.3"], tmp_path, launcher_env(free_port()))
    try:
        wait_until(lambda: len(seen(tmp_path, 0)) >= 3, 120, "three steps trained")
        os.kill(stopped.pid, signal.SIGTERM)
        assert stopped.wait(60) == 0, stopped.output()[-4000:]
    finally:
        if stopped.proc.poll() is None:
            stopped.stop_everything()
    steps = checkpoint_steps(tmp_path / "checkpoints")
    stop_step = steps[-1]
    assert 3 <= stop_step < 2 * STEPS_PER_EPOCH - 1 and stop_step % STEPS_PER_EPOCH, stopped.output()[-3000:]
    assert "received SIGTERM" in stopped.output()
    assert [len(seen(tmp_path, rank)) for rank in (0, 1)] == [stop_step, stop_step]  # both stopped at that step

    resumed = launch_ok(args, tmp_path)
    assert f"resuming from checkpoints/step-{stop_step:08d}.pt (step {stop_step}" in resumed.stderr
    for rank in (0, 1):
        assert seen(tmp_path, rank) == seen(reference, rank)  # stopped run + resumed run, batch by batch
    assert_same_params(final_model(tmp_path), final_model(reference))
    assert load_checkpoint(list_checkpoints(tmp_path / "checkpoints")[0])["global_step"] == 2 * STEPS_PER_EPOCH


# ------------------------------------------------------------------ examples/, as their READMEs run them

def readme_script() -> tuple[str, dict[str, str], list[str]]:
    """The complete trainer.api script docs/your-code.md shows (the python block after its marker), and the
    command line that runs it (the bash block after that): its TRAIN_* variables and its arguments."""
    text = (REPO / "docs" / "your-code.md").read_text()
    block = text.split("<!-- the trainer.api script: tests/test_scripts.py runs this block -->", 1)[1]
    script, rest = block.split("```python\n", 1)[1].split("\n```", 1)
    command = rest.split("```bash\n", 1)[1].split("\n```", 1)[0].split("#")[0].split()
    env = dict(word.split("=", 1) for word in command if "=" in word)
    args = command[command.index("trainer-launch") + 1:]
    return script, env, args


@pytest.mark.slow
def test_the_readme_script_runs_as_shown_and_resumes_a_finished_run_as_finished(tmp_path):
    """fsdp, two trackers and step timing from the TRAIN_* settings of docs/your-code.md's command line alone."""
    script, env, args = readme_script()
    assert 30 <= len(script.splitlines()) <= 45  # the page promises a short script
    assert env == {"TRAIN_STRATEGY": "fsdp", "TRAIN_TRACKER": "tensorboard,csv"} and args == ["train.py"]
    (tmp_path / "train.py").write_text(script)
    result = launch_ok(args, tmp_path, **env)
    assert "epoch 4 done at step 160: val acc1 " in result.stdout  # 4096 samples / 2 ranks / 64: 32 steps an epoch
    committed = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert committed == ["step-00000160", "step-00000128", "step-00000096"]  # sharded: directories, newest 3 kept
    summary = read_summary(tmp_path / "runs")
    assert (summary["status"], summary["strategy"], summary["world_size"]) == ("completed", "fsdp", 2)
    assert [row["rank"] for row in summary["ranks"]] == [0, 1] and summary["val_acc1"] is not None
    assert (tmp_path / "runs" / "metrics.csv").is_file() and "Loss/train" in read_scalars(tmp_path / "runs")
    written = {p.name: p.read_bytes() for p in (tmp_path / "runs").iterdir()}
    again = launch_ok(args, tmp_path, **env)
    assert "resuming from checkpoints/step-00000160 (step 160, epoch 5, batch 0)" in again.stderr
    assert "nothing to do: checkpoints/step-00000160 is at step 160" in again.stderr
    assert "done at step" not in again.stdout
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == committed
    # The finished run's results stay as they were: summary.json, metrics.csv, no new event file.
    assert {p.name: p.read_bytes() for p in (tmp_path / "runs").iterdir()} == written


@pytest.mark.slow
def test_example_cifar_resnet_script(tmp_path):
    result = launch_ok([str(REPO / "examples/cifar_resnet_script/train.py"), "--epochs", "1", "--samples", "128",
                        "--batch-size", "16", "--checkpoint-every", "0"], tmp_path)
    assert "epoch 0: step 4, val acc1" in result.stdout
    state = load_checkpoint(list_checkpoints(tmp_path / "checkpoints")[0])
    assert state["global_step"] == 4 and state["model"]["fc.weight"].shape == (10, 512)


@pytest.mark.slow
def test_example_lightning_module_and_data_module(tmp_path):
    result = launch_ok([str(REPO / "examples/lightning_cifar/train.py"), "--max-epochs", "1", "--samples", "128",
                        "--batch-size", "16"], tmp_path)
    assert "Starting with 2 processes" in result.stdout + result.stderr
    assert [p.name for p in tmp_path.glob("lightning_logs/version_0/checkpoints/*.ckpt")] == ["epoch=0-step=4.ckpt"]
