"""Where this process sits in the job: the one topology resolver (torch-free).

trainer-launch, trainer-doctor, the worker (`python -m trainer`, trainer.api) and the agent's messages all get the
topology from resolve(), which reads torchrun's variables in a worker it started, then the explicit ones (NNODES,
NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT), torchrun's PET_* (Kubeflow Trainer v2), a Kubeflow
PyTorchJob v1, Slurm (one task per node or per GPU; MASTER_PORT from SLURM_JOB_ID), a Kubernetes Indexed Job,
SkyPilot, RANK and WORLD_SIZE alone, else one host: the order and the variables of each are docs/clusters.md's
table. Where several sources give the node count, node rank, processes per node or world size they must agree
(NODE_RANK=1 beside SLURM_NODEID=0 is an error naming both); the master's address and port come from the first
that names them. Every value keeps where it came from (Topology.sources), which --dry-run, trainer-doctor and the
one-line errors show. NNODES=MIN:MAX (or PET_NNODES=MIN:MAX) asks for elastic membership (c10d rendezvous).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

from trainer.config import launcher
from trainer.core.errors import UsageError

DEFAULT_MASTER_PORT = 29500
LOCALHOST = "127.0.0.1"
LAUNCHER, WORKER = "launcher", "worker"  # who asks: trainer-launch/trainer-doctor, or the training process
TORCHRUN, DIRECT = "torchrun", "worker"  # Topology.mode: start torchrun for this node / be one rank now

# Source names, in the documented order; what each is, for messages.
SOURCES = {
    "torchrun": "torchrun (this process is one of its workers)",
    "explicit": "set by hand (compose, the shell, the job script)",
    "torchrun-env": "torchrun's PET_* variables (Kubeflow Trainer v2's torch runtime sets them)",
    "pytorchjob": "Kubeflow PyTorchJob v1",
    "slurm": "Slurm",
    "indexed-job": "a Kubernetes Indexed Job",
    "skypilot": "SkyPilot",
    "default": "the default",
}
EXPLICIT_NAMES = {"nnodes": "NNODES", "node_rank": "NODE_RANK", "nproc_per_node": "NPROC_PER_NODE",
                  "master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT", "rank": "RANK", "world_size": "WORLD_SIZE"}
ELASTIC_VARIABLES = ("PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT")
SLURM_BATCH_STEP = "4294967294"  # the batch script's step id, should a Slurm ever export it
# Slurm derives MASTER_PORT from the job id in this range: below Linux's ephemeral ports (32768+),
# above most services', and never the torchrun default that a job on the same node may be using.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 9000


@dataclass(frozen=True)
class Topology:
    """Who runs where. mode TORCHRUN: trainer-launch starts torchrun with nproc_per_node workers on this
    node (rank, local_rank are then those of its first worker). mode DIRECT: this process is one rank."""
    mode: str
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    started_by: str  # DIRECT mode: "torchrun", "slurm", "pytorchjob", "explicit" (RANK/WORLD_SIZE), "default"
    sources: Mapping[str, str] = field(default_factory=dict)  # field -> "VAR (source)", "default", ...
    # Elastic membership (NNODES=MIN:MAX): the fewest hosts the job goes on with; nnodes is then the most,
    # node_rank is assigned by torchrun's c10d rendezvous, and world_size is the largest. 0: a fixed world.
    min_nodes: int = 0

    @property
    def elastic(self) -> bool:
        return self.min_nodes > 0

    @property
    def node_range(self) -> str:
        return f"{self.min_nodes}:{self.nnodes}" if self.elastic else str(self.nnodes)

    @property
    def distributed(self) -> bool:
        """A process group forms (even of one rank, when RANK and WORLD_SIZE say so)."""
        return self.mode == TORCHRUN or self.started_by != "default"

    @property
    def source(self) -> str:
        """The sources behind the values, in the documented order: 'slurm', 'explicit+indexed-job'."""
        named = {s.rsplit("(", 1)[1].rstrip(")").split(",")[0] for s in self.sources.values() if s.endswith(")")}
        return "+".join(s for s in SOURCES if s in named and s != "default") or "default"

    def variables(self, *fields: str) -> list[str]:
        """The variables behind these fields, for messages that tell the user what to check: the ones that
        gave them, or the explicit ones that would (MASTER_PORT for a default port)."""
        names = []
        for name in fields:
            given = self.sources.get(name, "default").split(" (")[0]
            names.append(given if given.isupper() else EXPLICIT_NAMES[name])
        return list(dict.fromkeys(names))

    def facts(self, in_place: bool = False) -> dict:
        """What --dry-run prints (without the command). in_place: an elastic job recovering in place, where no
        rendezvous runs across the hosts (each host's group is its own; the lighthouse's quorum decides who trains
        each step)."""
        if self.elastic:
            sizes = [n * self.nproc_per_node for n in range(self.min_nodes, self.nnodes + 1)]
            layout = {"nnodes": self.node_range, "min_nodes": self.min_nodes, "max_nodes": self.nnodes,
                      "node_rank": "assigned by the rendezvous", "nproc_per_node": self.nproc_per_node,
                      "world_size": self.world_size, "world_sizes": sizes, "rendezvous": "c10d"}
            if in_place:
                layout.update(node_rank="none (in place: each host is a group of its own)",
                              rendezvous="none (in place: torchft's lighthouse decides who trains each step)")
        else:
            layout = {"nnodes": self.nnodes, "node_rank": self.node_rank, "nproc_per_node": self.nproc_per_node,
                      "world_size": self.world_size}
        return {"mode": self.mode, **layout, "master_addr": self.master_addr, "master_port": self.master_port,
                **({"rank": self.rank, "local_rank": self.local_rank} if self.mode == DIRECT else {}),
                "source": self.source, "sources": dict(self.sources)}

    def summary(self, in_place: bool = False) -> str:
        """The one line a normal start prints (in_place: as facts())."""
        ranks = f" rank={self.rank} local_rank={self.local_rank}" if self.mode == DIRECT else ""
        if self.elastic:
            how = (f", in place: torchft's lighthouse at {self.master_addr}:{self.master_port} decides who trains "
                   "each step; no c10d rendezvous, each host a group of its own") if in_place else \
                f": c10d rendezvous at {self.master_addr}:{self.master_port} assigns node ranks"
            return (f"topology: nnodes={self.node_range} (elastic{how}) nproc_per_node={self.nproc_per_node} "
                    f"world_size={self.min_nodes * self.nproc_per_node}..{self.world_size} (source: {self.source})")
        return (f"topology: nnodes={self.nnodes} node_rank={self.node_rank} nproc_per_node={self.nproc_per_node} "
                f"world_size={self.world_size}{ranks} master={self.master_addr}:{self.master_port} "
                f"(source: {self.source})")


# ----------------------------------------------------------------------------------- reading variables

def _label(var: str, source: str | None) -> str:
    return var if source is None else f"{var} ({source})"


def env_int(env: Mapping[str, str], var: str, default: int | None, minimum: int, maximum: int | None = None,
            source: str | None = None) -> int:
    """An integer environment setting, or the one-line error naming it and its source."""
    return launcher.env_int(env, var, default, minimum, maximum, _label(var, source),
                            None if source is None or source.startswith("explicit") else SOURCES[source])


def _given(env: Mapping[str, str], var: str) -> bool:
    return bool(env.get(var, "").strip())


@dataclass(frozen=True)
class _Value:
    value: object
    var: str
    source: str

    @property
    def label(self) -> str:
        return f"{self.var} ({self.source})"


def _agreed(what: str, candidates: list[_Value | None]) -> _Value | None:
    """The first candidate; any other that says otherwise is a contradiction, named with both sources."""
    given = [c for c in candidates if c is not None]
    for other in given[1:]:
        if other.value != given[0].value:
            first = given[0]
            raise UsageError(first.label, f"{what} {first.value} contradicts {other.var}={other.value} ({other.source})",
                             f"unset one of them, or give both the same {what}")
    return given[0] if given else None


# ----------------------------------------------------------------------------------- Slurm hostlists

_HOSTLIST_ITEM = re.compile(r"([^\[\],]*)(?:\[([^\[\]]*)\])?")


def _bracket_values(body: str, nodelist: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7'] (zero padding kept, as Slurm pads to the lower bound's width)."""
    values: list[str] = []
    for part in body.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"'[{body}]' holds '{part}', not a number or a range like 01-04")
        if not dash:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"the range '{part}' runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def _split_top_level(nodelist: str) -> list[str]:
    """Commas outside brackets separate hosts: 'n[1-3,5],gpu01' -> ['n[1-3,5]', 'gpu01']."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("brackets inside brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("a ']' without its '['")
        elif ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError("a '[' without its ']'")
    return items + [nodelist[start:]]


def expand_hostlist(nodelist: str) -> Iterator[str]:
    """The hosts of a Slurm hostlist, in order: 'n[1-2],gpu[01-02]' -> n1 n2 gpu01 gpu02; several bracket
    groups multiply ('r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2). ValueError says what cannot be read."""
    text = nodelist.strip()
    if not text:
        raise ValueError("it is empty")
    for item in _split_top_level(text):
        if not item.strip():
            raise ValueError("it has an empty host name (two commas, or a comma at an end)")
        if any(c.isspace() for c in item.strip()):
            raise ValueError(f"'{item.strip()}' contains a space")
        parts: list[list[str]] = []
        pos = 0
        while pos < len(item):
            match = _HOSTLIST_ITEM.match(item, pos)
            prefix, body = match.group(1), match.group(2)
            if match.end() == pos:  # neither text nor a bracket group: a stray bracket
                raise ValueError(f"cannot read '{item}'")
            parts.append([prefix])
            if body is not None:
                parts.append(_bracket_values(body, nodelist))
            pos = match.end()
        yield from _product(parts)


def _product(parts: list[list[str]]) -> Iterator[str]:
    if not parts:
        yield ""
        return
    for head in parts[0]:
        for tail in _product(parts[1:]):
            yield head + tail


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist, the whole list checked ('gpu[07-09,12],cpu1' -> 'gpu07')."""
    hosts = expand_hostlist(nodelist)
    first = next(hosts)
    for _ in hosts:  # the rest must parse too: a typo anywhere is the user's to hear about
        pass
    return first


def slurm_port(job_id: int) -> int:
    """MASTER_PORT for a Slurm job that sets none: the same on every node of the job, another per job."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def tasks_on_node(tasks_per_node: str, node_id: int) -> int | None:
    """Slurm's '2(x3),1' at node node_id (2 for nodes 0-2, 1 for node 3); None if it cannot be read."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node_id] if node_id < len(counts) else None


# ----------------------------------------------------------------------------------- the resolver

def started_by_torchrun(env: Mapping[str, str]) -> bool:
    return "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env


class _Resolver:
    def __init__(self, env: Mapping[str, str], role: str, gpu_count: Callable[[], int] | None):
        self.env, self.role = env, role
        self._gpu_count, self._gpus = gpu_count, None
        self.pytorchjob = (_given(env, "RANK") and _given(env, "WORLD_SIZE")
                           and any(_given(env, v) for v in ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK")))
        self.pet = "pytorchjob" if self.pytorchjob else "torchrun-env"
        self.slurm = any(_given(env, v) for v in ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_PROCID"))
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "")).strip()
        self.slurm_step = self.slurm and bool(step) and step != SLURM_BATCH_STEP

    def gpus(self) -> int:
        if self._gpus is None:
            self._gpus = self._gpu_count() if self._gpu_count else 0
        return self._gpus

    def explicit(self, var: str) -> str:
        """The source of a variable set by hand: "explicit", or with the dotenv file and line it came from."""
        where = getattr(self.env, "where", {}).get(var)
        return f"explicit, {where}" if where else "explicit"

    def int(self, var: str, source: str, minimum: int = 0, maximum: int | None = None) -> _Value | None:
        if not _given(self.env, var):
            return None
        source = self.explicit(var) if source == "explicit" else source
        return _Value(env_int(self.env, var, None, minimum, maximum, source), var, source)

    def first_of(self, *names: str) -> str:
        return next((n for n in names if _given(self.env, n)), names[-1])

    # -- the node layout --------------------------------------------------------------------------

    def node_range(self) -> _Value | None:
        """NNODES=MIN:MAX (or Kubeflow's PET_NNODES=MIN:MAX): (min, max) hosts, checked; None for a fixed count.
        A range beside a fixed count from another source mixes static and elastic, which is refused."""
        given = [(var, source, self.env[var].strip()) for var, source in (("NNODES", self.explicit("NNODES")),
                 ("PET_NNODES", self.pet)) if _given(self.env, var)]
        ranges = [g for g in given if ":" in g[2]]
        if not ranges:
            return None
        var, source, raw = ranges[0]
        label = _label(var, source)
        lo, _, hi = raw.partition(":")
        if not re.fullmatch(r"[0-9]+", lo.strip()) or not re.fullmatch(r"[0-9]+", hi.strip()):
            raise UsageError(label, f"'{raw}' is not a node count or a MIN:MAX range",
                             "give a number of hosts, or MIN:MAX such as 1:2 for elastic membership")
        low, high = int(lo), int(hi)
        if low < 1:
            raise UsageError(label, f"'{raw}' lets the job run on {low} hosts", "give MIN of at least 1, e.g. 1:"
                             f"{max(high, 1)}")
        if high < low:
            raise UsageError(label, f"'{raw}' runs backwards: MIN {low} is above MAX {high}",
                             f"give MIN:MAX with MIN <= MAX, e.g. {high}:{low}")
        for other, other_source, other_raw in given:
            if other_raw.replace(" ", "") != raw.replace(" ", ""):
                raise UsageError(label, f"the elastic range '{raw}' contradicts {other}={other_raw} ({other_source})",
                                 f"give both the same range, or unset {other}")
        return _Value((low, high), var, source)

    def refuse_elastic_variables(self) -> None:
        """PET_RDZV_* ask for elastic rendezvous; without a MIN:MAX range the job has a fixed size."""
        for var in ELASTIC_VARIABLES:
            if _given(self.env, var):
                raise UsageError(f"{var} ({self.pet})", "asks torchrun for elastic rendezvous, but the node count "
                                 "is fixed", "give PET_NNODES a MIN:MAX range (elasticPolicy minReplicas:maxReplicas), "
                                 "or drop the job's elasticPolicy")

    def elastic_topology(self, span: _Value) -> Topology:
        """NNODES=MIN:MAX: torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT assigns the node ranks."""
        low, high = span.value
        # The node ranks a controller derives (PET_NODE_RANK, an Indexed Job's JOB_COMPLETION_INDEX, a PyTorchJob's
        # RANK) are the pod's index, not a rank: the rendezvous's win. A NODE_RANK set by hand is a mistake.
        if _given(self.env, "NODE_RANK"):
            raise UsageError(f"NODE_RANK ({self.explicit('NODE_RANK')})", f"sets a node rank, but with {span.var}={low}:{high} the "
                             "rendezvous assigns them (a fixed rank would contradict it after a host is lost)",
                             "unset NODE_RANK on every host: the same settings serve them all")
        if self.slurm:
            raise UsageError(span.label, f"'{low}:{high}' asks for elastic membership, but a Slurm allocation has a "
                             "fixed set of nodes", "give a fixed node count under Slurm: preemption and requeue "
                             "are its way back (slurm/*.sbatch)")
        if not self.pytorchjob and (_given(self.env, "RANK") or _given(self.env, "WORLD_SIZE")):
            var = "RANK" if _given(self.env, "RANK") else "WORLD_SIZE"
            raise UsageError(_label(var, "explicit"),
                             f"fixes this process's rank, but {span.var}={low}:{high} asks for elastic membership",
                             f"unset {var} (torchrun sets the ranks after each rendezvous)")
        if self.role == WORKER:
            raise UsageError(span.label, f"elastic {low}:{high} hosts, but `python -m trainer` is a single process",
                             "start `trainer-launch` on every host, which runs torchrun's elastic agent")
        backend = self.env.get("PET_RDZV_BACKEND", "").strip()
        if backend and backend != "c10d":
            raise UsageError(f"PET_RDZV_BACKEND ({self.pet})", f"'{backend}' is not a rendezvous this trainer runs",
                             "use rdzvBackend: c10d (the rendezvous store on the MASTER_ADDR host)")
        endpoint = self.env.get("PET_RDZV_ENDPOINT", "").strip()
        if endpoint:
            host, _, port_text = endpoint.rpartition(":")
            if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise UsageError(f"PET_RDZV_ENDPOINT ({self.pet})", f"'{endpoint}' is not HOST:PORT",
                                 "give the rendezvous host and port, e.g. trainer-0:29400")
            addr = _Value(host, "PET_RDZV_ENDPOINT", self.pet)
            port = _Value(int(port_text), "PET_RDZV_ENDPOINT", self.pet)
        else:
            if high > 1 and not any(_given(self.env, v) for v in ("MASTER_ADDR", "PET_MASTER_ADDR")):
                raise UsageError("MASTER_ADDR (explicit)", f"is required when {span.var}={low}:{high}",
                                 "set it to the rendezvous host's address (it hosts the c10d store), the same "
                                 "on every host")
            addr = self.master_addr(_Value(high, span.var, span.source))
            port = self.master_port()
        procs = self.count_processes(self.nproc())
        if self.gpus() and procs.value > self.gpus():
            raise UsageError(procs.label if procs.source != "default" else "NPROC_PER_NODE",
                             f"{procs.value} processes but only {self.gpus()} GPUs are visible",
                             f"set NPROC_PER_NODE to at most {self.gpus()} (one process per GPU)")
        p = procs.value
        sources = {**self.sources(span, None, procs, addr, port), "node_rank": "the rendezvous (elastic)"}
        return Topology(TORCHRUN, high, 0, p, addr.value, port.value, 0, 0, high * p, p, "default", sources,
                        min_nodes=low)

    def nnodes(self) -> _Value | None:
        candidates = [self.int("NNODES", "explicit", 1), self.int("PET_NNODES", self.pet, 1)]
        if self.slurm:
            candidates.append(self.int(self.first_of("SLURM_STEP_NUM_NODES", "SLURM_NNODES"), "slurm", 1))
        candidates.append(self.int("SKYPILOT_NUM_NODES", "skypilot", 1))
        ips = self.skypilot_ips()
        if ips:
            candidates.append(_Value(len(ips), "SKYPILOT_NODE_IPS", "skypilot"))
        return _agreed("node count", candidates)

    def node_rank(self, nnodes: _Value | None) -> _Value | None:
        # An Indexed Job given NNODES=1 is a set of independent runs (a sweep): its index is no node rank.
        index = None if nnodes is not None and nnodes.value == 1 else self.int("JOB_COMPLETION_INDEX", "indexed-job")
        return _agreed("node rank", [
            self.int("NODE_RANK", "explicit"), self.int("PET_NODE_RANK", self.pet),
            self.int("RANK", "pytorchjob") if self.pytorchjob else None,
            self.int("SLURM_NODEID", "slurm") if self.slurm else None,
            index, self.int("SKYPILOT_NODE_RANK", "skypilot")])

    def nproc(self) -> _Value | None:
        """Processes per node as given (a number, or torchrun's word auto/cpu/gpu), None if no source says."""
        candidates = [self.int("NPROC_PER_NODE", "explicit", 1)]
        raw = self.env.get("PET_NPROC_PER_NODE", "").strip().lower()
        if raw in ("auto", "cpu", "gpu"):
            word = _Value(raw, "PET_NPROC_PER_NODE", self.pet)
        else:
            word = None
            candidates.append(self.int("PET_NPROC_PER_NODE", self.pet, 1))
        gpus = self.int("SKYPILOT_NUM_GPUS_PER_NODE", "skypilot")
        candidates.append(gpus if gpus and gpus.value else None)  # 0 on a CPU cluster: our default applies
        number = _agreed("process count per node", candidates)
        return number or word

    def count_processes(self, given: _Value | None) -> _Value:
        """torchrun's reading of auto/cpu/gpu: GPUs if any else CPUs / CPUs / GPUs (torch/distributed/run.py
        determine_local_world_size); unset: one process per visible GPU, 2 without."""
        if given is None:
            return _Value(self.gpus() or 2, "visible GPUs" if self.gpus() else "default", "default")
        if given.value == "gpu" and not self.gpus():
            raise UsageError(given.label, "'gpu' asks for one process per GPU and none is visible",
                             "give the pod GPUs, or a number of processes")
        if given.value in ("auto", "gpu") and self.gpus():
            return _Value(self.gpus(), given.var, given.source)
        if given.value in ("auto", "cpu"):
            return _Value(os.cpu_count() or 1, given.var, given.source)
        return given

    def skypilot_ips(self) -> list[str]:
        return [line.strip() for line in self.env.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip()]

    def master_addr(self, nnodes: _Value | None) -> _Value:
        if _given(self.env, "MASTER_ADDR"):
            return _Value(self.env["MASTER_ADDR"].strip(), "MASTER_ADDR",
                          "pytorchjob" if self.pytorchjob else self.explicit("MASTER_ADDR"))
        if _given(self.env, "PET_MASTER_ADDR"):
            return _Value(self.env["PET_MASTER_ADDR"].strip(), "PET_MASTER_ADDR", self.pet)
        if self.slurm:
            var = self.first_of("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if _given(self.env, var):
                try:
                    return _Value(first_host(self.env[var]), var, "slurm")
                except ValueError as err:
                    raise UsageError(f"{var} (slurm)", f"cannot read the hostlist '{self.env[var].strip()}': {err}",
                                     "set MASTER_ADDR to the first node's address") from None
        ips = self.skypilot_ips()
        if ips:
            return _Value(ips[0], "SKYPILOT_NODE_IPS", "skypilot")
        if nnodes is not None and nnodes.value > 1:
            raise UsageError("MASTER_ADDR (explicit)", f"is required when {nnodes.var}={nnodes.value}"
                             + ("" if nnodes.source == "explicit" else f" ({nnodes.source})"),
                             "set it to the address of the node-rank-0 host, the same on every host")
        return _Value(LOCALHOST, "default", "default")

    def master_port(self) -> _Value:
        for var, source in (("MASTER_PORT", "pytorchjob" if self.pytorchjob else self.explicit("MASTER_PORT")),
                            ("PET_MASTER_PORT", self.pet)):
            if _given(self.env, var):
                return _Value(env_int(self.env, var, None, 1, 65535, source), var, source)
        if self.slurm and _given(self.env, "SLURM_JOB_ID"):
            job = env_int(self.env, "SLURM_JOB_ID", None, 0, source="slurm")
            return _Value(slurm_port(job), "SLURM_JOB_ID", "slurm")
        return _Value(DEFAULT_MASTER_PORT, "default", "default")

    # -- the whole -------------------------------------------------------------------------------

    def resolve(self) -> Topology:
        if started_by_torchrun(self.env):
            return self.from_torchrun()
        span = self.node_range()
        if span is not None:
            return self.elastic_topology(span)
        self.refuse_elastic_variables()
        nnodes = self.nnodes()
        node_rank, nproc = self.node_rank(nnodes), self.nproc()
        if self.slurm:
            self.check_slurm()
        if self.pytorchjob:
            nnodes = nnodes or self.pytorchjob_nnodes(nproc)
            self.check_pytorchjob_world(nnodes, nproc)
        n, r = (nnodes.value if nnodes else 1), (node_rank.value if node_rank else 0)
        if node_rank and r >= n:
            count = f"{nnodes.var}={n} ({nnodes.source})" if nnodes else "1 node (NNODES unset)"
            fix = (f"set {nnodes.var if nnodes else 'NNODES'} to the number of nodes; node ranks run from 0 to "
                   "that number - 1")
            if node_rank.var == "JOB_COMPLETION_INDEX" and not nnodes:
                fix = "set NNODES to the Job's completions for one run across its pods, or NNODES=1 for a run per pod"
            raise UsageError(node_rank.label, f"node rank {r} is not below {count}", fix)
        kind = self.process_kind(nnodes is not None or node_rank is not None, nproc)
        if kind is None and self.role == WORKER and n > 1:
            raise UsageError(nnodes.label, f"{n} nodes, but `python -m trainer` is a single process",
                             "start `trainer-launch` on every node, which runs torchrun, or torchrun yourself")
        addr, port = self.master_addr(nnodes), self.master_port()
        if kind == "slurm":
            return self.slurm_task(nnodes, addr, port)
        if kind is not None:
            return self.rank_env(kind, addr, port, nnodes if kind == "pytorchjob" else None)
        return self.launch_topology(nnodes, node_rank, nproc, addr, port)

    def process_kind(self, node_level: bool, nproc: _Value | None) -> str | None:
        """How this process is one rank by itself ("slurm", "pytorchjob", "explicit"); None when it is a
        node's launcher (role LAUNCHER), or a lone process (role WORKER)."""
        env, has_rank = self.env, "RANK" in self.env or "WORLD_SIZE" in self.env
        if self.role == LAUNCHER:
            return "explicit" if has_rank and not node_level and not self.pytorchjob else None
        if self.slurm and self.slurm_step and _given(env, "SLURM_PROCID"):
            return "slurm"
        if self.slurm and not self.slurm_step:
            tasks = self.int("SLURM_NTASKS", "slurm", 1)
            if tasks and tasks.value > 1:
                raise UsageError(tasks.label, f"{tasks.value} tasks, but this process runs in the batch script, "
                                 "outside them", "start it with `srun python -m trainer` (one task per GPU), or "
                                 "`srun --ntasks-per-node=1 trainer-launch` (one per node)")
        if self.pytorchjob:
            if nproc is not None and isinstance(nproc.value, int) and nproc.value > 1:
                raise UsageError(nproc.label, f"{nproc.value} processes per pod, but `python -m trainer` is one",
                                 "run `trainer-launch` in the pod, which starts them with torchrun")
            return "pytorchjob"
        return "explicit" if has_rank else None

    def launch_topology(self, nnodes, node_rank, nproc, addr, port) -> Topology:
        n, r = (nnodes.value if nnodes else 1), (node_rank.value if node_rank else 0)
        if self.role == WORKER:  # one plain process
            return Topology(DIRECT, 1, 0, 1, addr.value, port.value, 0, 0, 1, 1, "default",
                            self.sources(nnodes, node_rank, None, addr, port))
        procs = self.count_processes(nproc)
        if self.gpus() and procs.value > self.gpus():
            raise UsageError(procs.label if procs.source != "default" else "NPROC_PER_NODE",
                             f"{procs.value} processes but only {self.gpus()} GPUs are visible",
                             f"set NPROC_PER_NODE to at most {self.gpus()} (one process per GPU)")
        p = procs.value
        return Topology(TORCHRUN, n, r, p, addr.value, port.value, r * p, 0, n * p, p, "default",
                        self.sources(nnodes, node_rank, procs, addr, port))

    def rank_env(self, source: str, addr, port, nnodes) -> Topology:
        """RANK and WORLD_SIZE: one process per container (or per PyTorchJob pod of one process)."""
        env = self.env
        if ("RANK" in env) != ("WORLD_SIZE" in env):
            given, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
            raise UsageError(f"{missing} ({source})", f"is not set but {given} is",
                             "set both (as torchrun does) or neither")
        world = env_int(env, "WORLD_SIZE", None, 1, source=source)
        rank = env_int(env, "RANK", None, 0, source=source)
        if rank >= world:
            raise UsageError(f"RANK ({source})", f"{rank} is not below WORLD_SIZE {world}",
                             "give each process a rank in [0, WORLD_SIZE)")
        local = env_int(env, "LOCAL_RANK", 0, 0, source=source)
        local_world = env_int(env, "LOCAL_WORLD_SIZE", 1, 1, source=source)
        sources = {"nnodes": nnodes.label if nnodes else "default", "node_rank": f"RANK ({source})",
                   "nproc_per_node": "default", "master_addr": self.src(addr), "master_port": self.src(port),
                   "rank": f"RANK ({source})", "world_size": f"WORLD_SIZE ({source})"}
        if local >= local_world:
            raise UsageError(f"LOCAL_RANK ({source})", f"{local} is not below LOCAL_WORLD_SIZE {local_world}",
                             "give LOCAL_RANK from 0 to LOCAL_WORLD_SIZE - 1, or leave both unset")
        n = nnodes.value if nnodes else max(1, world // local_world)
        return Topology(DIRECT, n, rank // local_world, local_world, addr.value, port.value, rank, local,
                        world, local_world, source, sources)

    def slurm_task(self, nnodes, addr, port) -> Topology:
        """`srun python -m trainer`: this task is one rank."""
        tasks_var = self.first_of("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        world = env_int(self.env, tasks_var, None, 1, source="slurm")
        rank = env_int(self.env, "SLURM_PROCID", None, 0, source="slurm")
        local = env_int(self.env, "SLURM_LOCALID", 0, 0, source="slurm")
        node = env_int(self.env, "SLURM_NODEID", 0, 0, source="slurm")
        if rank >= world:
            raise UsageError("SLURM_PROCID (slurm)", f"{rank} is not below {tasks_var} {world}",
                             "SLURM_PROCID comes from srun: find what overwrote it (job script, image ENV)")
        for var, value in (("RANK", rank), ("WORLD_SIZE", world)):  # a job script that also exports them
            given = self.int(var, "explicit")
            if given is not None and given.value != value:
                other = "SLURM_PROCID" if var == "RANK" else tasks_var
                raise UsageError(given.label, f"{given.value} contradicts {other}={value} (slurm)",
                                 f"unset {var} (srun sets the ranks), or give it the same value")
        n = nnodes.value if nnodes else 1
        per_node = tasks_on_node(self.env.get("SLURM_STEP_TASKS_PER_NODE", self.env.get("SLURM_TASKS_PER_NODE", "")),
                                 node)
        if per_node is None:
            explicit = self.int("SLURM_NTASKS_PER_NODE", "slurm", 1)
            per_node = explicit.value if explicit else (world if n == 1 else 1)
        if local >= per_node:
            raise UsageError("SLURM_LOCALID (slurm)", f"{local} is not below the {per_node} tasks on this node",
                             "SLURM_LOCALID comes from srun: find what overwrote it (job script, image ENV)")
        sources = {"nnodes": nnodes.label if nnodes else "default", "node_rank": "SLURM_NODEID (slurm)",
                   "nproc_per_node": "SLURM_STEP_TASKS_PER_NODE (slurm)", "master_addr": self.src(addr),
                   "master_port": self.src(port), "rank": "SLURM_PROCID (slurm)", "world_size": f"{tasks_var} (slurm)"}
        return Topology(DIRECT, n, node, per_node, addr.value, port.value, rank, local, world, per_node, "slurm",
                        sources)

    def from_torchrun(self) -> Topology:
        """A worker torchrun started: its rank facts are torchrun's (LOCAL_RANK, GROUP_RANK, ...)."""
        env, src = self.env, "torchrun"
        world = env_int(env, "WORLD_SIZE", None, 1, source=src)
        rank = env_int(env, "RANK", None, 0, source=src)
        local = env_int(env, "LOCAL_RANK", 0, 0, source=src)
        local_world = env_int(env, "LOCAL_WORLD_SIZE", 1, 1, source=src)
        group = env_int(env, "GROUP_RANK", 0, 0, source=src)
        port = env_int(env, "MASTER_PORT", DEFAULT_MASTER_PORT, 1, 65535, source=src)
        addr = env.get("MASTER_ADDR", "").strip() or LOCALHOST
        nnodes = max(1, world // local_world)
        sources = {"nnodes": "WORLD_SIZE (torchrun)", "node_rank": "GROUP_RANK (torchrun)",
                   "nproc_per_node": "LOCAL_WORLD_SIZE (torchrun)", "master_addr": "MASTER_ADDR (torchrun)",
                   "master_port": "MASTER_PORT (torchrun)", "rank": "RANK (torchrun)",
                   "world_size": "WORLD_SIZE (torchrun)"}
        return Topology(DIRECT, nnodes, group, local_world, addr, port, rank, local, world, local_world, "torchrun",
                        sources)

    # -- checks of one source against itself ------------------------------------------------------

    def check_slurm(self) -> None:
        if self.role != LAUNCHER:
            return
        nodes = self.int(self.first_of("SLURM_STEP_NUM_NODES", "SLURM_NNODES"), "slurm", 1)
        if not self.slurm_step:
            if nodes and nodes.value > 1:
                raise UsageError(nodes.label, f"{nodes.value} nodes, but trainer-launch runs in the batch script, "
                                 "on the first node only", "start it on every node with `srun --ntasks-per-node=1 "
                                 "trainer-launch`, or use `srun python -m trainer` for one task per GPU")
            return
        tasks = self.int(self.first_of("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), "slurm", 1)
        if tasks and nodes and tasks.value > nodes.value:
            raise UsageError(tasks.label, f"{tasks.value} tasks on {nodes.value} node(s), but trainer-launch is "
                             "one task per node (it starts the node's processes itself)",
                             "use `srun --ntasks-per-node=1 trainer-launch`, or `srun python -m trainer` "
                             "for one task per GPU")

    def pytorchjob_nnodes(self, nproc: _Value | None) -> _Value:
        """Older PyTorchJob controllers set no PET_NNODES: WORLD_SIZE / nprocPerNode nodes."""
        world = env_int(self.env, "WORLD_SIZE", None, 1, source="pytorchjob")
        per = nproc.value if nproc is not None and isinstance(nproc.value, int) else 1
        if world % per:
            raise UsageError("WORLD_SIZE (pytorchjob)", f"{world} is not a multiple of {nproc.var}={per}",
                             "WORLD_SIZE is replicas x nprocPerNode: find what overwrote it")
        return _Value(world // per, "WORLD_SIZE", "pytorchjob")

    def check_pytorchjob_world(self, nnodes: _Value, nproc: _Value | None) -> None:
        """The controller sets WORLD_SIZE = replicas x nprocPerNode, nprocPerNode counting 1 when it is a
        word (auto/cpu/gpu): kubeflow/training-operator pkg/controller.v1/pytorch/envvar.go, setPodEnv and
        getNprocPerNodeInt ("in this case, world size env will not be used")."""
        world = env_int(self.env, "WORLD_SIZE", None, 1, source="pytorchjob")
        per = nproc.value if nproc is not None and isinstance(nproc.value, int) else 1
        if world != nnodes.value * per:
            shown = f"{nproc.var}={per}" if nproc is not None else "1 process per pod"
            raise UsageError("WORLD_SIZE (pytorchjob)", f"{world} is not {nnodes.var}={nnodes.value} x {shown} "
                             f"= {nnodes.value * per} ({nnodes.source})",
                             "WORLD_SIZE is replicas x nprocPerNode: find what overwrote WORLD_SIZE, "
                             "PET_NNODES or PET_NPROC_PER_NODE")

    @staticmethod
    def src(value: _Value) -> str:
        return "default" if value.source == "default" and value.var == "default" else value.label

    def sources(self, nnodes, node_rank, procs, addr, port) -> dict[str, str]:
        def named(value: _Value | None) -> str:
            return value.label if value is not None else "default"
        return {"nnodes": named(nnodes), "node_rank": named(node_rank),
                "nproc_per_node": named(procs) if procs is None or procs.source != "default" else procs.var,
                "master_addr": self.src(addr), "master_port": self.src(port)}


def resolve(env: Mapping[str, str], role: str = LAUNCHER, gpu_count: Callable[[], int] | None = None) -> Topology:
    """The topology of this node (role LAUNCHER: trainer-launch, trainer-doctor) or of this process (role
    WORKER). gpu_count is called only when the process count needs it (importing torch takes seconds)."""
    return _Resolver(env, role, gpu_count).resolve()
