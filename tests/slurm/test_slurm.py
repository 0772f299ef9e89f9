"""The sbatch scripts users get (slurm/), on a real Slurm: two nodes, two CPU processes each, gloo.

Only what a CPU site would change is changed, on sbatch's command line: no GPUs (--gres=none) and
two tasks of one CPU per node (one task of two CPUs in the one-task-per-node mode). The trainer
comes from the environment sbatch is run in, as a user's activated venv would. The cluster is
tests/slurmcluster.py's (fixtures in tests/conftest.py); the container script's test, which needs
the CPU image, is tests/containers/test_slurm_podman.py.
"""

from __future__ import annotations

import json
import re

import pytest

from fault_helpers import wait_until
from helpers import REPO, checkpoint_steps
from slurmcluster import FINISHED, JOB_BOUND_S, SlurmJob, user_shell

pytestmark = pytest.mark.slurm

PER_GPU = REPO / "slurm" / "train-per-gpu.sbatch"
PER_NODE = REPO / "slurm" / "train-per-node.sbatch"
CPU_PER_GPU = ["--gres=none", "--ntasks-per-node=2", "--cpus-per-task=1"]
CPU_PER_NODE = ["--gres=none", "--cpus-per-task=2"]


def training(samples: int, every: int = 5) -> list[str]:
    """A small CNN run (batch 16 per process, so 64 samples per step on 4 processes)."""
    return ["--model", "cnn", "--synthetic-size", str(samples), "--batch-size", "16", "--epochs", "1",
            "--checkpoint-every", str(every), "--log-every", str(every), "--warmup-steps", "2"]


def completed(job: SlurmJob, steps: int) -> dict:
    return job.assert_completed_on_both_nodes(job.root / "runs", job.root / "checkpoints", steps)


def wait_for_checkpoint(job: SlurmJob) -> None:
    wait_until(lambda: checkpoint_steps(job.root / "checkpoints") or job.info()["JobState"] in FINISHED,
               JOB_BOUND_S, f"job {job.id}'s first checkpoint")
    assert job.info()["JobState"] == "RUNNING", job.output()[-4000:]


def stopped_at(job: SlurmJob) -> int:
    return int(re.search(r"INFO stopped at step (\d+)", job.output()).group(1))


# ------------------------------------------------------------------ what the launcher reads from a real Slurm

def per_task(labelled: str) -> dict[int, str]:
    """srun --label's output (lines "<task>: ...", interleaved) split by task."""
    tasks: dict[int, list[str]] = {}
    for line in labelled.splitlines():
        task, _, text = line.partition(": ")
        tasks.setdefault(int(task), []).append(text)
    return {task: "\n".join(lines) for task, lines in tasks.items()}


def test_srun_trainer_launch_dry_run_resolves_each_node_from_slurms_own_variables(cluster, tmp_path):
    done = cluster.run(["srun", "--label", "--nodes=2", "--ntasks-per-node=1", "trainer-launch", "--dry-run"],
                       env=user_shell(), cwd=tmp_path)
    plans = sorted((json.loads(text) for text in per_task(done.stdout).values()), key=lambda plan: plan["node_rank"])
    assert [plan["node_rank"] for plan in plans] == [0, 1]
    for plan in plans:
        assert plan["source"] == "slurm" and plan["nnodes"] == 2 and plan["world_size"] == 4
        assert plan["master_addr"] == "node1"  # the first host of node[1-2], parsed without scontrol
        assert plans[0]["master_port"] == plan["master_port"] and 20000 <= plan["master_port"] < 29000
        assert plan["sources"]["node_rank"] == "SLURM_NODEID (slurm)"
    assert not checkpoint_steps(tmp_path / "checkpoints") and not (tmp_path / "runs").exists()  # nothing started


def test_trainer_launch_as_one_task_per_gpu_is_one_line_per_task_before_torchrun(cluster, tmp_path):
    done = cluster.run(["srun", "--nodes=2", "--ntasks-per-node=2", "trainer-launch"], env=user_shell(),
                       cwd=tmp_path, check=False)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 4 and len(set(errors)) == 1, done.stderr  # each task: the same one line, exit 2
    assert errors[0].startswith("error: SLURM_STEP_NUM_TASKS (slurm): 4 tasks on 2 node(s)")
    assert "Exited with exit code 2" in done.stderr and "Traceback" not in done.stderr + done.stdout


# ------------------------------------------------------------------ the two modes, to completion

def test_one_task_per_gpu_srun_python_m_trainer_trains_on_two_nodes(cluster, tmp_path):
    job = SlurmJob(cluster, tmp_path, [*CPU_PER_GPU, str(PER_GPU), *training(640)])
    assert completed(job, steps=10)["resumed_from_step"] is None
    assert "on node[1-2]: 4 training processes" in job.output()


def test_one_task_per_node_srun_trainer_launch_trains_on_two_nodes(cluster, tmp_path):
    job = SlurmJob(cluster, tmp_path, [*CPU_PER_NODE, str(PER_NODE), *training(640)])
    assert completed(job, steps=10)["resumed_from_step"] is None
    output = job.output()
    assert "trainer-launch on 2 nodes" in output
    for node_rank in (0, 1):  # each node's launcher resolved its place from Slurm's variables
        assert f"topology: nnodes=2 node_rank={node_rank} nproc_per_node=2 world_size=4 master=node1:" in output


# ------------------------------------------------------------------ stops, preemption, requeue

def test_a_stopped_job_requeues_itself_and_its_next_run_resumes_at_the_committed_step(cluster, tmp_path):
    """`scancel --signal=TERM` is what #SBATCH --signal=TERM@120 sends before the time limit. One task
    per node: the signal reaches torchrun and its workers."""
    job = SlurmJob(cluster, tmp_path, [*CPU_PER_NODE, str(PER_NODE), *training(3840)])  # 60 steps
    wait_for_checkpoint(job)
    cluster.run(["scancel", "--signal=TERM", job.id])
    # The run stops with a checkpoint, the script requeues the job and the next run finishes it.
    summary = completed(job, steps=60)
    assert job.info()["Restarts"] == "1"
    output = job.output()
    assert "requeueing job" in output and "(restart 1)" in output, output[-4000:]
    step = stopped_at(job)
    assert 0 < step < 60
    assert f"checkpoint committed: {tmp_path}/checkpoints/step-{step:08d}.pt" in output
    assert summary["resumed_from_step"] == step  # the exact step, not an earlier periodic checkpoint


def test_a_preempted_job_checkpoints_in_its_grace_time_and_resumes_when_requeued(cluster, tmp_path):
    job = SlurmJob(cluster, tmp_path, [*CPU_PER_GPU, str(PER_GPU), *training(3840)])
    wait_for_checkpoint(job)
    # A job in the higher-priority partition that needs the same CPUs preempts the training job.
    urgent = SlurmJob(cluster, tmp_path / "urgent", ["--partition=urgent", "--nodes=2", "--ntasks-per-node=2",
                                                     "--job-name=urgent", "--wrap=srun true"], name="urgent")
    summary = completed(job, steps=60)
    assert urgent.wait()["JobState"] == "COMPLETED"
    assert job.info()["Restarts"] == "1"
    assert summary["resumed_from_step"] == stopped_at(job)
