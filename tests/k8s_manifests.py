"""The k8s/ manifests as the tests see them: their documents, the API schemas they must fit, and the
environment each controller gives the pods it makes from them.

Schemas, all offline:
  * Kubernetes' own (kubernetes-validate bundles the API's JSON schemas per release; the strict
    variants refuse unknown fields): every core object, and the pod and Job templates inside the
    Kubeflow objects.
  * Kubeflow Trainer v2 (TrainJob, TrainingRuntime, the JobSet template): the models of
    kubeflow-trainer-api, generated from the Trainer's OpenAPI spec, as a JSON schema made strict,
    with their Kubernetes types replaced by the Kubernetes schemas above.
  * Kubeflow Training Operator v1 (PyTorchJob): the models of kubeflow-training (the operator's
    generated SDK) as a strict JSON schema built from their declared field types, with their
    Kubernetes types replaced alike.
No package ships the CRDs' own openAPIV3Schema; these models are generated from the same API types.

Controllers: pod_environments() gives, for each pod a controller would create from a manifest, the
variables the manifest sets on the trainer container plus those the controller injects, as read in
its source (cited at each function).
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "k8s"
MANIFESTS = {"trainjob": K8S_DIR / "trainjob.yaml", "pytorchjob": K8S_DIR / "pytorchjob.yaml",
             "indexed-job": K8S_DIR / "indexed-job.yaml", "storage": K8S_DIR / "storage.yaml",
             "pytorchjob-elastic": K8S_DIR / "pytorchjob-elastic.yaml",
             "indexed-job-inplace": K8S_DIR / "indexed-job-inplace.yaml"}
# Native sidecars (an init container with restartPolicy: Always) are on by default from 1.29.
OLDEST_KUBERNETES = "1.29"
K8S_DEFS = "https://kubernetes.io/api/_definitions.json"


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} documents of kind {kind}"
    return found[0]


# ---------------------------------------------------------------------------------------------
# Kubernetes' schemas (kubernetes-validate)

def kubernetes_versions() -> list[str]:
    from kubernetes_validate import utils as kubernetes_validate

    return sorted({OLDEST_KUBERNETES, kubernetes_validate.latest_version()})


@functools.lru_cache(maxsize=None)
def _k8s_definitions(version: str) -> dict:
    import importlib.resources

    from kubernetes_validate import utils as kubernetes_validate

    version = [v for v in kubernetes_validate.all_versions() if v.startswith(version + ".") or v == version][-1]
    ref = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{version}-local-strict"
    return json.loads((ref / "_definitions.json").read_text())


def core_errors(doc: dict, version: str) -> list[str]:
    """A whole object of a built-in kind against the strict schema of that Kubernetes release."""
    from kubernetes_validate import utils as kubernetes_validate

    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        return [_describe(err)]
    return []


def _validator(schema: dict, version: str):  # schemas are read, never changed
    import jsonschema
    from referencing import Registry, Resource

    registry = Registry().with_resource(K8S_DEFS, Resource.from_contents(_k8s_definitions(version)))
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _describe(err) -> str:
    """The deepest error: an optional field's anyOf [X, null] would otherwise only say 'not valid'."""
    def leaves(e):
        if not e.context:
            yield e
        for c in e.context:
            yield from leaves(c)

    found = [e for e in leaves(err) if not e.message.endswith("is not of type 'null'")] or [err]
    err = max(found, key=lambda e: len(e.absolute_path))
    where = "/".join(str(p) for p in err.absolute_path) or "(top)"
    return f"{where}: {err.message[:300]}"


def schema_errors(value: Any, schema: dict, version: str) -> list[str]:
    return sorted(_describe(e) for e in _validator(schema, version).iter_errors(value))


def k8s_ref(definition: str) -> dict:
    return {"$ref": f"{K8S_DEFS}#/$defs/{definition}"}


@functools.lru_cache(maxsize=None)
def _k8s_class_names(version: str) -> dict[str, str]:
    """Generated class names -> Kubernetes definition names, in both generators' spellings:
    IoK8sApiCoreV1PodTemplateSpec (kubeflow-trainer-api) and V1PodTemplateSpec (kubeflow-training)."""
    names: dict[str, str] = {}
    for definition in _k8s_definitions(version)["$defs"]:
        parts = definition.split(".")
        camel = "".join(p[:1].upper() + p[1:] for p in parts)
        names[camel] = definition
        names["K8sIo" + camel[len("IoK8s"):]] = definition  # kubeflow-training's spelling of some
        short = parts[-2][:1].upper() + parts[-2][1:] + parts[-1]  # v1.PodTemplateSpec -> V1PodTemplateSpec
        # The kubernetes client names core and meta types without their group; they win a clash.
        for alias in (short, parts[-1]):  # kubeflow-training names Quantity bare
            if alias not in names or definition.startswith(("io.k8s.api.core.", "io.k8s.apimachinery.pkg.api")):
                names[alias] = definition
    return names


# ---------------------------------------------------------------------------------------------
# Kubeflow Trainer v2: kubeflow-trainer-api's pydantic models as a strict JSON schema

@functools.lru_cache(maxsize=None)
def trainer_v2_schema(kind: str, version: str) -> dict:
    import kubeflow_trainer_api.models as models

    model = {"TrainJob": models.TrainerV1alpha1TrainJob,
             "TrainingRuntime": models.TrainerV1alpha1TrainingRuntime,
             "ClusterTrainingRuntime": models.TrainerV1alpha1ClusterTrainingRuntime}[kind]
    schema = model.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
    k8s = _k8s_class_names(version)
    defs = schema.pop("$defs", {})
    replaced = {name: k8s_ref(k8s[name]) for name in defs if name in k8s}
    for name, definition in defs.items():
        if name not in replaced:
            _strict(definition)
    _strict(schema)
    schema["$defs"] = {**{n: d for n, d in defs.items() if n not in replaced}, **replaced}
    return schema


def _strict(schema: dict) -> None:
    """Unknown fields are errors, as for the API server's strict field validation."""
    if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False


# ---------------------------------------------------------------------------------------------
# Kubeflow Training Operator v1: kubeflow-training's generated models as a strict JSON schema

@functools.lru_cache(maxsize=None)
def pytorchjob_schema(version: str) -> dict:
    from kubeflow.training import models

    defs: dict[str, dict] = {}
    k8s = _k8s_class_names(version)

    def of(type_name: str) -> dict:
        simple = {"str": {"type": "string"}, "int": {"type": "integer"}, "bool": {"type": "boolean"},
                  "float": {"type": "number"}, "object": {}, "datetime": {"type": "string"}}
        if type_name in simple:
            return simple[type_name]
        if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
            return {"type": "object", "additionalProperties": of(m.group(1))}
        if m := re.fullmatch(r"list\[(.+)\]", type_name):
            return {"type": "array", "items": of(m.group(1))}
        if type_name.startswith("KubeflowOrgV1"):
            if type_name not in defs:
                defs[type_name] = {}  # placeholder against recursion
                cls = getattr(models, type_name)
                source = inspect.getsource(cls)
                required = [cls.attribute_map[a] for a in cls.openapi_types
                            if re.search(rf"Invalid value for `{a}`, must not be `None`", source)]
                defs[type_name] = {"type": "object", "additionalProperties": False, "required": required,
                                   "properties": {cls.attribute_map[a]: of(t) for a, t in cls.openapi_types.items()}}
            return {"$ref": f"#/$defs/{type_name}"}
        if type_name in k8s:
            return k8s_ref(k8s[type_name])
        raise AssertionError(f"kubeflow-training names a type this schema builder does not know: {type_name}")

    schema = of("KubeflowOrgV1PyTorchJob")
    return {**schema, "$defs": defs}


# ---------------------------------------------------------------------------------------------
# Every document of a manifest, with the schema(s) it must fit

@dataclass
class Check:
    what: str        # e.g. "PyTorchJob ddp-trainer (Kubeflow v1 schema)"
    errors: list[str]


def checks(docs: list[dict], version: str) -> Iterator[Check]:
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind in ("TrainJob", "TrainingRuntime", "ClusterTrainingRuntime"):
            yield Check(f"{kind} {name} (Kubeflow Trainer v2 schema, Kubernetes {version})",
                        schema_errors(doc, trainer_v2_schema(kind, version), version))
            yield from _embedded(doc, version)
        elif kind == "PyTorchJob":
            yield Check(f"{kind} {name} (Kubeflow Training Operator v1 schema, Kubernetes {version})",
                        schema_errors(doc, pytorchjob_schema(version), version))
            yield from _embedded(doc, version)
        else:
            yield Check(f"{kind} {name} (Kubernetes {version})", core_errors(doc, version))


def _embedded(doc: dict, version: str) -> Iterator[Check]:
    """The Kubernetes objects inside a Kubeflow one, each against Kubernetes' own strict schema."""
    kind, name = doc["kind"], doc["metadata"]["name"]
    if kind == "PyTorchJob":
        for replica, spec in doc["spec"]["pytorchReplicaSpecs"].items():
            template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{name}-{replica}"},
                        "template": spec["template"]}
            yield Check(f"{kind} {name}: {replica} pod template (Kubernetes {version})", core_errors(template, version))
    elif kind in ("TrainingRuntime", "ClusterTrainingRuntime"):
        for job in doc["spec"]["template"]["spec"]["replicatedJobs"]:
            as_job = {"apiVersion": "batch/v1", "kind": "Job",
                      "metadata": {"name": job["name"], **job["template"].get("metadata", {})},
                      "spec": job["template"]["spec"]}
            yield Check(f"{kind} {name}: Job template {job['name']} (Kubernetes {version})",
                        core_errors(as_job, version))
    elif kind == "TrainJob":
        trainer = doc["spec"].get("trainer", {})
        container = {"name": "node", **({"env": trainer["env"]} if "env" in trainer else {}),
                     **({"resources": trainer["resourcesPerNode"]} if "resourcesPerNode" in trainer else {})}
        yield Check(f"{kind} {name}: trainer env and resources (Kubernetes {version})",
                    schema_errors(container, k8s_ref("io.k8s.api.core.v1.Container"), version))


# ---------------------------------------------------------------------------------------------
# What each controller puts in the environment of the pods it creates

TRAINER_V2_PORT = 29500  # kubeflow/trainer pkg/constants: ContainerTrainerPort


@dataclass
class Pod:
    name: str               # what the controller would call the pod
    index: int              # its node index
    env: dict[str, str]     # the trainer container's environment, as the controller sets it
    container: dict         # the trainer container of the manifest (image, securityContext, ...)
    pod_spec: dict


def static_env(container: dict) -> dict[str, str]:
    """The container's env entries with a value; valueFrom entries are the controllers' business."""
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def pod_environments(kind: str, docs: list[dict]) -> list[Pod]:
    return {"trainjob": _trainjob_pods, "pytorchjob": _pytorchjob_pods, "indexed-job": _indexed_job_pods,
            "pytorchjob-elastic": _elastic_pytorchjob_pods, "indexed-job-inplace": _indexed_job_pods}[kind](docs)


def _elastic_pytorchjob_pods(docs: list[dict]) -> list[Pod]:
    """kubeflow/training-operator pkg/controller.v1/pytorch/elastic.go (ElasticEnvVarGenerator) for a job of
    Worker replicas only: PYTHONUNBUFFERED=0, PET_RDZV_ENDPOINT (<job>-worker-0:<the pytorchjob-port>),
    PET_RDZV_BACKEND (rdzvBackend, c10d by default), PET_NNODES (minReplicas:maxReplicas), PET_MAX_RESTARTS
    (maxRestarts), PET_NPROC_PER_NODE (nprocPerNode); no Master, so no MASTER_*, RANK or WORLD_SIZE."""
    job = one(docs, "PyTorchJob")
    name, policy, specs = job["metadata"]["name"], job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Worker"}, "the model below covers an elastic job of workers"
    [port] = [p["containerPort"] for c in specs["Worker"]["template"]["spec"]["containers"] if c["name"] == "pytorch"
              for p in c.get("ports", []) if p.get("name") == "pytorchjob-port"]
    pods = []
    for i in range(specs["Worker"].get("replicas", 1)):
        pod_spec = specs["Worker"]["template"]["spec"]
        [container] = [c for c in pod_spec["containers"] if c["name"] == "pytorch"]
        env = {**static_env(container), "PYTHONUNBUFFERED": "0", "PET_RDZV_ENDPOINT": f"{name}-worker-0:{port}",
               "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
               "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
               "PET_MAX_RESTARTS": str(policy["maxRestarts"]), "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"]}
        pods.append(Pod(f"{name}-worker-{i}", i, env, container, pod_spec))
    return pods


def _trainjob_pods(docs: list[dict]) -> list[Pod]:
    """kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go (EnforceMLPolicy): trainer.env is
    upserted onto the runtime's "node" container, then PET_NNODES (numNodes), PET_NPROC_PER_NODE
    (numProcPerNode), PET_NODE_RANK (the Job completion index annotation), PET_MASTER_ADDR
    (<trainjob>-node-0-0.<trainjob>) and PET_MASTER_PORT (29500). The Indexed Job under the JobSet
    adds JOB_COMPLETION_INDEX (Kubernetes' job controller)."""
    job, runtime = one(docs, "TrainJob"), one(docs, "TrainingRuntime")
    trainer = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    [node_job] = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "node"]
    pod_spec = node_job["template"]["spec"]["template"]["spec"]
    [container] = [c for c in pod_spec["containers"] if c["name"] == "node"]
    nnodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"].get("numNodes", 1))
    name = job["metadata"]["name"]
    pods = []
    for index in range(nnodes):
        env = {**static_env(container), **static_env(trainer)}
        env.update(PET_NNODES=str(nnodes), PET_NPROC_PER_NODE=str(trainer["numProcPerNode"]),
                   PET_NODE_RANK=str(index), PET_MASTER_ADDR=f"{name}-node-0-0.{name}",
                   PET_MASTER_PORT=str(TRAINER_V2_PORT), JOB_COMPLETION_INDEX=str(index))
        pods.append(Pod(f"{name}-node-0-{index}", index, env, container, pod_spec))
    return pods


def _pytorchjob_pods(docs: list[dict]) -> list[Pod]:
    """kubeflow/training-operator pkg/controller.v1/pytorch/envvar.go (setPodEnv) and master.go:
    PYTHONUNBUFFERED=0, MASTER_PORT (the container port named pytorchjob-port of the Master),
    MASTER_ADDR (<job>-master-0), WORLD_SIZE (all replicas x nprocPerNode), RANK and PET_NODE_RANK
    (Master 0, Worker i -> i + 1), PET_NPROC_PER_NODE (nprocPerNode) and, without elasticPolicy,
    PET_NNODES (all replicas)."""
    job = one(docs, "PyTorchJob")
    name, specs = job["metadata"]["name"], job["spec"]["pytorchReplicaSpecs"]
    nproc = job["spec"].get("nprocPerNode", "auto")  # pytorch_defaults.go: DefaultNprocPerNode
    assert "elasticPolicy" not in job["spec"], "the model below covers the non-elastic job"
    replicas = {kind: spec.get("replicas", 1) for kind, spec in specs.items()}
    total = sum(replicas.values())
    world_size = total * (int(nproc) if nproc.isdigit() else 1)  # getNprocPerNodeInt: 1 unless a number
    [master_port] = [p["containerPort"] for c in specs["Master"]["template"]["spec"]["containers"]
                     if c["name"] == "pytorch" for p in c.get("ports", []) if p.get("name") == "pytorchjob-port"]
    pods = []
    for kind in ("Master", "Worker"):
        pod_spec = specs[kind]["template"]["spec"] if kind in specs else None
        for i in range(replicas.get(kind, 0)):
            [container] = [c for c in pod_spec["containers"] if c["name"] == "pytorch"]
            rank = i + 1 if kind == "Worker" else i
            env = {**static_env(container), "PYTHONUNBUFFERED": "0", "MASTER_PORT": str(master_port),
                   "MASTER_ADDR": f"{name}-master-0", "WORLD_SIZE": str(world_size), "RANK": str(rank),
                   "PET_NPROC_PER_NODE": nproc, "PET_NODE_RANK": str(rank), "PET_NNODES": str(total)}
            pods.append(Pod(f"{name}-{kind.lower()}-{i}", rank, env, container, pod_spec))
    return pods


def _indexed_job_pods(docs: list[dict]) -> list[Pod]:
    """Kubernetes' job controller gives each pod of an Indexed Job JOB_COMPLETION_INDEX, its index
    (pkg/controller/job/indexed_job_utils.go), and the hostname <job>-<index>; the manifest sets the rest."""
    job = one(docs, "Job")
    name, spec = job["metadata"]["name"], job["spec"]
    assert spec["completionMode"] == "Indexed"
    pod_spec = spec["template"]["spec"]
    [container] = [c for c in pod_spec["containers"] if c["name"] == "trainer"]
    return [Pod(f"{name}-{index}", index, {**static_env(container), "JOB_COMPLETION_INDEX": str(index)},
                container, pod_spec)
            for index in range(spec["completions"])]


@dataclass
class Lighthouse:
    """An in-place job's lighthouse as its Deployment runs it, and the Service the workers reach it by."""
    service: dict
    deployment: dict
    container: dict
    pod_spec: dict

    @property
    def argv(self) -> list[str]:
        """Its container's command line: the image's entrypoint replaced by command, then args."""
        return [*self.container["command"], *self.container.get("args", [])]

    def option(self, name: str) -> str:
        return self.argv[self.argv.index(name) + 1]


def lighthouse(docs: list[dict]) -> Lighthouse:
    deployment = one(docs, "Deployment")
    [service] = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == deployment["metadata"]["name"]]
    pod_spec = deployment["spec"]["template"]["spec"]
    [container] = [c for c in pod_spec["containers"] if c["name"] == "lighthouse"]
    return Lighthouse(service, deployment, container, pod_spec)


def master_host(kind: str, docs: list[dict]) -> str:
    """The DNS name the pods meet at (pod 0), as the cluster would resolve it."""
    env = pod_environments(kind, docs)[0].env
    return env.get("PET_MASTER_ADDR") or env.get("MASTER_ADDR") or env["PET_RDZV_ENDPOINT"].rpartition(":")[0]
