"""The topology resolver (trainer/cluster/topology.py), grouped by promise:

- each controller's own variables give the topology that controller means (the environments below are
  what the controllers set, from their source: kubeflow/training-operator pkg/controller.v1/pytorch
  envvar.go + master.go (PyTorchJob v1), kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go
  (Trainer v2), Slurm's src/common/env.c and srun(1)/sbatch(1), SkyPilot's distributed-jobs docs);
- the documented order decides who wins, and settings that contradict each other are one line naming both;
- Slurm hostlists are read as Slurm writes them;
- every variable it reads, malformed, is one line and exit 2 before torchrun starts;
- `trainer-launch --dry-run` prints the resolved topology as one JSON object and starts nothing;
- real trainings started with exactly a controller's variables form one world across two launchers.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fault_helpers import Launch, tiny_run
from helpers import (
    BAD_INPUT_TIMEOUT_S,
    RUN_TIMEOUT_S,
    checkpoint_steps,
    clean_env,
    files_under,
    free_port,
    read_summary,
    srun_task_env,
)

from trainer.cluster.topology import (
    DEFAULT_MASTER_PORT,
    DIRECT,
    LAUNCHER,
    TORCHRUN,
    WORKER,
    expand_hostlist,
    first_host,
    resolve,
    slurm_port,
)
from trainer.core.errors import UsageError

LAUNCH = [sys.executable, "-m", "trainer.cli.launch"]


def no_gpus() -> int:
    return 0


def facts(topology) -> tuple:
    return (topology.mode, topology.nnodes, topology.node_rank, topology.nproc_per_node, topology.world_size,
            topology.master_addr, topology.master_port)


# ------------------------------------------------------------------ what each controller sets

def pytorchjob_v1(node: int, nodes: int = 2, nproc: str = "2", addr: str = "job-master-0", port: int = 23456) -> dict:
    """A PyTorchJob v1 pod: Master replica (node 0) + Workers; RANK is the replica's NODE index (workers
    count from 1), WORLD_SIZE = replicas x nprocPerNode (1 if nprocPerNode is a word), and the PET_*."""
    per = int(nproc) if nproc.isdigit() else 1
    return {"PYTHONUNBUFFERED": "0", "MASTER_PORT": str(port), "MASTER_ADDR": addr, "WORLD_SIZE": str(nodes * per),
            "RANK": str(node), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(node), "PET_NNODES": str(nodes)}


def trainer_v2(node: int, nodes: int = 2, nproc: str = "3") -> dict:
    """A Kubeflow Trainer v2 TrainJob pod (torch runtime): a JobSet's Indexed Job, so Kubernetes also sets
    JOB_COMPLETION_INDEX, which PET_NODE_RANK is read from; master port 29400."""
    return {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": "mnist-node-0-0.mnist", "PET_MASTER_PORT": "29400", "JOB_COMPLETION_INDEX": str(node)}


def srun_per_node(node: int, nodes: int = 2, job_id: int = 81234, nodelist: str = "gpu[07-08]") -> dict:
    """`srun --ntasks-per-node=1 trainer-launch` inside `sbatch -N <nodes>`: one task per node."""
    return {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": nodelist, "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_STEP_NUM_TASKS": str(nodes), "SLURM_STEP_TASKS_PER_NODE": f"1(x{nodes})",
            "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(nodes), "SLURM_TASKS_PER_NODE": f"1(x{nodes})",
            "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0"}


def sbatch_script(nodes: int = 2, ntasks: int | None = None) -> dict:
    """The batch script itself (no srun): no SLURM_STEP_ID (sbatch(1) OUTPUT ENVIRONMENT VARIABLES)."""
    env = {"SLURM_JOB_ID": "81234", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": str(nodes),
           "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    return env | ({"SLURM_NTASKS": str(ntasks)} if ntasks else {})


def skypilot(node: int) -> dict:
    return {"SKYPILOT_NODE_RANK": str(node), "SKYPILOT_NODE_IPS": "10.0.0.11\n10.0.0.12\n", "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "4", "SKYPILOT_TASK_ID": "sky-2026-11-26-x"}


def indexed_job(index: int) -> dict:
    """A plain Indexed Job + headless Service: the manifest gives NNODES and MASTER_ADDR."""
    return {"JOB_COMPLETION_INDEX": str(index), "NNODES": "2", "MASTER_ADDR": "train-0.train"}


CONTROLLERS = {
    "one host": ({}, (TORCHRUN, 1, 0, 2, 2, "127.0.0.1", DEFAULT_MASTER_PORT), "default"),
    "explicit": ({"NNODES": "2", "NODE_RANK": "1", "NPROC_PER_NODE": "4", "MASTER_ADDR": "10.0.0.5",
                  "MASTER_PORT": "29400"}, (TORCHRUN, 2, 1, 4, 8, "10.0.0.5", 29400), "explicit"),
    "Trainer v2 PET_*": (trainer_v2(1), (TORCHRUN, 2, 1, 3, 6, "mnist-node-0-0.mnist", 29400),
                         "torchrun-env"),
    "PyTorchJob v1 master": (pytorchjob_v1(0), (TORCHRUN, 2, 0, 2, 4, "job-master-0", 23456), "pytorchjob"),
    "PyTorchJob v1 worker": (pytorchjob_v1(1), (TORCHRUN, 2, 1, 2, 4, "job-master-0", 23456), "pytorchjob"),
    "Slurm one task per node": (srun_per_node(1), (TORCHRUN, 2, 1, 2, 4, "gpu07", slurm_port(81234)), "slurm"),
    "Slurm batch script, one node": (sbatch_script(nodes=1), (TORCHRUN, 1, 0, 2, 2, "gpu07", slurm_port(81234)),
                                     "slurm"),
    "Indexed Job": (indexed_job(1), (TORCHRUN, 2, 1, 2, 4, "train-0.train", DEFAULT_MASTER_PORT),
                    "explicit+indexed-job"),
    "RANK and WORLD_SIZE alone": ({"RANK": "2", "WORLD_SIZE": "3"}, (DIRECT, 3, 2, 1, 3, "127.0.0.1", 29500),
                                  "explicit"),
}


class TestEachControllerGivesTheTopologyItMeans:
    @pytest.mark.parametrize("env, expected, source", CONTROLLERS.values(), ids=CONTROLLERS.keys())
    def test_launcher_reads(self, env, expected, source):
        topology = resolve(env, LAUNCHER, no_gpus)
        assert facts(topology) == expected
        assert topology.source == source

    def test_skypilot_one_process_per_gpu_and_the_first_ip_as_master(self):
        topology = resolve(skypilot(1), LAUNCHER, lambda: 4)
        assert facts(topology) == (TORCHRUN, 2, 1, 4, 8, "10.0.0.11", DEFAULT_MASTER_PORT)
        assert topology.sources["master_addr"] == "SKYPILOT_NODE_IPS (skypilot)"
        with pytest.raises(UsageError, match=re.escape("SKYPILOT_NUM_GPUS_PER_NODE (skypilot): 4 processes but "
                                                       "only 2 GPUs are visible")):
            resolve(skypilot(1), LAUNCHER, lambda: 2)

    def test_pytorchjob_rank_is_the_node_rank_not_the_process_rank(self):
        """The rule 'RANK and WORLD_SIZE without NNODES: one worker' read PyTorchJob's node index as a
        process rank: pod 1 of 2 with 2 processes each would have been rank 1 of 4, alone."""
        topology = resolve(pytorchjob_v1(1), LAUNCHER, no_gpus)
        assert topology.mode == TORCHRUN
        assert (topology.node_rank, topology.rank, topology.world_size) == (1, 2, 4)  # its first worker is rank 2
        assert topology.sources["node_rank"] == "PET_NODE_RANK (pytorchjob)"

    def test_pytorchjob_nproc_auto_counts_like_torchrun(self):
        """nprocPerNode 'auto' (the controller's default): the controller counted 1 process per pod in
        WORLD_SIZE; torchrun's auto is one per GPU."""
        assert facts(resolve(pytorchjob_v1(1, nproc="auto"), LAUNCHER, lambda: 4))[:5] == (TORCHRUN, 2, 1, 4, 8)

    def test_pytorchjob_pod_running_the_worker_itself_is_its_rank(self):
        """`python -m trainer` as the pod's command (one process per pod, nprocPerNode auto)."""
        topology = resolve(pytorchjob_v1(1, nproc="auto"), WORKER)
        assert (topology.mode, topology.rank, topology.world_size, topology.started_by) == (DIRECT, 1, 2, "pytorchjob")

    def test_slurm_one_task_per_gpu_worker(self):
        env = srun_task_env(3, 4) | {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n[1-2]",
                                     "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1",
                                     "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
        topology = resolve(env, WORKER)
        assert (topology.rank, topology.local_rank, topology.world_size, topology.local_world_size) == (3, 1, 4, 2)
        assert (topology.master_addr, topology.master_port, topology.started_by) == ("n1", slurm_port(4242), "slurm")

    def test_slurm_uneven_tasks_per_node(self):
        env = srun_task_env(4, 5) | {"SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1",
                                     "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "4,1"}
        assert resolve(env, WORKER).local_world_size == 1

    @pytest.mark.parametrize("inherited", [srun_per_node(1), pytorchjob_v1(1), trainer_v2(1), skypilot(1)],
                             ids=["slurm", "pytorchjob", "trainer-v2", "skypilot"])
    def test_a_worker_torchrun_started_trusts_torchrun(self, inherited):
        """torchrun's workers inherit the node's SLURM_*/PET_*/RANK; their own rank is torchrun's."""
        env = inherited | {"TORCHELASTIC_RUN_ID": "none", "GROUP_RANK": "1", "RANK": "3", "LOCAL_RANK": "1",
                           "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
        topology = resolve(env, WORKER)
        assert (topology.rank, topology.local_rank, topology.world_size, topology.local_world_size,
                topology.node_rank, topology.started_by) == (3, 1, 4, 2, 1, "torchrun")
        assert (topology.master_addr, topology.master_port) == ("10.0.0.1", 1234)

    def test_an_indexed_job_of_independent_runs(self):
        """NNODES=1: every index is a run of its own (a sweep), not a node of one run."""
        topology = resolve({"JOB_COMPLETION_INDEX": "3", "NNODES": "1"}, LAUNCHER, no_gpus)
        assert facts(topology)[:3] == (TORCHRUN, 1, 0)

    @pytest.mark.parametrize("env, line", [
        ({"NNODES": "2", "MASTER_ADDR": "h"}, "NNODES (explicit): 2 nodes, but `python -m trainer` is a single process"),
        (trainer_v2(0), "PET_NNODES (torchrun-env): 2 nodes, but `python -m trainer` is a single process"),
        (pytorchjob_v1(0), "PET_NPROC_PER_NODE (pytorchjob): 2 processes per pod, but `python -m trainer` is one"),
        (sbatch_script(nodes=1, ntasks=4), "SLURM_NTASKS (slurm): 4 tasks, but this process runs in the batch script"),
    ], ids=["explicit", "trainer-v2", "pytorchjob nproc 2", "sbatch script"])
    def test_a_worker_started_where_a_launcher_belongs_says_so(self, env, line):
        """Not a world of one that trains alone while the other nodes wait: the command to use instead."""
        with pytest.raises(UsageError) as caught:
            resolve(env, WORKER)
        assert str(caught.value).startswith(line)

    def test_a_lone_worker_is_one_process(self):
        topology = resolve({}, WORKER)
        assert (topology.mode, topology.world_size, topology.distributed) == (DIRECT, 1, False)


class TestTheDocumentedOrderDecides:
    def test_explicit_master_addr_beats_the_slurm_nodelist(self):
        topology = resolve(srun_per_node(0) | {"MASTER_ADDR": "10.9.9.9"}, LAUNCHER, no_gpus)
        assert topology.master_addr == "10.9.9.9"
        assert topology.sources["master_addr"] == "MASTER_ADDR (explicit)"
        assert topology.source == "explicit+slurm"

    def test_explicit_master_port_beats_the_one_derived_from_the_job_id(self):
        assert resolve(srun_per_node(0) | {"MASTER_PORT": "29999"}, LAUNCHER, no_gpus).master_port == 29999

    def test_slurm_port_is_the_jobs_own(self):
        ports = {resolve(srun_per_node(n, job_id=7), LAUNCHER, no_gpus).master_port for n in (0, 1)}
        assert ports == {slurm_port(7)}  # every node of a job agrees
        assert slurm_port(7) != slurm_port(8)
        assert all(20000 <= slurm_port(job) < 32768 for job in (0, 1, 8999, 9000, 123456789))

    def test_step_nodelist_beats_the_jobs(self):
        """srun on part of the allocation: node 0 of the step is the step's first node."""
        env = srun_per_node(0) | {"SLURM_JOB_NODELIST": "gpu[01-08]", "SLURM_STEP_NODELIST": "gpu[05-06]"}
        assert resolve(env, LAUNCHER, no_gpus).master_addr == "gpu05"

    def test_agreeing_sources_are_no_contradiction(self):
        env = srun_per_node(1) | {"NNODES": "2", "NODE_RANK": "1"}
        assert resolve(env, LAUNCHER, no_gpus).node_rank == 1


CONTRADICTIONS = {
    "NODE_RANK vs SLURM_NODEID": (srun_per_node(1) | {"NODE_RANK": "0"}, LAUNCHER,
                                  "NODE_RANK (explicit): node rank 0 contradicts SLURM_NODEID=1 (slurm)"),
    "NNODES vs SLURM_STEP_NUM_NODES": (srun_per_node(1) | {"NNODES": "4"}, LAUNCHER,
                                       "NNODES (explicit): node count 4 contradicts SLURM_STEP_NUM_NODES=2 (slurm)"),
    "PET_NODE_RANK vs RANK": (pytorchjob_v1(1) | {"PET_NODE_RANK": "0"}, LAUNCHER,
                              "PET_NODE_RANK (pytorchjob): node rank 0 contradicts RANK=1 (pytorchjob)"),
    "WORLD_SIZE not nnodes x nproc": (pytorchjob_v1(1) | {"WORLD_SIZE": "6"}, LAUNCHER,
                                      "WORLD_SIZE (pytorchjob): 6 is not PET_NNODES=2 x PET_NPROC_PER_NODE=2 = 4"),
    "PET_NODE_RANK vs JOB_COMPLETION_INDEX": (trainer_v2(1) | {"JOB_COMPLETION_INDEX": "0"}, LAUNCHER,
                                              "PET_NODE_RANK (torchrun-env): node rank 1 contradicts "
                                              "JOB_COMPLETION_INDEX=0 (indexed-job)"),
    "NPROC_PER_NODE vs PET_NPROC_PER_NODE": (trainer_v2(0) | {"NPROC_PER_NODE": "2"}, LAUNCHER,
                                             "NPROC_PER_NODE (explicit): process count per node 2 contradicts "
                                             "PET_NPROC_PER_NODE=3 (torchrun-env)"),
    "SKYPILOT_NUM_NODES vs SKYPILOT_NODE_IPS": (skypilot(0) | {"SKYPILOT_NUM_NODES": "3"}, LAUNCHER,
                                                "SKYPILOT_NUM_NODES (skypilot): node count 3 contradicts "
                                                "SKYPILOT_NODE_IPS=2 (skypilot)"),
    "RANK vs SLURM_PROCID": (srun_task_env(1, 2) | {"RANK": "0", "WORLD_SIZE": "2"}, WORKER,
                             "RANK (explicit): 0 contradicts SLURM_PROCID=1 (slurm)"),
}


class TestContradictionsNameBothSources:
    @pytest.mark.parametrize("env, role, message", CONTRADICTIONS.values(), ids=CONTRADICTIONS.keys())
    def test_contradiction(self, env, role, message):
        with pytest.raises(UsageError) as caught:
            resolve(env, role, no_gpus)
        assert str(caught.value).startswith(message + " ("), str(caught.value)


class TestSlurmHostlists:
    @pytest.mark.parametrize("nodelist, hosts", [
        ("localhost", ["localhost"]),
        ("node7", ["node7"]),
        ("gpu[07-09,12],cpu1", ["gpu07", "gpu08", "gpu09", "gpu12", "cpu1"]),
        ("gpu[12,07-09]", ["gpu12", "gpu07", "gpu08", "gpu09"]),
        ("rack-a[3-4]", ["rack-a3", "rack-a4"]),
        ("host1,host2", ["host1", "host2"]),
        ("gpu[001-003]", ["gpu001", "gpu002", "gpu003"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[1-3,5],gpu[01-02]", ["n1", "n2", "n3", "n5", "gpu01", "gpu02"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("jwb[0001-0002].juwels", ["jwb0001.juwels", "jwb0002.juwels"]),
        ("10.0.0.[5-6]", ["10.0.0.5", "10.0.0.6"]),
    ])
    def test_expands_like_slurm(self, nodelist, hosts):
        assert list(expand_hostlist(nodelist)) == hosts
        assert first_host(nodelist) == hosts[0]

    @pytest.mark.parametrize("nodelist, problem", [
        ("gpu[07-", "a '[' without its ']'"), ("gpu07]", "a ']' without its '['"), ("a,,b", "empty host name"),
        ("n[a-b]", "not a number or a range"), ("n[3-1]", "runs backwards"), ("n[[1]]", "brackets inside brackets"),
        ("n[1-]", "not a number or a range"), ("", "empty"), ("n1 n2", "contains a space"),
    ])
    def test_refuses_what_slurm_would_not_write(self, nodelist, problem):
        with pytest.raises(ValueError, match=re.escape(problem)):
            list(expand_hostlist(nodelist))


# ------------------------------------------------------------------ through the real launcher

def launch(args, env, cwd: Path, timeout: float = BAD_INPUT_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Neither case binds a port: bad input stops before, --dry-run starts nothing."""
    return subprocess.run([*LAUNCH, *args], cwd=cwd, env=clean_env(env), capture_output=True, text=True,
                          timeout=timeout)


BAD_INPUT = {
    "NNODES not a number": ({"NNODES": "two"}, "NNODES (explicit): 'two' is not an integer"),
    "elastic range backwards": ({"NNODES": "2:1", "MASTER_ADDR": "10.0.0.1"}, "NNODES (explicit): '2:1' runs "
                                "backwards: MIN 2 is above MAX 1"),
    "elastic range from 0": ({"NNODES": "0:2", "MASTER_ADDR": "10.0.0.1"}, "NNODES (explicit): '0:2' lets the job "
                             "run on 0 hosts"),
    "elastic range with NODE_RANK": ({"NNODES": "1:2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"},
                                     "NODE_RANK (explicit): sets a node rank, but with NNODES=1:2 the rendezvous "
                                     "assigns them"),
    "elastic range beside a fixed count": ({"NNODES": "2", "PET_NNODES": "1:2", "MASTER_ADDR": "10.0.0.1"},
                                           "PET_NNODES (torchrun-env): the elastic range '1:2' contradicts NNODES=2"),
    "elastic range under Slurm": (srun_per_node(0) | {"NNODES": "1:2"}, "NNODES (explicit): '1:2' asks for elastic "
                                  "membership, but a Slurm allocation has a fixed set of nodes"),
    "elastic range without MASTER_ADDR": ({"NNODES": "1:2"}, "MASTER_ADDR (explicit): is required when NNODES=1:2"),
    "PET_RDZV_BACKEND": (trainer_v2(0) | {"PET_RDZV_BACKEND": "c10d"}, "PET_RDZV_BACKEND (torchrun-env): asks "
                         "torchrun for elastic rendezvous"),
    "PET_NODE_RANK not a number": (trainer_v2(0) | {"PET_NODE_RANK": "first", "JOB_COMPLETION_INDEX": ""},
                                   "PET_NODE_RANK (torchrun-env): 'first' is not an integer"),
    "PET_NPROC_PER_NODE a word torchrun does not know": (trainer_v2(0) | {"PET_NPROC_PER_NODE": "many"},
                                                         "PET_NPROC_PER_NODE (torchrun-env): 'many' is not an integer"),
    "PET_NPROC_PER_NODE gpu without GPUs": (trainer_v2(0) | {"PET_NPROC_PER_NODE": "gpu"},
                                            "PET_NPROC_PER_NODE (torchrun-env): 'gpu' asks for one process per GPU"),
    "PET_MASTER_PORT not a port": (trainer_v2(0) | {"PET_MASTER_PORT": "99999"},
                                   "PET_MASTER_PORT (torchrun-env): 99999 is out of range"),
    "PyTorchJob RANK not a number": (pytorchjob_v1(1) | {"RANK": "one", "PET_NODE_RANK": ""},
                                     "RANK (pytorchjob): 'one' is not an integer"),
    "PyTorchJob node rank out of range": (pytorchjob_v1(2), "PET_NODE_RANK (pytorchjob): node rank 2 is not below "
                                          "PET_NNODES=2"),
    "PyTorchJob PET_NODE_RANK vs RANK": (pytorchjob_v1(1) | {"PET_NODE_RANK": "0"}, "PET_NODE_RANK (pytorchjob): "
                                         "node rank 0 contradicts RANK=1 (pytorchjob)"),
    "PyTorchJob WORLD_SIZE": (pytorchjob_v1(1) | {"WORLD_SIZE": "3"}, "WORLD_SIZE (pytorchjob): 3 is not"),
    "SLURM_NODEID not a number": (srun_per_node(0) | {"SLURM_NODEID": "zero"},
                                  "SLURM_NODEID (slurm): 'zero' is not an integer"),
    "SLURM_NODEID out of range": (srun_per_node(2), "SLURM_NODEID (slurm): node rank 2 is not below "
                                  "SLURM_STEP_NUM_NODES=2"),
    "unparsable nodelist": (srun_per_node(1, nodelist="gpu[07-08"), "SLURM_STEP_NODELIST (slurm): cannot read the "
                            "hostlist 'gpu[07-08': a '[' without its ']'"),
    "SLURM_JOB_ID not a number": (srun_per_node(1) | {"SLURM_JOB_ID": "12_3"},
                                  "SLURM_JOB_ID (slurm): '12_3' is not an integer"),
    "NODE_RANK vs SLURM_NODEID": (srun_per_node(1) | {"NODE_RANK": "0"}, "NODE_RANK (explicit): node rank 0 "
                                  "contradicts SLURM_NODEID=1 (slurm)"),
    "trainer-launch, two tasks per node": (srun_per_node(0) | {"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"},
                                           "SLURM_STEP_NUM_TASKS (slurm): 4 tasks on 2 node(s), but trainer-launch "
                                           "is one task per node"),
    "trainer-launch in a two-node batch script": (sbatch_script(nodes=2), "SLURM_NNODES (slurm): 2 nodes, but "
                                                  "trainer-launch runs in the batch script"),
    "JOB_COMPLETION_INDEX without NNODES": ({"JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "train-0.train"},
                                            "JOB_COMPLETION_INDEX (indexed-job): node rank 1 is not below 1 node "
                                            "(NNODES unset)"),
    "JOB_COMPLETION_INDEX not a number": (indexed_job(0) | {"JOB_COMPLETION_INDEX": "x"},
                                          "JOB_COMPLETION_INDEX (indexed-job): 'x' is not an integer"),
    "SKYPILOT_NODE_RANK negative": (skypilot(0) | {"SKYPILOT_NODE_RANK": "-1"},
                                    "SKYPILOT_NODE_RANK (skypilot): -1 is out of range"),
    "SKYPILOT node count vs IPs": (skypilot(0) | {"SKYPILOT_NUM_NODES": "3"}, "SKYPILOT_NUM_NODES (skypilot): node "
                                   "count 3 contradicts SKYPILOT_NODE_IPS=2 (skypilot)"),
    "RANK without WORLD_SIZE": ({"RANK": "0"}, "WORLD_SIZE (explicit): is not set but RANK is"),
}


@pytest.mark.parametrize("env, line", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_topology_is_one_line_exit_2_before_torchrun(tmp_path, env, line):
    result = launch(["--model", "cnn"], env, tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: {line}"), result.stderr[-3000:]
    assert re.fullmatch(r"error: [A-Z_]+ \([a-z-]+\): .+ \(.+\)", lines[0]), lines[0]
    assert "torchrun" not in result.stdout and "+ " not in result.stderr
    assert files_under(tmp_path) == set()


DRY_RUNS = {
    "one host": ({}, {"mode": "torchrun", "nnodes": 1, "node_rank": 0, "nproc_per_node": 2,
                      "master_addr": "127.0.0.1", "source": "default"}),
    "explicit": ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"},
                 {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.5", "master_port": 29400, "source": "explicit"}),
    "Trainer v2": (trainer_v2(1, nproc="2"), {"nnodes": 2, "node_rank": 1, "nproc_per_node": 2, "world_size": 4,
                                              "master_addr": "mnist-node-0-0.mnist", "master_port": 29400,
                                              "source": "torchrun-env"}),
    "PyTorchJob v1": (pytorchjob_v1(1), {"mode": "torchrun", "nnodes": 2, "node_rank": 1, "nproc_per_node": 2,
                                         "world_size": 4, "master_addr": "job-master-0", "master_port": 23456,
                                         "source": "pytorchjob"}),
    "Slurm one task per node": (srun_per_node(1), {"nnodes": 2, "node_rank": 1, "master_addr": "gpu07",
                                                   "master_port": slurm_port(81234), "source": "slurm"}),
    "Indexed Job": (indexed_job(1), {"nnodes": 2, "node_rank": 1, "master_addr": "train-0.train",
                                     "source": "explicit+indexed-job"}),
    "SkyPilot, CPU cluster": (skypilot(1) | {"SKYPILOT_NUM_GPUS_PER_NODE": "0"},
                              {"nnodes": 2, "node_rank": 1, "nproc_per_node": 2, "master_addr": "10.0.0.11",
                               "source": "skypilot"}),
    "RANK and WORLD_SIZE: the worker itself": ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
                                                {"mode": "worker", "rank": 1, "world_size": 2, "source": "explicit"}),
}


@pytest.mark.parametrize("env, expected", DRY_RUNS.values(), ids=DRY_RUNS.keys())
def test_dry_run_prints_the_topology_as_one_json_object_and_starts_nothing(tmp_path, env, expected):
    result = launch(["--dry-run", "--model", "cnn", "--max-steps", "1"], env, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""
    printed = json.loads(result.stdout)
    assert {k: printed[k] for k in expected} == expected
    assert {"nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port", "source", "sources",
            "mode", "command"} <= printed.keys()
    assert all(printed["sources"][f] for f in ("nnodes", "node_rank", "nproc_per_node", "master_addr", "master_port"))
    if printed["mode"] == "torchrun":
        assert printed["command"][:6] == [
            "torchrun", f"--nnodes={printed['nnodes']}", f"--node-rank={printed['node_rank']}",
            f"--nproc-per-node={printed['nproc_per_node']}", f"--master-addr={printed['master_addr']}",
            f"--master-port={printed['master_port']}"]
    else:
        assert printed["command"][1:3] == ["-m", "trainer"]
    assert printed["command"][-4:] == ["--model", "cnn", "--max-steps", "1"]
    assert files_under(tmp_path) == set()


def test_dry_run_on_one_host_shows_the_free_port_a_launch_takes_not_torchruns_default(tmp_path):
    """With MASTER_PORT unset on one host a launch takes a free port (host networking shares the host's ports);
    the dry run showed 29500 from the "default" source, a port no launch used. It shows a free port now, and its
    source says that each launch takes one anew."""
    printed = json.loads(launch(["--dry-run", "--model", "cnn"], {}, tmp_path).stdout)
    port = printed["master_port"]
    assert printed["sources"]["master_port"] == "a free port, taken at each launch (one host, MASTER_PORT unset)"
    assert port != 29500 and f"--master-port={port}" in printed["command"]
    with socket.socket() as sock:
        sock.bind(("", port))  # free: the dry run holds nothing
    explicit = json.loads(launch(["--dry-run", "--model", "cnn"], {"MASTER_PORT": "29500"}, tmp_path).stdout)
    assert (explicit["master_port"], explicit["sources"]["master_port"]) == (29500, "MASTER_PORT (explicit)")


def test_dry_run_of_a_script_keeps_the_scripts_arguments(tmp_path):
    (tmp_path / "train.py").write_text("print('never run')\n")
    result = launch(["--dry-run", "train.py", "--dry-run"], {"NPROC_PER_NODE": "3"}, tmp_path)
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["nproc_per_node"] == 3 and printed["sources"]["nproc_per_node"] == "NPROC_PER_NODE (explicit)"
    assert printed["command"][-2:] == ["train.py", "--dry-run"]  # the script's own --dry-run is its own


def test_dry_run_anywhere_among_the_built_in_trainers_options(tmp_path):
    result = launch(["--model", "cnn", "--dry-run"], {}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["command"][-4:] == ["-m", "trainer", "--model", "cnn"]


def test_trainer_doctor_shows_the_resolved_topology_and_its_source(tmp_path):
    env = clean_env(srun_per_node(0, nodelist="localhost,nodeb"))
    result = subprocess.run([sys.executable, "-m", "trainer.cli.doctor", "--json"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    (row,) = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "topology"]
    assert row["status"] == "pass"
    assert row["value"] == (f"nnodes=2 node_rank=0 nproc_per_node=2 world_size=4 master=localhost:{slurm_port(81234)}"
                            " (source: slurm)")


# ------------------------------------------------------------------ real trainings across two launchers

def two_launchers(tmp_path: Path, envs: list[dict], samples: int = 512) -> list[Path]:
    """trainer-launch on two "nodes" of this machine, each with its own working directory, to the end."""
    roots = [tmp_path / f"node{n}" for n in range(len(envs))]
    launches = []
    try:
        for n, (root, env) in enumerate(zip(roots, envs)):
            root.mkdir()
            launches.append(Launch(tiny_run(root, samples=samples, every=4), root, env, name=f"node{n}"))
        codes = [launch.wait(RUN_TIMEOUT_S) for launch in launches]
        assert codes == [0, 0], "\n".join(launch.output()[-3000:] for launch in launches)
    finally:
        for launch in launches:
            if launch.proc.poll() is None:
                launch.stop_everything()
    return roots


def assert_one_world_of_four_with_rank_0_on_node_0(roots: list[Path], samples: int) -> None:
    summary = read_summary(roots[0] / "runs")
    steps = samples // (16 * 4)
    assert (summary["world_size"], summary["backend"], summary["global_step"]) == (4, "gloo", steps)
    assert checkpoint_steps(roots[0] / "checkpoints")[-1] == steps  # rank 0 (it alone writes) is on node 0
    assert checkpoint_steps(roots[1] / "checkpoints") == [] and not (roots[1] / "runs" / "summary.json").exists()


@pytest.mark.slow
def test_pytorchjob_v1_pods_train_together(tmp_path):
    """Exactly what the PyTorchJob controller gives a Master and a Worker pod (nprocPerNode 2): RANK is the
    node index, WORLD_SIZE = 4. Before, pod 1 ran one worker as 'rank 1 of 4' and waited forever."""
    port = free_port()
    roots = two_launchers(tmp_path, [pytorchjob_v1(n, addr="127.0.0.1", port=port) for n in (0, 1)])
    assert_one_world_of_four_with_rank_0_on_node_0(roots, 512)
    node1 = (roots[1] / "node1.log").read_text()
    assert f"topology: nnodes=2 node_rank=1 nproc_per_node=2 world_size=4 master=127.0.0.1:{port} " \
           "(source: pytorchjob)" in node1
    assert "+ torchrun --nnodes=2 --node-rank=1 --nproc-per-node=2" in node1


def job_id_for_a_free_port() -> int:
    """A Slurm job id whose derived MASTER_PORT is free here (the derivation itself is under test)."""
    for job in range(90000, 99000):
        port = slurm_port(job)
        try:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
            return job
        except OSError:
            continue
    raise AssertionError("no free port in the Slurm range")


@pytest.mark.slow
def test_slurm_one_task_per_node_trains_together(tmp_path):
    """`srun --ntasks-per-node=1 trainer-launch` on 2 nodes: SLURM_NNODES/SLURM_NODEID and the first host of
    the nodelist; MASTER_PORT derived from the job id on both nodes; the workers (which inherit SLURM_PROCID
    and friends) take their ranks from torchrun."""
    job = job_id_for_a_free_port()
    envs = [srun_per_node(n, job_id=job, nodelist="localhost,nodeb") for n in (0, 1)]
    roots = two_launchers(tmp_path, envs)
    assert_one_world_of_four_with_rank_0_on_node_0(roots, 512)
    assert f"--master-addr=localhost --master-port={slurm_port(job)}" in (roots[1] / "node1.log").read_text()


@pytest.mark.slow
def test_slurm_explicit_master_addr_wins_in_a_real_run(tmp_path):
    """A nodelist whose hosts do not resolve here, and MASTER_ADDR set in the job script: MASTER_ADDR wins."""
    job = job_id_for_a_free_port()
    envs = [srun_per_node(n, job_id=job, nodelist="gpu[07-08]") | {"MASTER_ADDR": "127.0.0.1"} for n in (0, 1)]
    roots = two_launchers(tmp_path, envs)
    assert_one_world_of_four_with_rank_0_on_node_0(roots, 512)
    assert "(source: explicit+slurm)" in (roots[0] / "node0.log").read_text()


# ------------------------------------------------------------------ elastic membership (NNODES=MIN:MAX)

@pytest.mark.parametrize("env, endpoint", [
    ({"NNODES": "1:2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}, "10.0.0.1:29400"),
    # Kubeflow's elastic PyTorchJob / TrainJob pod: the range, the c10d endpoint and the pod's index, which the
    # rendezvous's node rank replaces.
    (trainer_v2(1) | {"PET_NNODES": "1:4", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "job-0.job:29400"},
     "job-0.job:29400"),
], ids=["NNODES", "Kubeflow PET_NNODES"])
def test_an_elastic_range_runs_torchruns_c10d_rendezvous_and_dry_run_shows_it(tmp_path, env, endpoint):
    # 1:4 hosts of 2 processes: a global batch every world size (2, 4, 6, 8) divides. The restart path's rendezvous
    # (in place, tests/test_inplace.py, each host's agent runs a group of its own).
    result = launch(["--dry-run", "--model", "cnn"], env | {"NPROC_PER_NODE": "2", "PET_NPROC_PER_NODE": "",
                                                            "TRAIN_GLOBAL_BATCH_SIZE": "48", "RECOVERY": "restart"},
                    tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(result.stdout)
    low, high = (1, 2) if "NNODES" in env else (1, 4)
    assert facts["nnodes"] == f"{low}:{high}" and (facts["min_nodes"], facts["max_nodes"]) == (low, high)
    assert facts["world_sizes"] == [2 * n for n in range(low, high + 1)]
    assert facts["node_rank"] == "assigned by the rendezvous"
    command = facts["command"]
    assert f"--nnodes={low}:{high}" in command and "--rdzv-backend=c10d" in command
    assert f"--rdzv-endpoint={endpoint}" in command and not any(a.startswith("--node-rank") for a in command)
    assert "--max-restarts=10" in command  # each lost or returning host is a restart


def test_an_elastic_global_batch_every_world_size_must_divide(tmp_path):
    """On the restart path each membership is a world of its own (in place, every membership trains the largest
    world's micro-batches: its global batch is the job's)."""
    env = {"NNODES": "1:3", "MASTER_ADDR": "10.0.0.1", "NPROC_PER_NODE": "1", "TRAIN_GLOBAL_BATCH_SIZE": "4",
           "RECOVERY": "restart"}
    result = launch(["--model", "cnn"], env, tmp_path)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: TRAIN_GLOBAL_BATCH_SIZE: 4 is not divisible by world size 3 x grad-accum 1, a world size this "
        "elastic job may shrink to (NNODES=1:3) (use a multiple of 6, which every world size of NNODES=1:3 x "
        "grad-accum divides)"], result.stderr
    assert files_under(tmp_path) == set()
    derived = launch(["--model", "cnn", "--batch-size", "64"], {"NNODES": "1:4", "MASTER_ADDR": "10.0.0.1",
                                                                 "NPROC_PER_NODE": "2", "RECOVERY": "restart"},
                     tmp_path)
    assert derived.returncode == 2 and derived.stderr.strip().splitlines() == [
        "error: --batch-size: 64 per process makes a global batch of 512 at world size 8, which world size 6 of "
        "NNODES=1:4 does not divide (an elastic job keeps its global batch at every size) (set --global-batch-size "
        "to a multiple of 24, e.g. 504 or 528)"], derived.stderr
