"""`trainer-launch`: the container entrypoint. Topology from the environment -> torch's elastic agent.

    trainer-launch [TRAINING OPTIONS]          the built-in trainer (`python -m trainer`) on every process
    trainer-launch my_train.py [ARGS]          your own script on every process (torchrun's convention)
    trainer-launch -m mypkg.train [ARGS]       your own module, as `python -m mypkg.train` would run it
    trainer-launch --dry-run [...]             print the resolved topology and the command as JSON; start nothing

Its settings (environment variables, or a .env file; docs/settings.md), besides what Slurm, Kubeflow (Trainer v2
PET_*, PyTorchJob v1), a Kubernetes Indexed Job or SkyPilot set (trainer/cluster/topology.py reads them, in the
order docs/clusters.md gives):
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from trainer.checkpoint.claim import Ended, check_ended, claim, trained_here
from trainer.cluster import lighthouse
from trainer.cluster.launch import SCRIPT_ENV, Launch, build_command, per_host_env, recovery_unused
from trainer.cluster.topology import Topology
from trainer.config import launcher
from trainer.config.launcher import help_table
from trainer.config.settings import (ELASTIC_WORLD_ENV, INPLACE_JOB_ENV, INPLACE_WORLD_ENV, LIGHTHOUSE_ENV,
                                     LIGHTHOUSES_ENV, REPLICA_ADDR_ENV, REPLICA_ENV, TrainConfig, script_settings)
from trainer.core.errors import UsageError, exit_on_usage_error, print_error

EPILOG = """

The built-in trainer's options are validated here, before any worker starts, so a mistake is one line and exit
code 2, never a hang. A script's or module's arguments are its own; the launcher checks that the script is a file
or that the module can be found (without running it), then runs it under the same agent, with the same topology,
preflight, restarts and one-line failure summary naming the rank (after the script's own traceback). trainer.api
gives such a script the built-in trainer's process group setup, resumable sampler, checkpoints, SIGTERM stop and
TensorBoard logging. The launcher runs torch's elastic agent (what torchrun runs) in its own process, so signals
reach it directly, and prints the torchrun command that does the same by hand. A container given RANK and
WORLD_SIZE but no node layout (one process per container) runs the worker itself.
"""
DRY_RUN = "--dry-run"


def split_dry_run(argv: Sequence[str], env: Mapping[str, str]) -> tuple[bool, list[str]]:
    """--dry-run first, or anywhere among the built-in trainer's options (a script's arguments are its own)."""
    args = list(argv)
    if args[:1] == [DRY_RUN]:
        return True, args[1:]
    builtin = args[0].startswith("-") and args[0] != "-m" and not env.get(SCRIPT_ENV, "").strip() if args else False
    if builtin and DRY_RUN in args:
        return True, [a for a in args if a != DRY_RUN]
    return False, args


def check_the_cut(cfg) -> None:
    """Pipeline stages of a built-in model: the model's fit (no loss of its own) and the cut (its split's names,
    enough blocks for the stages) checked here, before any worker starts, on the model built on the meta device (no
    memory, no weights; torch imported for this job alone). A user's model is checked by its workers: building it
    here would run its code twice."""
    from trainer.config import catalog

    if cfg.pipeline_stages == 1 or cfg.model not in catalog.MODELS:
        return
    import torch

    from trainer.config.settings import flag_name
    from trainer.data.images import builtin_spec
    from trainer.engine.loop import recipe_fits
    from trainer.engine.models import build_model
    from trainer.parallel.pipeline import split_points

    dataset = cfg.dataset if cfg.dataset in catalog.DATASETS else "synthetic"  # the cut depends on the layers, not
    try:  # on the class count or image size the data will give: a nominal spec builds the same blocks
        with torch.device("meta"):
            model = build_model(cfg.model, builtin_spec(dataset, cfg.synthetic_image_size))
    except UsageError:
        return  # a model that cannot take this data: the workers say so, with the data they read
    recipe_fits(cfg, model)  # a model with its own loss (compute_loss) has none a last stage could compute
    split_points(model, cfg.pipeline_stages * cfg.pipeline_chunks, cfg.pipeline_split, flag_name("pipeline_split"),
                 cfg.model, cfg.pipeline_chunks)


def stopped_at_start(signum, _frame) -> None:
    """A stop before the agent takes the signals over (it does once torch is loaded): nothing has started."""
    print(f"stopped by {signal.Signals(signum).name} during start-up, before training began", file=sys.stderr,
          flush=True)
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if argv is None:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stopped_at_start)
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__ + help_table() + EPILOG)
        print("\nThe built-in trainer's options (python -m trainer --help):")
        os.execvp(sys.executable, [sys.executable, "-m", "trainer", "--help"])
    dry_run, args = split_dry_run(args, os.environ)
    with exit_on_usage_error():
        env = launcher.with_dotenv(os.environ, *launcher.dotenv_file(args))
        launch = build_command(env, args, pick_port=True)
        if launch.cfg is not None:
            check_the_cut(launch.cfg)
        for line in [*launcher.grace_warnings(env, launch.settings.stop_grace), recovery_unused(env, launch.job)]:
            if line is not None:
                print(line, file=sys.stderr, flush=True)
        if dry_run:
            per_host = {} if launch.per_host is None else {"mode": "per-host", "once_per_host": launch.per_host}
            if launch.recovery is not None:
                per_host["recovery"] = "in-place" if launch.in_place else "restart"
                per_host["recovery_line"] = launch.recovery.line()
            print(json.dumps({**launch.job.facts(launch.in_place), **per_host, "command": launch.command}, indent=2))
            return 0
        if launch.rendezvous is not None and not launch.topology.elastic:  # c10d: any host may host it
            ensure_master_port_free(launch.topology)
        if launch.topology.elastic:  # the restart path (in place, this host's agent runs a group of its own)
            os.environ[ELASTIC_WORLD_ENV] = str(launch.topology.world_size)
            # torch's shared rendezvous store publishes the workers' MASTER_ADDR only in a node's first round,
            # so a host joining a running job waits forever for it (and a node that becomes rank 0 later
            # trips an AssertionError): every round publishes its own without the sharing.
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    print(launch.job.summary(launch.in_place), file=sys.stderr, flush=True)
    if launch.recovery is not None:
        print(launch.recovery.line(), file=sys.stderr, flush=True)
    if launch.settings.preflight:
        run_preflight(launch.cfg, env)
    if launch.in_place:
        with exit_on_usage_error():
            try:
                start_in_place(launch, env)
            except Ended as ended:
                print(ended, file=sys.stderr, flush=True)
                return 0
            except LighthouseGone as gone:
                print(gone, file=sys.stderr, flush=True)
                return 1
    program = [*launch.program.target, *launch.program.args]
    if launch.per_host is not None:
        shown = shlex.join(program[:2] if program[0] == "-m" else program[:1])
        print(f"{shown} starts its own processes ({launch.per_host}): running it once on this host, without "
              "torchrun, with NNODES, NODE_RANK, NPROC_PER_NODE, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its "
              "environment (SCRIPT_LAUNCH=torchrun runs a copy per rank instead)", file=sys.stderr, flush=True)
        os.environ.update(per_host_env(launch.topology))
    print("+ " + shlex.join(launch.command), file=sys.stderr, flush=True)
    if launch.rendezvous is None and launch.per_host is None:  # one rank of its own: it becomes the worker
        os.execvp(launch.command[0], launch.command)
    from trainer.cluster import agent

    return agent.run_once(launch, program) if launch.per_host is not None else agent.run(launch, program)


def start_in_place(launch: Launch, env: Mapping[str, str]) -> subprocess.Popen | None:
    """The lighthouse (beside this launcher, on the MASTER_ADDR host, unless one answers there already), then the
    wait for it; the workers' environment (the agent passes this process's on). A lighthouse that never answers, or
    something else that answers in its place, is one line and exit 2 (UsageError); one that answered this job before
    (the built-in loop's checkpoint directory says so) is one line and exit 1 (LighthouseGone)."""
    job, recovery = launch.job, launch.recovery
    host, port = job.master_addr, job.master_port
    # LIGHTHOUSE_HOSTS: each runs one beside its launcher; the job uses the first that answers (the workers move to
    # the next when its host is lost: trainer.engine.lighthouses). The job's name stays MASTER_ADDR's (identity).
    hosts = launch.settings.lighthouse_hosts or (host,)
    bound = launch.settings.rdzv_timeout
    started = None
    identity = lighthouse.identity(host, port)
    ended, trained = None, False
    if launch.cfg is not None:  # the built-in loop's directory is known here: another job's is refused now
        directory, settings = Path(launch.cfg.checkpoint_dir), launch.cfg.as_dict()
        # Started again as the job ended (or after): the directory says so, before this host takes it for a new job
        # and while it waits for a lighthouse that will not come back (up to RDZV_TIMEOUT).
        ended = lambda: check_ended(directory, identity, settings)  # noqa: E731 (a poll, not a definition)
        ended()
        trained = trained_here(directory, identity)  # before the claim, which may clear what dead processes left
        hold_for_the_job(directory, identity)
    addr_var, port_var = job.variables("master_addr")[0], job.variables("master_port")[0]
    try:
        mine = next((each for each in hosts if lighthouse.here(each)), None)
        if mine is not None and lighthouse.answers(mine, port) is not None:
            timeout = launch.cfg.collective_timeout if launch.cfg is not None else \
                script_settings({}, env, job.world_size).collective_timeout
            started = lighthouse.start(port, job.min_nodes, timeout)
        why = lighthouse.wait(hosts if len(hosts) > 1 else host, port, bound,
                              lambda line: print(line, file=sys.stderr, flush=True), started, ended)
    except lighthouse.NotTheLighthouse as seen:
        raise UsageError(addr_var, f"what answers at {lighthouse.url(host, port)} is not torchft's lighthouse ({seen})",
                         f"another service holds {port_var} on the MASTER_ADDR host; choose another {port_var}, the "
                         "same on every host, or stop it") from None
    if why is not None and trained:
        # This job's lighthouse answered once (it took a generation in the directory): what went is the
        # infrastructure, not a setting (a worker pod started again while the lighthouse's pod cannot be scheduled).
        # Exit 1, which restart policies retry (Compose's on-failure, a Job's backoff); exit 2 stays the settings'.
        where = " or ".join(lighthouse.url(each, port) for each in hosts)
        raise LighthouseGone(f"error: in place: the lighthouse at {where} cannot be reached ({why}; waited "
                             f"RDZV_TIMEOUT, {bound} s), and this job trained in {directory} before: its host is down "
                             "or cut off, not a mistake in the settings (start it again, or mend the network between "
                             "the hosts; this launcher exits 1, which a restart policy retries)")
    if why is not None and len(hosts) > 1:
        raise UsageError("LIGHTHOUSE_HOSTS", f"no lighthouse at {' or '.join(lighthouse.url(h, port) for h in hosts)} "
                         f"can be reached ({why}; waited RDZV_TIMEOUT, {bound} s)", "start trainer-launch on a host of "
                         "LIGHTHOUSE_HOSTS first (it runs a lighthouse), or check LIGHTHOUSE_HOSTS, MASTER_PORT and "
                         "the firewall between the hosts")
    if why is not None:
        given = job.variables("master_addr", "master_port") or ["MASTER_ADDR", "MASTER_PORT"]
        raise UsageError(given[0], f"the lighthouse at {lighthouse.url(host, port)} cannot be reached ({why}; waited "
                         f"RDZV_TIMEOUT, {bound} s)", f"start trainer-launch on the MASTER_ADDR host first (it runs "
                         f"the lighthouse), or check {', '.join(given)} and the firewall between the hosts; "
                         "RECOVERY=restart takes the restart path instead")
    if started is not None:  # this launcher runs the lighthouse: it starts it again whenever it ends
        lighthouse.keep(started, port, job.min_nodes, timeout, lambda line: print(line, file=sys.stderr, flush=True))
    if len(hosts) > 1:
        os.environ[LIGHTHOUSES_ENV] = ",".join(lighthouse.url(each, port) for each in hosts)
    os.environ.update({LIGHTHOUSE_ENV: lighthouse.url(hosts[0], port), INPLACE_WORLD_ENV: str(job.world_size),
                       REPLICA_ENV: recovery.replica, REPLICA_ADDR_ENV: recovery.local.master_addr,
                       INPLACE_JOB_ENV: identity})
    return started


class LighthouseGone(Exception):
    """The job's lighthouse, which answered before, cannot be reached: an infrastructure fault (exit 1)."""


_HELD: list = []  # the checkpoint directory's lock, held by this launcher while it runs (its workers come and go)


def hold_for_the_job(directory: Path, identity: str) -> None:
    """Take the checkpoint directory for this in-place job, with its other hosts (trainer.checkpoint.claim): a
    directory another job (another lighthouse) or another run holds is one line and exit 2 before any worker starts.
    A directory that cannot be made is left to the workers, whose checks say why."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return
    _HELD.append(claim(directory, job=identity))


def ensure_master_port_free(topology: Topology) -> None:
    """Node 0's torchrun hosts the rendezvous store on MASTER_PORT. A taken port would otherwise show
    only after the rendezvous timeout, as a C++ error about the store."""
    if topology.node_rank != 0:
        return
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is no conflict
        try:
            sock.bind(("", topology.master_port))
        except OSError as err:
            given = topology.sources.get("master_port", "default")
            raise UsageError("MASTER_PORT (default)" if given == "default" else given,
                             f"{topology.master_port} cannot be used on this host ({err.strerror})",
                             "stop what listens there (another NODE_RANK=0 launcher?) or choose a free "
                             "MASTER_PORT, the same on every host") from None


def run_preflight(cfg: TrainConfig | None, env: Mapping[str, str]) -> None:
    """cfg None: a user's script, checked without the built-in trainer's options."""
    from trainer.cli.doctor import format_table, run_checks

    checks = run_checks(env, cfg, own_script=cfg is None)
    failed = [c for c in checks if c.status == "fail"]
    if failed or any(c.status == "warn" for c in checks):
        print(format_table([c for c in checks if c.status != "pass"]), file=sys.stderr, flush=True)
    if failed:
        first = failed[0]
        print_error(f"preflight: {first.name}: {first.value} ({first.fix}; PREFLIGHT=0 skips the checks)")
        raise SystemExit(2)


if __name__ == "__main__":
    raise SystemExit(main())
