"""What trainer-launch runs (the console script: trainer/cli/launch.py): the program, its topology and settings,
validated, the rendezvous, and the torchrun command that does the same by hand (torch-free)."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import secrets
import shlex
import socket
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

from trainer.cluster import lighthouse
from trainer.cluster import topology as topo
from trainer.cluster.gpus import visible_gpu_count
from trainer.cluster.topology import Topology
from trainer.config import launcher
from trainer.config.catalog import importable_as_python_m
from trainer.config.resume import check_resume
from trainer.config.launcher import LauncherSettings
from trainer.config.settings import ELASTIC_WORLD_ENV, LAUNCHER_VARIABLES, TrainConfig, check_gpu_options, \
    load_config, script_settings
from trainer.core.errors import UsageError, first_line


ELASTIC_RDZV_ID = "trainer"
ELASTIC_LAST_CALL_S = 5
ELASTIC_KEEP_ALIVE_S, ELASTIC_KEEP_ALIVE_MISSED = 2, 3  # a host silent for 6 s has left the round
SCRIPT_ENV = "TRAIN_SCRIPT"
assert SCRIPT_ENV in LAUNCHER_VARIABLES  # config.py's list of launcher knobs accepts it
BUILTIN = ("-m", "trainer")
# A script takes an abandoned step again only through trainer.api's loop pieces: run.steps() yields the step's
# micro-batches, run.optimizer_step() sums the gradients over the hosts and commits (or abandons) the step.
LOOP_PIECES = (re.compile(r"\.steps\s*\("), re.compile(r"\.optimizer_step\s*\("))


@dataclass(frozen=True)
class Rendezvous:
    """How the hosts meet: torchrun's static rendezvous at node 0's store, or (NNODES=MIN:MAX) its c10d one."""
    backend: str
    endpoint: str
    run_id: str
    config: dict
    local_addr: str | None = None


@dataclass(frozen=True)
class Recovery:
    """How an elastic job recovers (RECOVERY): in place, through torchft's lighthouse at the job's MASTER_ADDR:
    MASTER_PORT (each host's agent then runs a one-host group of its own), or by restarting every host's workers;
    why: the reason a job that could have asked for in-place takes the restart path. job: the job's topology
    (NNODES=MIN:MAX); local: in place, this host's group of its own; replica: this host's name in the quorum."""
    in_place: bool
    job: Topology
    why: str = ""
    local: Topology | None = None
    replica: str = ""
    lighthouses: tuple[str, ...] = ()  # LIGHTHOUSE_HOSTS (empty: MASTER_ADDR's alone)

    def line(self) -> str:
        """The one line naming the path the job is on."""
        job = self.job
        if self.in_place:
            said = f"torchft's lighthouse at {lighthouse.url(job.master_addr, job.master_port)} says" \
                if len(self.lighthouses) < 2 else \
                (f"torchft's lighthouses at {' or '.join(lighthouse.url(h, job.master_port) for h in self.lighthouses)} "
                 "(LIGHTHOUSE_HOSTS: one in use, the others standing by) say")
            return (f"recovery: in place: a lost or returning host costs the others seconds (the processes stay; "
                    f"{said} who trains each step; up to {job.world_size} processes, {job.min_nodes} host(s) at "
                    "least)")
        return (f"recovery: restart: a lost or returning host restarts every host's workers from the newest "
                f"checkpoint ({self.why})")


@dataclass(frozen=True)
class Launch:
    """What trainer-launch runs, for which topology, with which training options (None: a user's script).
    command: the equivalent command (torchrun's, or the one process's); per_host: why the script runs once on this
    host instead of once per rank (it starts its own processes); recovery: an elastic job's (None otherwise). In
    place, topology and rendezvous are this host's group of its own (what the agent runs; the job's topology is
    recovery.job)."""
    command: list[str]
    topology: Topology
    cfg: TrainConfig | None
    per_host: str | None = None
    settings: LauncherSettings | None = None
    program: Program | None = None
    rendezvous: Rendezvous | None = None
    recovery: Recovery | None = None

    @property
    def in_place(self) -> bool:
        return self.recovery is not None and self.recovery.in_place

    @property
    def job(self) -> Topology:
        """The job's topology (in place, the hosts together; topology is then this host's own)."""
        return self.recovery.job if self.recovery is not None else self.topology


# The tutorials' own launchers: torch.multiprocessing's spawn (mp.spawn(train, nprocs=gpus)), and a tcp://
# init_method with the script's own rank and world size. Either makes a copy per rank under torchrun wrong:
# each copy spawns a whole host's worth, or claims the same rank.
SPAWNS = re.compile(r"\b(?:mp|multiprocessing|torch\.multiprocessing)\.(?:spawn|start_processes)\s*\(|"
                    r"^\s*from\s+torch\.multiprocessing\s+import\s+[^#\n]*\b(?:spawn|start_processes)\b", re.M)
TCP_INIT = re.compile(r"""["']tcp://""")


def launches_itself(program: Program, choice: str) -> str | None:
    """Why a script is to run once per host (it starts or ranks its processes itself); None: once per rank.
    SCRIPT_LAUNCH=torchrun or per-host overrides what the script's source suggests."""
    if program.builtin or choice == "torchrun":
        return None
    if choice == "per-host":
        return "SCRIPT_LAUNCH=per-host"
    path = program.target[0] if program.target[0] != "-m" else _module_file(program.target[1])
    try:
        source = "\n".join(line for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
                           if not line.lstrip().startswith("#"))
    except (OSError, TypeError):
        return None
    if SPAWNS.search(source):
        return "it calls torch.multiprocessing's spawn"
    if "init_process_group" in source and TCP_INIT.search(source):
        return "it joins its process group at a tcp:// address with its own rank"
    return None


def _module_file(name: str) -> str | None:
    with importable_as_python_m():
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")
    return spec.origin if spec is not None else None


def per_host_env(topology: Topology) -> dict[str, str]:
    """What a script that starts its own processes gets to know the job by (and no torchrun variables)."""
    return {"NNODES": str(topology.nnodes), "NODE_RANK": str(topology.node_rank),
            "NPROC_PER_NODE": str(topology.nproc_per_node), "LOCAL_WORLD_SIZE": str(topology.nproc_per_node),
            "WORLD_SIZE": str(topology.world_size), "MASTER_ADDR": topology.master_addr,
            "MASTER_PORT": str(topology.master_port)}


@dataclass(frozen=True)
class Program:
    """What every worker runs: `target` (a script path, or -m and a module) with `args`."""
    target: tuple[str, ...]
    args: tuple[str, ...]

    @property
    def builtin(self) -> bool:
        return self.target == BUILTIN


def choose_program(argv: Sequence[str], env: Mapping[str, str]) -> Program:
    """The built-in trainer unless the command line (or else TRAIN_SCRIPT) names a script or module,
    checked before any process starts: torchrun would otherwise start every rank to fail alike."""
    if argv[:1] == ["-m"]:
        if len(argv) < 2 or argv[1].startswith("-"):
            raise UsageError("-m", "names no module", "give the module to run: trainer-launch -m mypkg.train ARGS")
        return Program(checked_module(argv[1], "-m"), tuple(argv[2:]))
    if argv and not argv[0].startswith("-"):
        return Program(checked_script(argv[0], "script"), tuple(argv[1:]))
    raw, setting = env.get(SCRIPT_ENV, "").strip(), launcher.located(env, SCRIPT_ENV)
    if not raw:
        return Program(BUILTIN, tuple(argv))
    if raw.split()[0] == "-m":
        module = raw.split()[1:]
        if len(module) != 1:
            raise UsageError(setting, f"'{raw}' is not -m and one module name",
                             'e.g. TRAIN_SCRIPT="-m mypkg.train"; arguments go on the command line')
        return Program(checked_module(module[0], setting), tuple(argv))
    return Program(checked_script(raw, setting), tuple(argv))


def checked_script(path: str, setting: str) -> tuple[str, ...]:
    where = f"'{path}'" if os.path.isabs(path) else f"'{path}' (in {os.getcwd()})"
    if not os.path.exists(path):
        raise UsageError(setting, f"{where} does not exist",
                         "give the path of your training script, or -m and a module")
    if not os.path.isfile(path):
        raise UsageError(setting, f"{where} is not a file", "give the .py file to run, or -m and a module")
    if not os.access(path, os.R_OK):
        raise UsageError(setting, f"{where} cannot be read", f"make it readable by uid {os.getuid()}")
    return (path,)


def checked_module(name: str, setting: str) -> tuple[str, ...]:
    """Found as `python -m` will look for it (the working directory first, then PYTHONPATH), not run.
    Its parent packages are imported, as they would be in every worker."""
    if name == BUILTIN[1]:
        return BUILTIN
    fix = "check the name, and that its folder is the working directory or on PYTHONPATH"
    if name.endswith(".py") or os.sep in name:
        fix = f"for a file, drop -m: trainer-launch {name}"
    sys.dont_write_bytecode = True  # nothing written before the run starts, not even __pycache__
    try:
        with importable_as_python_m():
            spec = importlib.util.find_spec(name)
            if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
                spec = importlib.util.find_spec(f"{name}.__main__")
    except ModuleNotFoundError:
        spec = None
    except Exception as err:  # noqa: BLE001 (a parent package that fails to import, an invalid name)
        raise UsageError(setting, f"cannot look for module '{name}' ({type(err).__name__}: {first_line(err)})",
                         fix) from None
    if spec is None:
        raise UsageError(setting, f"no module named '{name}'", fix)
    return ("-m", name)


def store_role(host: str, port: int) -> str | None:
    """Whether this host runs the elastic rendezvous store at MASTER_ADDR:MASTER_PORT: "1", "0", or None to leave
    it to torchrun's guess. torchrun guesses from this machine's hostname, which Debian and Ubuntu map to 127.0.1.1
    (/etc/hosts), so a MASTER_ADDR given as the host's IP was not recognised and no host ran the store ("The
    connection to the C10d store has failed"); and where the hostname does not resolve at all (a container that
    shares another's network) the guess raised. The facts instead: an address of this machine binds, and its
    port is free unless another launcher of the job on this machine already runs the store."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return None  # unresolvable here: the launcher's MASTER_ADDR check says so
    loopback = all(a.startswith("127.") or a == "::1" for a in addresses)
    if loopback:
        try:  # several launchers on one machine: torchrun's guess lets each try, and the others connect
            socket.getaddrinfo(socket.gethostname(), None, proto=socket.IPPROTO_TCP)
            return None
        except OSError:
            pass  # its guess would raise: decide here (launchers started within the same second may both try)
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed store's TIME_WAIT is free
            try:
                probe.bind((address, port))  # only an address of one of this machine's interfaces binds
                return "1"
            except OSError:
                continue
    return "0"


def address_toward(host: str, port: int) -> str | None:
    """This machine's address on the route to MASTER_ADDR (no packet is sent). An elastic round's first host
    tells the others where its workers' process group meets; torchrun's default is this machine's FQDN, which
    other hosts may not resolve, or which resolves to loopback in a container or a network namespace
    ("localhost"), where every other host's workers then wait for a store that is not there."""
    try:
        family, _, _, _, where = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(where)
            address = probe.getsockname()[0]
    except (OSError, IndexError):
        return None
    if address.startswith("127."):
        # Hosts on one machine (containers, a test): torchrun names each host by this address and its PID, and
        # two containers' launchers both run as PID 7, so under one address they were taken for one host and
        # each trained alone. Any 127/8 address is this machine's loopback: each launcher takes its own.
        return f"127.{secrets.randbelow(254) + 1}.{secrets.randbelow(254) + 1}.{secrets.randbelow(254) + 1}"
    return address


def rendezvous(topology: Topology, settings: LauncherSettings) -> Rendezvous:
    """Static: the node rank decides the ranks, so rank 0 is on node 0. Elastic (NNODES=MIN:MAX): torchrun's c10d
    rendezvous at MASTER_ADDR:MASTER_PORT, which assigns node ranks at every round."""
    endpoint = f"{topology.master_addr}:{topology.master_port}"
    if not topology.elastic:
        return Rendezvous("static", endpoint, "none", {"rank": topology.node_rank, "timeout": settings.rdzv_timeout})
    # last_call: how long a round waits for more hosts once MIN are in; short, so a lost host costs seconds. A host
    # that comes later joins the next round (the running hosts stop for it). keep_alive: a lost host's place in the
    # finished round is freed only once its heartbeats are this many intervals late; until then the hosts left
    # wait (torch's 5 s x 3 was most of a regroup).
    config = {"join_timeout": settings.rdzv_timeout, "last_call_timeout": ELASTIC_LAST_CALL_S,
              "keep_alive_interval": ELASTIC_KEEP_ALIVE_S, "keep_alive_max_attempt": ELASTIC_KEEP_ALIVE_MISSED}
    if (role := store_role(topology.master_addr, topology.master_port)) is not None:
        config["is_host"] = role
    return Rendezvous("c10d", endpoint, ELASTIC_RDZV_ID, config,
                      address_toward(topology.master_addr, topology.master_port))


def torchrun_command(topology: Topology, args: Sequence[str], target: Sequence[str] = BUILTIN,
                     settings: LauncherSettings | None = None, rdzv: Rendezvous | None = None) -> list[str]:
    """The torchrun command that runs what the launcher's agent runs (printed, for running it by hand)."""
    settings = settings or launcher.read({}, topology.elastic)
    rdzv = rdzv or rendezvous(topology, settings)
    common = [f"--max-restarts={settings.max_restarts}", f"--shutdown-timeout={settings.workers_grace}"]
    conf = "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv.config.items() if k != "rank")
    if not topology.elastic:
        return ["torchrun", f"--nnodes={topology.nnodes}", f"--node-rank={topology.node_rank}",
                f"--nproc-per-node={topology.nproc_per_node}", f"--master-addr={topology.master_addr}",
                f"--master-port={topology.master_port}", *common, conf, *target, *args]
    return ["torchrun", f"--nnodes={topology.node_range}", f"--nproc-per-node={topology.nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv.endpoint}", f"--rdzv-id={rdzv.run_id}", *common, conf,
            *([f"--local-addr={rdzv.local_addr}"] if rdzv.local_addr else []), *target, *args]


def single_worker_command(args: Sequence[str], target: Sequence[str] = BUILTIN) -> list[str]:
    return [sys.executable, *target, *args]


def build_command(env: Mapping[str, str], argv: Sequence[str], gpu_count: Callable[[], int] = visible_gpu_count,
                  pick_port: bool = False) -> Launch:
    """What to run, its topology, settings and the training options it runs with, validated on the way.
    pick_port: on one host with MASTER_PORT unset, take a free port (--dry-run too: it shows what a launch does,
    a free port, which the next launch takes anew)."""
    program = choose_program(argv, env)
    # All but the world-size checks, before counting GPUs (which may import torch).
    options = load_config(list(program.args), env, world_size=None) if program.builtin else None
    topology = topo.resolve(env, topo.LAUNCHER, gpu_count)
    settings = launcher.read(env, topology.elastic)
    if pick_port:
        topology = with_launch_port(topology)
    launch = Launch(single_worker_command(program.args, program.target), topology, None, None, settings, program)
    if topology.mode == topo.TORCHRUN:  # else this process is one rank already: no agent
        rdzv = rendezvous(topology, settings)
        launch = replace(launch, command=torchrun_command(topology, program.args, program.target, settings, rdzv),
                         rendezvous=rdzv)
    per_host = launches_itself(program, settings.script_launch) if options is None and \
        topology.mode == topo.TORCHRUN else None
    if topology.elastic and topology.mode == topo.TORCHRUN:
        recovery = choose_recovery(settings, topology, program, options, per_host, env, gpu_count() > 0)
        launch = replace(launch, recovery=recovery)
        if recovery.in_place:  # this host's group of its own; the lighthouse joins the hosts' groups
            rdzv = rendezvous(recovery.local, settings)
            launch = replace(launch, topology=recovery.local, rendezvous=rdzv,
                             command=torchrun_command(recovery.local, program.args, program.target, settings, rdzv))
    if options is None:
        # A script on trainer.api reads the same TRAIN_* settings (its keyword arguments win over them): a bad
        # value fails here in one line, not once per rank after the workers have started.
        script_settings({}, env, world_size=topology.world_size)
        if per_host is not None:
            return replace(launch, command=single_worker_command(program.args, program.target), per_host=per_host)
        return launch
    if topology.mode == topo.TORCHRUN:
        # The worker's own check, before the workers start ranks that would each fail with it.
        check_gpu_options(options.backend, options.sync_bn, gpu_count() > 0, topology.world_size)
    if launch.in_place:
        # Every membership trains the micro-batches of the largest world: its settings are the job's.
        check_resume(options)
        return replace(launch, cfg=load_config(list(program.args), env, world_size=topology.world_size))
    if topology.elastic:  # every world size the job may shrink to must take the settings (the global batch)
        env = {**env, ELASTIC_WORLD_ENV: str(topology.world_size)}
        sizes = [nodes * topology.nproc_per_node for nodes in range(topology.min_nodes, topology.nnodes + 1)]
        for size in sizes:
            try:
                load_config(list(program.args), env, world_size=size)
            except UsageError as err:
                raise elastic_batch_error(err, options, topology, sizes, size) from None
    check_resume(options)  # what it would resume: an empty file, another model's checkpoint (read without torch)
    return replace(launch, cfg=load_config(list(program.args), env, world_size=topology.world_size))


def elastic_batch_error(err: UsageError, options: TrainConfig, topology: Topology, sizes: list[int],
                        size: int) -> UsageError:
    setting, problem, fix = err.parts
    every = math.lcm(*sizes) * options.grad_accum
    if setting.startswith("the elastic job's global batch"):  # derived from --batch-size
        total = options.batch_size * topology.world_size * options.grad_accum
        near = sorted({max(every, total // every * every), -(-total // every) * every})
        return UsageError(setting.split("(")[1].split(" at ")[0], f"{options.batch_size} per process makes a global "
                          f"batch of {total} at world size {topology.world_size}, which world size {size} of NNODES="
                          f"{topology.node_range} does not divide (an elastic job keeps its global batch at every "
                          f"size)", f"set --global-batch-size to a multiple of {every}, e.g. "
                          f"{' or '.join(map(str, near))}")
    if "global_batch" in setting.lower().replace("-", "_"):
        fix = f"use a multiple of {every}, which every world size of NNODES={topology.node_range} x grad-accum divides"
    return UsageError(setting, f"{problem}, a world size this elastic job may shrink to (NNODES={topology.node_range})",
                      fix)


def choose_recovery(settings: LauncherSettings, topology: Topology, program: Program, options: TrainConfig | None,
                    per_host: str | None, env: Mapping[str, str], gpus: bool = False) -> Recovery:
    """An elastic job's recovery path (RECOVERY), with the reason when in-place cannot be had. gpus: the job trains
    on this host's GPUs, where in-place is asked for explicitly until a GPU run has measured it."""
    if settings.recovery == "restart":
        return Recovery(False, topology, "RECOVERY=restart")
    if env.get("PET_RDZV_BACKEND", "").strip() and not env.get("RECOVERY", "").strip():
        # Kubeflow's elasticPolicy: the operator asked for torchrun's c10d rendezvous (and counts its restarts).
        why = ("the platform asked for torchrun's c10d rendezvous (PET_RDZV_BACKEND, Kubeflow's elasticPolicy); "
               "RECOVERY=in-place on every pod recovers in place instead")
    elif gpus and not env.get("RECOVERY", "").strip():
        # A GPU path no GPU has run is not a default: torchft's quorum and heal over NCCL are unmeasured here.
        why = ("in-place recovery has not run on a GPU yet (docs/elastic.md); RECOVERY=in-place asks for it, "
               "RECOVERY=restart silences this")
    elif per_host is not None:
        why = f"the script starts its own processes ({per_host})"
    elif (options.pipeline_stages if options is not None else
          script_settings({}, env, topology.world_size).pipeline_stages) > 1:
        why = ("pipeline stages cut the model across processes; in-place recovery replicates whole models across the "
               "hosts")
    elif options is not None and options.strategy == "fsdp":
        why = "--strategy fsdp shards the model; in-place recovery replicates whole models across the hosts"
    elif options is not None and options.local_sgd_period:
        why = "--local-sgd-period averages the models now and then; in-place recovery sums gradients every step"
    elif not program.builtin:
        why = script_off_the_loop(program)
    else:
        why = None
    why = why or lighthouse.unavailable()
    if why is not None:
        return Recovery(False, topology, f"in-place cannot: {why}")
    version = lighthouse.unknown_torchft()
    if version is not None:  # its API may have moved: refused, rather than a crash or a silent wrong step mid-run
        tested = ", ".join(f"{release}.x" for release in lighthouse.TORCHFT_TESTED)
        raise UsageError("RECOVERY", f"in-place recovery runs on torchft {tested}, and this host has torchft {version}",
                         f"pip install '{lighthouse.TORCHFT_REQUIREMENT}', or RECOVERY=restart for the restart path")
    local_addr = address_toward(topology.master_addr, topology.master_port) or socket.gethostname()
    return Recovery(True, topology, local=local_group(topology, local_addr), lighthouses=settings.lighthouse_hosts,
                    replica=f"{local_addr}-{socket.gethostname()}")


def recovery_unused(env: Mapping[str, str], job: Topology) -> str | None:
    """The line for RECOVERY=in-place asked of a job of a fixed size, where it has no effect (not an error: the job
    runs as asked otherwise); None when there is nothing to say."""
    if job.elastic or env.get("RECOVERY", "").strip().lower() != "in-place":
        return None
    nnodes = job.variables("nnodes")[0]
    given = f"{nnodes}={job.nnodes}" if job.sources.get("nnodes", "default") != "default" else \
        f"{nnodes} unset: one host"
    return (f"warning: {launcher.located(env, 'RECOVERY')}: in-place has no effect with a fixed number of hosts "
            f"({given}): a job of a fixed size restarts its workers after a failure (MAX_RESTARTS); in place needs "
            f"NNODES=MIN:MAX (e.g. 1:{max(2, job.nnodes)}), where the hosts left go on without a lost one")


def local_group(job: Topology, local_addr: str) -> Topology:
    """In place: the one-host group this host's agent runs (a static rendezvous on a free port of this host's
    address toward MASTER_ADDR, where the other hosts reach it for a state transfer); the hosts' groups meet
    through the lighthouse, not through the agent."""
    return replace(job, nnodes=1, min_nodes=0, node_rank=0, master_addr=local_addr, master_port=free_port(),
                   world_size=job.nproc_per_node,
                   sources={**job.sources, "master_port": "a free port (in place: this host's own group)"})


def script_off_the_loop(program: Program) -> str | None:
    """Why a script cannot take an abandoned step again (None: its source, or a module of its own that it imports,
    trains through run.steps() and run.optimizer_step(), the loop pieces that can)."""
    module = program.target[0] == "-m"
    path = _module_file(program.target[1]) if module else program.target[0]
    texts = _own_sources(Path(path), Path.cwd() if module else Path(path).parent) if path else ()
    source = "\n".join(line for text in texts for line in text.splitlines() if not line.lstrip().startswith("#"))
    if all(piece.search(source) for piece in LOOP_PIECES):
        return None
    name = shlex.join(program.target)
    return (f"{name} does not train through trainer.api's run.steps() and run.optimizer_step(), which take an "
            "abandoned step again (docs/your-code.md)")


OWN_SOURCES_READ = 64  # a project's own modules the scan reads at most: a thin wrapper's loop is one or two away


def _own_sources(script: Path, root: Path):
    """The script's source, then those of the modules it imports from `root` (sys.path's first entry: the script's
    folder, or the working directory for `-m`) or relative to itself (a wrapper's `from my_train import main`, a
    package beside it), breadth first: the loop may live in any of them. Installed packages are not read: their
    loops are not the script's."""
    import ast

    queue, seen = [script], set()
    while queue and len(seen) < OWN_SOURCES_READ:
        file = queue.pop(0)
        if file in seen:
            continue
        seen.add(file)
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        yield text
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name.split(".") for alias in node.names]
                base = root
            elif isinstance(node, ast.ImportFrom):
                module = node.module.split(".") if node.module else []
                names = [module] + [module + [alias.name] for alias in node.names]
                base = root if not node.level else file.parent
                for _ in range(node.level - 1):  # `from .. import x`: the package above
                    base = base.parent
            else:
                continue
            for parts in names:
                if parts:
                    queue += [found for found in (base.joinpath(*parts).with_suffix(".py"),
                                                  base.joinpath(*parts, "__init__.py")) if found.is_file()]


def with_launch_port(topology: topo.Topology) -> topo.Topology:
    """The topology with the port a launch meets on: on one host with MASTER_PORT unset, a free port (as torchrun
    --standalone takes one; each launch takes its own), not torchrun's 29500."""
    if topology.mode == topo.TORCHRUN and topology.nnodes == 1 and not topology.elastic and \
            topology.sources.get("master_port", "default") == "default":
        return replace(topology, master_port=free_port(),
                       sources={**topology.sources, "master_port": FREE_PORT_SOURCE})
    return topology


FREE_PORT_SOURCE = "a free port, taken at each launch (one host, MASTER_PORT unset)"


def free_port() -> int:
    """A port nothing listens on now, as torchrun --standalone takes one: with host networking a fixed default
    collides with whatever else runs on the host. (Taken by another process before the agent binds it, the
    rendezvous error says so.)"""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
