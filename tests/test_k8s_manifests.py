"""The Kubernetes manifests in k8s/: they fit the APIs they are written for, keep the stack's promises
(non-root, sized /dev/shm, checkpoints on a claim, TensorBoard on loopback, restarts that resume), and
every pod a controller makes from them resolves to its own node of one topology.

No cluster runs here: the schemas are the Kubernetes and Kubeflow API schemas, offline (k8s_manifests);
tests/containers/test_k8s_pods.py runs the pods' environments in real containers.
"""

from __future__ import annotations

import copy
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

import k8s_manifests as k8s
from helpers import clean_env, free_port
from k8s_manifests import ROOT

WORKLOADS = ("trainjob", "pytorchjob", "indexed-job")
IN_PLACE = "indexed-job-inplace"  # the elastic in-place job: workers of an Indexed Job, its lighthouse apart
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def image_uid_gid() -> tuple[int, int]:
    text = DOCKERFILE.read_text()
    return (int(re.search(r"^ARG TRAINER_UID=(\d+)$", text, re.M).group(1)),
            int(re.search(r"^ARG TRAINER_GID=(\d+)$", text, re.M).group(1)))


# ---------------------------------------------------------------------------------------------
# The API schemas

@pytest.mark.parametrize("version", k8s.kubernetes_versions())
@pytest.mark.parametrize("manifest", sorted(k8s.MANIFESTS))
def test_every_document_fits_the_kubernetes_and_kubeflow_schemas(manifest, version):
    checks = list(k8s.checks(k8s.documents(k8s.MANIFESTS[manifest]), version))
    assert checks
    failed = {c.what: c.errors for c in checks if c.errors}
    assert not failed, json.dumps(failed, indent=2)


def _break(doc: dict, path: str, value=None, rename: str | None = None) -> dict:
    """A copy of doc with the field at path (dots; [n] for list items) renamed or replaced."""
    doc = copy.deepcopy(doc)
    *parents, last = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    node = doc
    for part in parents:
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    if rename:
        node[rename] = node.pop(last)
    else:
        node[last] = value
    return doc


MISTAKES = {
    # A misspelt field is dropped by a lenient decoder and refused by the API server's strict field
    # validation (kubectl's default); a wrong type is refused outright.
    "trainjob-misspelt-numProcPerNode": ("trainjob", "TrainJob", "spec.trainer.numProcPerNode", None,
                                         "numProcsPerNode"),
    "trainjob-numNodes-string": ("trainjob", "TrainJob", "spec.trainer.numNodes", "two", None),
    "runtime-misspelt-maxRestarts": ("trainjob", "TrainingRuntime", "spec.template.spec.failurePolicy.maxRestarts",
                                     None, "maxRestart"),
    "runtime-pod-misspelt-securityContext": (
        "trainjob", "TrainingRuntime",
        "spec.template.spec.replicatedJobs[0].template.spec.template.spec.securityContext", None, "securityContxt"),
    "pytorchjob-misspelt-nprocPerNode": ("pytorchjob", "PyTorchJob", "spec.nprocPerNode", None, "nProcPerNodes"),
    "pytorchjob-replicas-string": ("pytorchjob", "PyTorchJob", "spec.pytorchReplicaSpecs.Worker.replicas", "one", None),
    "pytorchjob-pod-misspelt-volumes": ("pytorchjob", "PyTorchJob",
                                        "spec.pytorchReplicaSpecs.Master.template.spec.volumes", None, "volume"),
    "job-misspelt-completionMode": ("indexed-job", "Job", "spec.completionMode", None, "completionmode"),
    "job-shm-medium-number": ("indexed-job", "Job", "spec.template.spec.volumes[0].emptyDir.medium", 5, None),
    "deployment-misspelt-readinessProbe": (IN_PLACE, "Deployment", "spec.template.spec.containers[0].readinessProbe",
                                           None, "readinesProbe"),
    "deployment-replicas-string": (IN_PLACE, "Deployment", "spec.replicas", "one", None),
}


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_schemas_refuse_a_manifest_with_a_mistake(mistake):
    manifest, kind, path, value, rename = MISTAKES[mistake]
    original = k8s.one(k8s.documents(k8s.MANIFESTS[manifest]), kind)
    version = k8s.kubernetes_versions()[-1]
    assert not [c for c in k8s.checks([original], version) if c.errors]
    broken = _break(original, path, value, rename)
    errors = [e for c in k8s.checks([broken], version) for e in c.errors]
    assert errors, f"{mistake}: no schema refused it"
    field = (rename or path.rsplit(".", 1)[-1]).split("[")[0]
    assert any(field in e for e in errors), errors


# ---------------------------------------------------------------------------------------------
# The stack's promises, in every pod of every workload

def _pods(workload: str) -> list[k8s.Pod]:
    return k8s.pod_environments(workload, k8s.documents(k8s.MANIFESTS[workload]))


def _claims() -> set[str]:
    return {d["metadata"]["name"] for d in k8s.documents(k8s.MANIFESTS["storage"])
            if d["kind"] == "PersistentVolumeClaim"}


@pytest.mark.parametrize("workload", [*WORKLOADS, IN_PLACE])
def test_pods_run_as_the_images_user_with_shm_and_checkpoints_on_a_claim(workload):
    uid, gid = image_uid_gid()
    for pod in _pods(workload):
        security = pod.pod_spec["securityContext"]
        assert security["runAsNonRoot"] is True and (security["runAsUser"], security["runAsGroup"]) == (uid, gid)
        assert security["fsGroup"] == gid  # the claims writable by that user
        assert pod.container["securityContext"]["allowPrivilegeEscalation"] is False
        volumes = {v["name"]: v for v in pod.pod_spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in pod.container["volumeMounts"]}
        assert mounts["/dev/shm"]["emptyDir"]["medium"] == "Memory" and mounts["/dev/shm"]["emptyDir"]["sizeLimit"]
        # The image's own TRAIN_CHECKPOINT_DIR and TRAIN_LOG_DIR: rank 0 writes to the claims.
        assert mounts["/checkpoints"]["persistentVolumeClaim"]["claimName"] in _claims()
        assert mounts["/runs"]["persistentVolumeClaim"]["claimName"] in _claims()
        assert not {"TRAIN_CHECKPOINT_DIR", "TRAIN_LOG_DIR", "TRAIN_RESUME"} & set(pod.env)  # resume: auto
        assert pod.pod_spec["enableServiceLinks"] is False  # no Service can shadow MASTER_PORT


@pytest.mark.parametrize("workload", [*WORKLOADS, "pytorchjob-elastic", IN_PLACE])
def test_a_stop_has_one_grace_period_the_launcher_sees_and_fits_in(workload):
    """The pod's terminationGracePeriodSeconds is in its environment (the launcher warns when STOP_GRACE_PERIOD would
    outlast it), and the launcher's default STOP_GRACE_PERIOD fits in it."""
    from trainer.config import launcher

    for pod in _pods(workload):
        grace = pod.pod_spec["terminationGracePeriodSeconds"]
        assert pod.env["TERMINATION_GRACE_PERIOD_SECONDS"] == str(grace)
        assert launcher.grace_s(pod.env) <= grace and not launcher.grace_warnings(pod.env, launcher.grace_s(pod.env))


@pytest.mark.parametrize("workload", [*WORKLOADS, IN_PLACE])
def test_tensorboard_listens_on_loopback_beside_rank_0(workload):
    pod0 = _pods(workload)[0]
    [sidecar] = [c for c in pod0.pod_spec.get("initContainers", []) if c["name"] == "tensorboard"]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: the pod still completes
    command = sidecar["command"]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--port") + 1] == str(sidecar["ports"][0]["containerPort"]) == "6006"
    assert {"name": "runs", "mountPath": "/runs", "readOnly": True} in sidecar["volumeMounts"]


def test_a_failed_pod_is_restarted_and_a_usage_error_is_not():
    docs = {w: k8s.documents(k8s.MANIFESTS[w]) for w in (*WORKLOADS, IN_PLACE)}
    for workload in ("indexed-job", IN_PLACE):
        job = k8s.one(docs[workload], "Job")["spec"]
        assert job["backoffLimit"] > 0 and job["template"]["spec"]["restartPolicy"] == "Never"
        assert {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]}} \
            in job["podFailurePolicy"]["rules"]
    lighthouse = k8s.lighthouse(docs[IN_PLACE])  # restarted in its pod, its pod replaced by the Deployment
    assert lighthouse.pod_spec["restartPolicy"] == "Always" and lighthouse.deployment["spec"]["replicas"] == 1

    pytorchjob = k8s.one(docs["pytorchjob"], "PyTorchJob")["spec"]
    assert pytorchjob["runPolicy"]["backoffLimit"] > 0
    assert {s["restartPolicy"] for s in pytorchjob["pytorchReplicaSpecs"].values()} == {"OnFailure"}

    jobset = k8s.one(docs["trainjob"], "TrainingRuntime")["spec"]["template"]["spec"]
    assert jobset["failurePolicy"]["maxRestarts"] > 0
    [node] = jobset["replicatedJobs"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "In", "values": [2]}} \
        in node["template"]["spec"]["podFailurePolicy"]["rules"]
    assert [r["onJobFailureReasons"] for r in jobset["failurePolicy"]["rules"] if r["action"] == "FailJobSet"] \
        == [["PodFailurePolicy"]]
# ---------------------------------------------------------------------------------------------
# The topology every pod resolves, through the launcher users run (trainer-launch --dry-run)

def dry_run(env: dict[str, str]) -> dict:
    """What `trainer-launch --dry-run` resolves in a pod with exactly this environment (no GPU here)."""
    clean = {k: v for k, v in clean_env().items() if not k.startswith(("PET_", "SKYPILOT_", "JOB_COMPLETION_INDEX"))}
    out = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--dry-run"], env={**clean, **env},
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


SOURCE = {"trainjob": "torchrun-env", "pytorchjob": "pytorchjob", "indexed-job": "indexed-job"}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_each_pod_resolves_its_own_node_of_one_topology(workload):
    pods = _pods(workload)
    assert len(pods) == 2
    resolved = [dry_run(pod.env) for pod in pods]
    for pod, topology in zip(pods, resolved):
        assert topology["node_rank"] == pod.index, topology
        assert (topology["nnodes"], topology["nproc_per_node"]) == (2, 4), topology
        assert topology["master_addr"] == k8s.master_host(workload, k8s.documents(k8s.MANIFESTS[workload]))
        assert topology["master_port"] == 29500
        assert SOURCE[workload] in topology["source"].split("+"), topology
        assert topology["command"][:3] == ["torchrun", "--nnodes=2", f"--node-rank={pod.index}"]
    assert len({(t["master_addr"], t["master_port"], t["source"]) for t in resolved}) == 1


def test_an_elastic_pytorchjobs_pods_resolve_one_c10d_rendezvous_at_worker_0():
    """elasticPolicy minReplicas:maxReplicas: every pod gets the same settings from the operator and runs
    torchrun's c10d rendezvous at worker-0 with the range, restarts from maxRestarts, no node rank of its own."""
    pods = k8s.pod_environments("pytorchjob-elastic", k8s.documents(k8s.MANIFESTS["pytorchjob-elastic"]))
    assert len(pods) == 2
    resolved = [dry_run(pod.env) for pod in pods]
    for topology in resolved:
        assert (topology["nnodes"], topology["min_nodes"], topology["max_nodes"]) == ("1:2", 1, 2), topology
        assert topology["node_rank"] == "assigned by the rendezvous" and topology["world_sizes"] == [4, 8]
        assert (topology["master_addr"], topology["master_port"]) == ("ddp-trainer-elastic-worker-0", 29500)
        command = topology["command"]
        assert command[:2] == ["torchrun", "--nnodes=1:2"] and "--rdzv-backend=c10d" in command
        assert "--rdzv-endpoint=ddp-trainer-elastic-worker-0:29500" in command and "--max-restarts=10" in command
    assert len({json.dumps(t, sort_keys=True) for t in resolved}) == 1  # the same job on every pod


# ---------------------------------------------------------------------------------------------
# The in-place job: its lighthouse on its own, behind a Service, and workers that meet there

def test_an_in_place_jobs_pods_meet_in_place_at_the_lighthouses_service():
    """Every worker pod of k8s/indexed-job-inplace.yaml resolves, through trainer-launch --dry-run with exactly its
    environment, to the same in-place job: NNODES=1:2, no node rank of its own (JOB_COMPLETION_INDEX unused), torchft's
    lighthouse at the Service's name and port, no c10d rendezvous across the pods."""
    docs = k8s.documents(k8s.MANIFESTS[IN_PLACE])
    service = k8s.lighthouse(docs).service
    [port] = service["spec"]["ports"]
    pods = _pods(IN_PLACE)
    assert len(pods) == 2 and [p.env["JOB_COMPLETION_INDEX"] for p in pods] == ["0", "1"]
    resolved = [dry_run(pod.env) for pod in pods]
    for topology in resolved:
        assert (topology["nnodes"], topology["min_nodes"], topology["max_nodes"]) == ("1:2", 1, 2), topology
        assert topology["world_sizes"] == [4, 8] and topology["recovery"] == "in-place", topology
        assert topology["node_rank"].startswith("none (in place") and topology["rendezvous"].startswith("none (in place")
        assert (topology["master_addr"], topology["master_port"]) == (service["metadata"]["name"], port["port"])
        assert f"torchft's lighthouse at http://{service['metadata']['name']}:{port['port']} " \
            in topology["recovery_line"], topology
    # The same job on every pod (the command differs only in the free port of each pod's own group).
    assert len({json.dumps({**t, "command": None}, sort_keys=True) for t in resolved}) == 1


def test_the_lighthouse_runs_apart_with_the_jobs_settings_behind_one_address():
    """The lighthouse's Deployment runs it as compose.multinode.yaml's service does (tini, python3 -m
    trainer.cluster.lighthouse), with the workers' MASTER_PORT, NNODES and collective timeout; one replica, never two
    at once (an update stops the old one first); its Service is a ClusterIP (an address that outlives the lighthouse's
    pod, the job's identity in the checkpoint directory) that selects the lighthouse's pod and no worker's."""
    docs = k8s.documents(k8s.MANIFESTS[IN_PLACE])
    lighthouse = k8s.lighthouse(docs)
    env = _pods(IN_PLACE)[0].env
    spec = lighthouse.deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    assert lighthouse.argv[:5] == ["tini", "--", "python3", "-m", "trainer.cluster.lighthouse"]
    assert lighthouse.option("--port") == env["MASTER_PORT"] and lighthouse.option("--nnodes") == env["NNODES"]
    assert lighthouse.option("--join-timeout") == env.get("TRAIN_COLLECTIVE_TIMEOUT", "300")

    service = lighthouse.service["spec"]
    assert service.get("type", "ClusterIP") == "ClusterIP" and service.get("clusterIP") != "None"
    assert lighthouse.service["metadata"]["name"] == env["MASTER_ADDR"]
    [port] = service["ports"]
    [container_port] = lighthouse.container["ports"]
    assert str(port["port"]) == env["MASTER_PORT"] and port["targetPort"] == container_port["name"]
    assert container_port["containerPort"] == int(env["MASTER_PORT"])
    selector = service["selector"].items()
    assert selector <= lighthouse.deployment["spec"]["template"]["metadata"]["labels"].items()
    assert selector <= spec["selector"]["matchLabels"].items()
    worker_labels = k8s.one(docs, "Job")["spec"]["template"]["metadata"]["labels"]
    assert not selector <= worker_labels.items(), "the Service would send the lighthouse's traffic to a worker"
    security = lighthouse.pod_spec["securityContext"]
    assert security["runAsNonRoot"] is True and (security["runAsUser"], security["runAsGroup"]) == image_uid_gid()
    assert lighthouse.container["securityContext"]["allowPrivilegeEscalation"] is False
    assert lighthouse.pod_spec["enableServiceLinks"] is False


def test_the_lighthouse_as_its_deployment_starts_it_answers_its_probes_and_stops_at_once():
    """The lighthouse's container command, run as is (tini included; only the port is a free one here): its readiness
    probe's HTTP GET is answered 200 on the probe's path (the dashboard page the launchers ask for: answers() is None),
    and SIGTERM, what the kubelet sends first, ends it with exit 0 well inside terminationGracePeriodSeconds."""
    from trainer.cluster import lighthouse as lighthouse_module

    lighthouse = k8s.lighthouse(k8s.documents(k8s.MANIFESTS[IN_PLACE]))
    port = free_port()
    argv = list(lighthouse.argv)
    argv[argv.index("--port") + 1] = str(port)
    assert argv[2] == "python3"
    argv[2] = sys.executable  # the image's python3, here this test's
    probe = lighthouse.container["readinessProbe"]["httpGet"]
    assert probe["port"] == lighthouse.container["ports"][0]["name"]
    proc = subprocess.Popen(argv, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while lighthouse_module.answers("127.0.0.1", port) is not None:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)[0]
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{probe['path']}", timeout=5) as answer:
            assert answer.status == 200  # the kubelet's httpGet probe succeeds on 200-399
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=lighthouse.pod_spec["terminationGracePeriodSeconds"]) == 0
        assert time.monotonic() - began < 3, "SIGTERM should end the lighthouse at once"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
