"""The pods of k8s/'s manifests, simulated: real containers of the CPU image, each started with exactly
the environment its controller gives the pod (the manifest's variables plus what the controller
injects, tests/k8s_manifests.py), train together to completion over gloo; a pod killed mid-run and
started again as its controller would resumes from the newest committed checkpoint.

What stands in for the cluster:
  * the pod network: one network namespace that only has a loopback interface, held by a "pause"
    container as in a real pod, which every simulated pod joins, so the controllers' fixed port
    (29500) is used as the manifests say without meeting anything else on the host; the pods' DNS
    name for pod 0 (<job>-0.<service>, <job>-master-0, <trainjob>-node-0-0.<trainjob>) resolves to
    loopback through /etc/hosts. For the in-place job, whose pods meet at a Service rather than at pod 0:
    an internal Docker network (no route out), each pod an address of its own on it, the Service's name
    an alias of the lighthouse pod's address there (Docker's DNS), as the cluster's DNS resolves it;
  * the ReadWriteMany claims: two host directories mounted at /checkpoints and /runs in every pod;
  * the manifests' CPU variant: what a user changes to run them without GPUs (the CPU image, 2
    processes per node, a small model and data set); the topology variables are untouched.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

import pytest

import k8s_manifests as k8s
from containerlib import CPU_IMAGE

CPU_NPROC = 2
TRAINING = {  # the CPU variant's options: 16 steps per epoch at 2 x 2 processes
    "TRAIN_MODEL": "cnn", "TRAIN_DATASET": "synthetic", "TRAIN_SYNTHETIC_SIZE": "2048", "TRAIN_BATCH_SIZE": "32",
    "TRAIN_LR": "0.05", "TRAIN_EPOCHS": "2", "TRAIN_LOG_EVERY": "4", "TRAIN_CHECKPOINT_EVERY": "8",
}
STEPS_PER_EPOCH = 2048 // (32 * 2 * CPU_NPROC)
IN_PLACE_JOB = "indexed-job-inplace"


def cpu_variant(workload: str, training: dict[str, str]) -> list[dict]:
    """The manifest as a user adapts it to a machine without GPUs: fewer processes per node, no GPU
    resources, small training options. The topology the controller derives is left alone."""
    docs = copy.deepcopy(k8s.documents(k8s.MANIFESTS[workload]))
    extra = [{"name": k, "value": v} for k, v in training.items()]

    def adapt(container: dict) -> None:
        container.pop("resources", None)
        kept = [e for e in container.get("env", []) if e["name"] not in training]
        container["env"] = [{**e, "value": str(CPU_NPROC)} if e["name"] == "NPROC_PER_NODE" else e
                            for e in kept] + extra

    for doc in docs:
        if doc["kind"] == "TrainJob":
            doc["spec"]["trainer"]["numProcPerNode"] = CPU_NPROC
            doc["spec"]["trainer"].pop("resourcesPerNode", None)
            adapt(doc["spec"]["trainer"])
        elif doc["kind"] == "PyTorchJob":
            doc["spec"]["nprocPerNode"] = str(CPU_NPROC)
            for spec in doc["spec"]["pytorchReplicaSpecs"].values():
                for c in spec["template"]["spec"]["containers"]:
                    adapt(c)
        elif doc["kind"] == "Job":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                adapt(c)
        elif doc["kind"] == "Deployment" and "TRAIN_COLLECTIVE_TIMEOUT" in training:
            for c in doc["spec"]["template"]["spec"]["containers"]:  # the lighthouse's, changed with the workers'
                c["args"][c["args"].index("--join-timeout") + 1] = training["TRAIN_COLLECTIVE_TIMEOUT"]
    return docs


class SimulatedPods:
    """The pods a controller makes from one manifest, as containers in one loopback-only network."""

    def __init__(self, client, workload: str, docs: list[dict], tmp: Path, network: bool = False):
        """network: the pods get addresses of their own on an internal network (the in-place job), rather than
        one loopback-only namespace."""
        self.client, self.workload, self.docs = client, workload, docs
        self.pods = k8s.pod_environments(workload, docs)
        self.prefix = f"ddpt-k8s-{workload}-{uuid.uuid4().hex[:6]}"
        self.checkpoints, self.runs = tmp / "checkpoints", tmp / "runs"
        for d in (self.checkpoints, self.runs):
            d.mkdir(parents=True)
            d.chmod(0o777)  # the claims' fsGroup: writable by the pods' user
        self.containers: dict[int, object] = {}
        self.history: list[object] = []  # every container started, replaced ones included
        self.pause = self.network = None
        if network:
            self.network = client.networks.create(f"{self.prefix}-net", driver="bridge", internal=True,
                                                  labels={"ddpt-k8s": self.prefix})
            self.joined = {"network": self.network.name}
        else:
            self.pause = client.containers.run(
                CPU_IMAGE, entrypoint=["sleep", "infinity"], name=f"{self.prefix}-pause", detach=True,
                network_mode="none", extra_hosts={k8s.master_host(workload, docs): "127.0.0.1"},
                labels={"ddpt-k8s": self.prefix})
            self.joined = {"network_mode": f"container:{self.pause.id}"}

    def start(self, pod: k8s.Pod):
        """A pod's container: the image's entrypoint (no command or args in the manifests), the pod's
        user, its environment and nothing else."""
        security = pod.pod_spec["securityContext"]
        container = self.client.containers.run(
            CPU_IMAGE, name=f"{self.prefix}-{pod.name}-{len(self.history)}", detach=True,
            environment=pod.env, user=f"{security['runAsUser']}:{security['runAsGroup']}",
            **self.joined, **({"hostname": pod.name} if self.network else {}), shm_size="1g",
            volumes={str(self.checkpoints): {"bind": "/checkpoints", "mode": "rw"},
                     str(self.runs): {"bind": "/runs", "mode": "rw"}},
            labels={"ddpt-k8s": self.prefix})
        self.containers[pod.index] = container
        self.history.append(container)
        return container

    def start_all(self) -> None:
        for pod in self.pods:
            self.start(pod)

    def start_lighthouse(self):
        """The in-place job's lighthouse pod: its Deployment's container command as is, as the pod's user, on the pods'
        network under the Service's name (one replica: the Service's address is this pod's)."""
        lighthouse = k8s.lighthouse(self.docs)
        security = lighthouse.pod_spec["securityContext"]
        endpoint = self.client.api.create_endpoint_config(aliases=[lighthouse.service["metadata"]["name"]])
        self.lighthouse = self.client.containers.run(
            CPU_IMAGE, name=f"{self.prefix}-lighthouse", detach=True, entrypoint=lighthouse.container["command"],
            command=lighthouse.container["args"], user=f"{security['runAsUser']}:{security['runAsGroup']}",
            network=self.network.name, networking_config={self.network.name: endpoint},
            labels={"ddpt-k8s": self.prefix})
        self.history.append(self.lighthouse)
        return self.lighthouse

    def state(self, index: int) -> dict:
        container = self.containers[index]
        container.reload()
        return container.attrs["State"]

    def logs(self, index: int) -> str:
        return self.containers[index].logs().decode(errors="replace")

    def all_logs(self) -> str:
        return "\n".join(f"--- {c.name}\n{c.logs().decode(errors='replace')[-3000:]}" for c in self.history)

    def wait(self, timeout: float, backoff_limit: int = 0) -> list[dict]:
        """Until every pod's container has exited 0. A failed pod is started again with the same
        environment, as its controller would, up to backoff_limit failures in all, each after the Job
        controller's back-off: 10 s, doubling with every failure of the job (Kubernetes' job controller,
        DefaultJobPodFailureBackOff; the kubelet's restart back-off for restartPolicy OnFailure is alike)."""
        deadline, failures, due = time.monotonic() + timeout, 0, {}
        while True:
            states = {pod.index: self.state(pod.index) for pod in self.pods}
            if all(s["Status"] == "exited" and s["ExitCode"] == 0 for s in states.values()):
                return [states[p.index] for p in self.pods]
            for pod in self.pods:
                s = states[pod.index]
                if s["Status"] == "exited" and s["ExitCode"] != 0 and pod.index not in due:
                    assert s["ExitCode"] != 2, f"{pod.name}: a usage error\n{self.all_logs()}"
                    failures += 1
                    assert failures <= backoff_limit, (f"{pod.name} exited {s['ExitCode']}: failure {failures} "
                                                       f"of a job with backoffLimit {backoff_limit}\n{self.all_logs()}")
                    due[pod.index] = time.monotonic() + min(10.0 * 2 ** (failures - 1), 360.0)
            for pod in self.pods:
                if pod.index in due and time.monotonic() >= due[pod.index]:
                    del due[pod.index]
                    self.start(pod)
            assert time.monotonic() < deadline, f"the pods did not finish in {timeout:.0f} s\n{self.all_logs()}"
            time.sleep(0.5)

    def remove(self) -> None:
        for container in [*self.history, self.pause]:
            try:
                if container is not None:
                    container.remove(force=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.network is not None:
            try:
                self.network.remove()
            except Exception:  # noqa: BLE001 - already gone
                pass


@pytest.fixture
def simulate(docker_client, cpu_image):
    made: list[SimulatedPods] = []
    tmp = Path(tempfile.mkdtemp(prefix="ddpt-k8s-"))
    tmp.chmod(0o755)

    def make(workload: str, training: dict[str, str] = TRAINING, network: bool = False) -> SimulatedPods:
        pods = SimulatedPods(docker_client, workload, cpu_variant(workload, training), tmp / f"{len(made)}", network)
        made.append(pods)
        return pods

    yield make
    for pods in made:
        pods.remove()
    shutil.rmtree(tmp, ignore_errors=True)  # files of uid 1000; may need root


def _docker_time(stamp: str) -> datetime:
    """Docker's RFC 3339 times carry nanoseconds, which datetime does not take."""
    stamp = re.sub(r"(\.\d{6})\d*", r"\1", stamp).replace("Z", "+00:00")
    return datetime.fromisoformat(stamp)


def first_step_after_start(container) -> float:
    """Seconds from the container's start to rank 0's 'first step done' line, by Docker's own clocks."""
    container.reload()
    started = _docker_time(container.attrs["State"]["StartedAt"])
    for line in container.logs(timestamps=True).decode(errors="replace").splitlines():
        if "first step done" in line:
            return (_docker_time(line.split(" ", 1)[0]) - started).total_seconds()
    raise AssertionError("no 'first step done' line in pod 0's log")


def assert_each_pod_resolved_its_node(pods: SimulatedPods) -> None:
    for pod in pods.pods:  # the launcher's one topology line, from this pod's controller variables
        assert re.search(rf"^topology: nnodes=2 node_rank={pod.index} nproc_per_node={CPU_NPROC} world_size=4 ",
                         pods.logs(pod.index), re.M), pods.logs(pod.index)[-2000:]


# The Indexed Job's pods train to completion in the restart test below (one run, for CI's time).
@pytest.mark.parametrize("workload", ["trainjob", "pytorchjob"])
def test_the_pods_a_controller_makes_train_together_to_completion(simulate, workload):
    pods = simulate(workload)
    pods.start_all()
    states = pods.wait(timeout=420)
    assert [s["ExitCode"] for s in states] == [0, 0]
    assert_each_pod_resolved_its_node(pods)
    summary = json.loads((pods.runs / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 4 and summary["backend"] == "gloo"
    assert summary["global_step"] == 2 * STEPS_PER_EPOCH and summary["resumed_from_step"] is None
    print(f"\n{workload}: container start -> first training step {first_step_after_start(pods.containers[0]):.1f} s")


def test_indexed_job_pods_train_together_and_a_killed_pod_resumes_from_the_last_checkpoint(simulate):
    pods = simulate("indexed-job", {**TRAINING, "TRAIN_EPOCHS": "3"})  # the kill lands in the first epoch
    pods.start_all()
    deadline = time.monotonic() + 420
    while not sorted(pods.checkpoints.glob("step-*.pt")):
        assert time.monotonic() < deadline and pods.state(1)["Status"] == "running", pods.all_logs()
        time.sleep(0.2)
    committed = max(int(p.name[5:-3]) for p in pods.checkpoints.glob("step-*.pt"))
    first_start = first_step_after_start(pods.containers[0])
    assert_each_pod_resolved_its_node(pods)
    pods.containers[1].kill()  # SIGKILL: what a node failure or an OOM kill does to the pod
    # The Job controller replaces the failed pod; pod 0, whose collectives lost their peer, fails in
    # turn and is replaced too (restartPolicy Never), each after the controller's back-off.
    backoff_limit = k8s.one(k8s.documents(k8s.MANIFESTS["indexed-job"]), "Job")["spec"]["backoffLimit"]
    states = pods.wait(timeout=420, backoff_limit=backoff_limit)
    assert [s["ExitCode"] for s in states] == [0, 0]
    assert len(pods.history) >= 4, "each pod fails (pod 0 on its lost peer) and is started again"
    assert_each_pod_resolved_its_node(pods)  # the pods started again: same environment, same node
    summary = json.loads((pods.runs / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 4
    assert summary["global_step"] == 3 * STEPS_PER_EPOCH
    assert summary["resumed_from_step"] is not None and summary["resumed_from_step"] >= committed, summary
    print(f"\nindexed-job: container start -> first training step {first_start:.1f} s; after the restart "
          f"{first_step_after_start(pods.containers[0]):.1f} s (resumed at step {summary['resumed_from_step']})")


def test_elastic_pytorchjob_pods_go_on_at_the_smaller_size_when_a_pod_is_killed(simulate):
    """k8s/pytorchjob-elastic.yaml's pods (PET_NNODES=1:2, c10d at worker-0): once both train (world size 4),
    worker-1 is SIGKILLed after a checkpoint, as a lost node kills it, and not replaced; worker-0 does not fail
    with it: its agent restarts its workers, the rendezvous closes with one pod, and it trains on at world size 2
    from the newest checkpoint, with the same global batch, until the pod is stopped (exit 0: Kubernetes' SIGTERM;
    not trained to the end, for CI's time)."""
    samples = 32768  # 256 steps of the global batch (32 x 4): long enough for worker-1 to join, then be lost
    pods = simulate("pytorchjob-elastic", {**TRAINING, "TRAIN_SYNTHETIC_SIZE": str(samples), "TRAIN_EPOCHS": "1",
                                           "RECOVERY": "restart"})  # the restart path's rendezvous at worker-0
    # On a cluster each pod has its own address and only worker-0 holds the rendezvous endpoint's; here both
    # share one loopback, so worker-0 goes first and runs the store before worker-1 looks (the port is taken).
    pods.start(pods.pods[0])
    deadline = time.monotonic() + 420
    while "topology: " not in pods.logs(0):
        assert time.monotonic() < deadline and pods.state(0)["Status"] == "running", pods.all_logs()
        time.sleep(0.5)
    # Its torchrun imports torch and binds the store, which takes longer on a loaded machine: worker-1 starts once the
    # store takes a connection in the pods' network (worker-1's agent would give up on a store that is not there).
    probe = ["python", "-c", "import socket; socket.create_connection(('127.0.0.1', 29500), 1)"]
    while pods.containers[0].exec_run(probe).exit_code != 0:
        assert time.monotonic() < deadline and pods.state(0)["Status"] == "running", pods.all_logs()
        time.sleep(0.5)
    pods.start(pods.pods[1])

    def world_4_checkpoint() -> bool:  # a checkpoint committed after the world of both pods formed
        both = pods.logs(0) + pods.logs(1)
        return bool(re.search(r"INFO training .* world size 4 [\s\S]*checkpoint committed: ", both))
    while not world_4_checkpoint():
        assert time.monotonic() < deadline and pods.state(1)["Status"] == "running", pods.all_logs()
        time.sleep(0.2)
    committed = max(int(p.name[5:-3]) for p in pods.checkpoints.glob("step-*.pt"))
    pods.containers[1].kill()
    while not re.search(r"INFO training .* world size 2 [\s\S]*first step done", pods.logs(0)):
        assert time.monotonic() < deadline and pods.state(0)["Status"] == "running", pods.all_logs()
        time.sleep(0.5)
    pods.containers[0].stop(timeout=60)  # SIGTERM, as the kubelet stops a pod
    while pods.state(0)["Status"] != "exited":
        assert time.monotonic() < deadline, f"worker-0 did not finish\n{pods.all_logs()}"
        time.sleep(0.5)
    assert pods.state(0)["ExitCode"] == 0, pods.all_logs()
    log = pods.logs(0)
    # It names the pod that went away, not only its own rank that died of it.
    assert re.search(r"^restart \d+ of 10: host .+ went away \(.*\); rank \d+ .*; the hosts still here meet again "
                     r"\(NNODES=1:2\)", log, re.M), log
    assert re.findall(r"INFO training .* world size (\d+) ", log)[-1] == "2", log[-3000:]
    summary = json.loads((pods.runs / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["world_size"] == 2
    assert summary["global_step"] < samples // (32 * 2 * CPU_NPROC)
    assert summary["resumed_from_step"] is not None and summary["resumed_from_step"] >= committed, summary


def test_in_place_job_pods_train_together_at_the_lighthouse_service_and_a_killed_pod_costs_the_other_no_restart(
        simulate):
    """k8s/indexed-job-inplace.yaml: the lighthouse's pod (its Deployment's command) and the Indexed Job's two worker
    pods, started together as the cluster would, each pod an address of its own and the Service's name the lighthouse
    pod's. The workers find the lighthouse at MASTER_ADDR (starting none of their own) and train together in place
    (world size 4); worker 1 is SIGKILLed (a lost node) and not replaced: worker 0 goes on at world size 2 in place,
    its training processes the same (no restart), until the pod is stopped (SIGTERM, as the kubelet stops a pod: exit
    0; not trained to the end, for CI's time). Then the lighthouse's pod stops as the kubelet stops it: at once, exit 0."""
    samples = 65536  # 512 steps of the global batch (32 x 4): far more than the test trains
    pods = simulate(IN_PLACE_JOB, {**TRAINING, "TRAIN_SYNTHETIC_SIZE": str(samples), "TRAIN_EPOCHS": "1",
                                   "TRAIN_COLLECTIVE_TIMEOUT": "30"}, network=True)
    started = time.monotonic()
    lighthouse = pods.start_lighthouse()
    pods.start_all()
    generation = r"in place: generation \d+, world size (\d+) of at most 4"
    deadline = time.monotonic() + 420

    def sizes(index: int) -> list[str]:
        return re.findall(generation, pods.logs(index))
    while "4" not in sizes(0) or "4" not in sizes(1):
        assert time.monotonic() < deadline and all(pods.state(i)["Status"] == "running" for i in (0, 1)), \
            pods.all_logs()
        time.sleep(0.5)
    together = time.monotonic() - started
    service = k8s.lighthouse(pods.docs).service["metadata"]["name"]
    for index in (0, 1):
        log = pods.logs(index)
        assert re.search(rf"^recovery: in place: .*torchft's lighthouse at http://{service}:29500 ", log, re.M), log
        processes = " ".join(" ".join(p) for p in pods.containers[index].top()["Processes"])
        assert "trainer.cluster.lighthouse" not in processes  # the launcher found the Service's and started none

    def workers() -> list[str]:  # worker 0's training processes (started through the bootstrap)
        return sorted(p[1] for p in pods.containers[0].top()["Processes"] if "bootstrap" in p[-1])
    pids = workers()
    assert len(pids) >= 2, pods.containers[0].top()
    before = len(sizes(0))
    killed = time.monotonic()  # before the call: docker kill returns once the container is gone, seconds later
    pods.containers[1].kill()  # SIGKILL: what a node failure or an OOM kill does to the pod
    while sizes(0)[before:].count("2") == 0:
        assert time.monotonic() < deadline and pods.state(0)["Status"] == "running", pods.all_logs()
        time.sleep(0.2)
    went_on = time.monotonic() - killed
    assert workers() == pids  # the lost pod cost worker 0 no process
    pods.containers[0].stop(timeout=60)  # SIGTERM, as the kubelet stops a pod
    while pods.state(0)["Status"] != "exited":
        assert time.monotonic() < deadline, f"worker 0 did not stop\n{pods.all_logs()}"
        time.sleep(0.5)
    log = pods.logs(0)
    assert pods.state(0)["ExitCode"] == 0, pods.all_logs()
    assert "restart 1 of" not in log and "Traceback" not in log, log[-4000:]
    assert sizes(0)[-1] == "2", sizes(0)
    summary = json.loads((pods.runs / "summary.json").read_text())
    assert summary["status"] == "stopped" and 0 < summary["global_step"] < samples // (32 * 2 * CPU_NPROC), summary
    began = time.monotonic()
    lighthouse.stop(timeout=k8s.lighthouse(pods.docs).pod_spec["terminationGracePeriodSeconds"])
    lighthouse.reload()
    assert lighthouse.attrs["State"]["ExitCode"] == 0 and time.monotonic() - began < 8, lighthouse.logs()
    print(f"\n{IN_PLACE_JOB}: start -> world size 4 {together:.1f} s; kill -> world size 2 {went_on:.1f} s; "
          f"whole test {time.monotonic() - started:.1f} s")
