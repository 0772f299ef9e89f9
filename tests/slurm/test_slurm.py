"""The sbatch scripts users get (slurm/), on a real Slurm: two nodes, two CPU processes each, gloo.

Only what a CPU site would change is changed, on sbatch's command line: no GPUs (--gres=none) and
two tasks of one CPU per node (one task of two CPUs in the one-task-per-node mode). The trainer
comes from the environment sbatch is run in, as a user's activated venv would.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from fault_helpers import wait_until
from helpers import REPO, checkpoint_steps, clean_env, read_summary

SCRIPTS = REPO / "slurm"
PER_GPU = SCRIPTS / "train-per-gpu.sbatch"
PER_NODE = SCRIPTS / "train-per-node.sbatch"
CPU_PER_GPU = ["--gres=none", "--ntasks-per-node=2", "--cpus-per-task=1"]
CPU_PER_NODE = ["--gres=none", "--cpus-per-task=2"]
JOB_BOUND_S = 180  # a hang becomes a failure; runs here take 20-60 s on a loaded 2-core runner
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def training(samples: int, every: int = 5) -> list[str]:
    """A small CNN run (batch 16 per process, so 64 samples per step on 4 processes)."""
    return ["--model", "cnn", "--synthetic-size", str(samples), "--batch-size", "16", "--epochs", "1",
            "--checkpoint-every", str(every), "--log-every", str(every), "--warmup-steps", "2"]


class Job:
    def __init__(self, cluster, root: Path, sbatch_args: list[str]):
        self.cluster, self.root = cluster, root
        root.mkdir(exist_ok=True)
        # The user's shell: an activated venv (its bin first on PATH); sbatch hands it to the job.
        env = clean_env({"PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])})
        done = cluster.run(["sbatch", "--parsable", *sbatch_args], env=env, cwd=root)
        self.id = done.stdout.strip().split(";")[0]

    def info(self) -> dict[str, str]:
        done = self.cluster.run(["scontrol", "show", "job", "--oneliner", self.id])
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def output(self) -> str:
        path = self.root / f"ddp-train-{self.id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, bound_s: float = JOB_BOUND_S) -> dict[str, str]:
        try:
            return wait_until(lambda: (info := self.info())["JobState"] in FINISHED and info, bound_s,
                              f"job {self.id} to finish")
        except AssertionError as err:
            raise AssertionError(f"{err}: {self.info()}\n{self.output()[-4000:]}\n{self.cluster.logs()}") from None

    def wait_for_checkpoint(self, bound_s: float = JOB_BOUND_S) -> None:
        wait_until(lambda: checkpoint_steps(self.root / "checkpoints") or self.info()["JobState"] in FINISHED,
                   bound_s, f"job {self.id}'s first checkpoint")
        assert self.info()["JobState"] == "RUNNING", self.output()[-4000:]


def assert_completed_on_both_nodes(job: Job, info: dict[str, str], steps: int) -> dict:
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{job.output()[-4000:]}"
    assert info["NodeList"] == "node[1-2]" and info["NumNodes"] == "2", info
    summary = read_summary(job.root / "runs")
    assert summary["status"] == "completed" and summary["world_size"] == 4 and summary["backend"] == "gloo"
    assert summary["global_step"] == steps and checkpoint_steps(job.root / "checkpoints")[-1] == steps
    return summary


# ------------------------------------------------------------------ the two modes, to completion

def test_one_task_per_gpu_srun_python_m_trainer_trains_on_two_nodes(cluster, tmp_path):
    job = Job(cluster, tmp_path, [*CPU_PER_GPU, str(PER_GPU), *training(640)])
    summary = assert_completed_on_both_nodes(job, job.wait(), steps=10)
    assert summary["resumed_from_step"] is None
    assert "on node[1-2]: 4 training processes" in job.output()


def test_one_task_per_node_srun_trainer_launch_trains_on_two_nodes(cluster, tmp_path):
    job = Job(cluster, tmp_path, [*CPU_PER_NODE, str(PER_NODE), *training(640)])
    summary = assert_completed_on_both_nodes(job, job.wait(), steps=10)
    assert summary["resumed_from_step"] is None
    assert "trainer-launch on 2 nodes" in job.output()


# ------------------------------------------------------------------ stops, preemption, requeue

def test_a_stopped_job_requeues_itself_and_its_next_run_resumes_at_the_committed_step(cluster, tmp_path):
    """`scancel --signal=TERM` is what #SBATCH --signal=TERM@120 sends before the time limit. One task
    per node: the signal reaches torchrun and its workers."""
    job = Job(cluster, tmp_path, [*CPU_PER_NODE, str(PER_NODE), *training(3840)])  # 60 steps
    job.wait_for_checkpoint()
    cluster.run(["scancel", "--signal=TERM", job.id])
    # The run stops with a checkpoint, the script requeues the job and the next run finishes it.
    info = job.wait()
    summary = assert_completed_on_both_nodes(job, info, steps=60)
    assert info["Restarts"] == "1", info
    output = job.output()
    assert "requeueing job" in output and "(restart 1)" in output, output[-4000:]
    stopped_at = int(re.search(r"INFO stopped at step (\d+)", output).group(1))
    assert 0 < stopped_at < 60
    assert f"checkpoint committed: {tmp_path}/checkpoints/step-{stopped_at:08d}.pt" in output
    assert summary["resumed_from_step"] == stopped_at  # the exact step, not an earlier periodic checkpoint


def test_a_preempted_job_checkpoints_in_its_grace_time_and_resumes_when_requeued(cluster, tmp_path):
    job = Job(cluster, tmp_path, [*CPU_PER_GPU, str(PER_GPU), *training(3840)])
    job.wait_for_checkpoint()
    # A job in the higher-priority partition that needs the same CPUs preempts the training job.
    urgent = Job(cluster, tmp_path / "urgent", ["--partition=urgent", "--nodes=2", "--ntasks-per-node=2",
                                                "--job-name=ddp-train", "--wrap=srun true"])
    info = job.wait()
    summary = assert_completed_on_both_nodes(job, info, steps=60)
    assert urgent.info()["JobState"] == "COMPLETED"
    assert info["Restarts"] == "1", info
    output = job.output()
    stopped_at = int(re.search(r"INFO stopped at step (\d+)", output).group(1))
    assert summary["resumed_from_step"] == stopped_at
