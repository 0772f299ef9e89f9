"""The launcher's settings: one declaration, read once (torch-free).

trainer-launch's --help, its docstring and docs/settings.md are generated from LAUNCHER_SETTINGS, as the
training options' are from TrainConfig. The topology variables (NNODES ... MASTER_PORT) are read by the one
topology resolver (trainer/cluster/topology.py); the others by `read()`, once, before anything starts: a bad
value is one line and exit 2.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from trainer.core.errors import UsageError

DEFAULT_RDZV_TIMEOUT = 900
DEFAULT_HANG_TIMEOUT = 600  # seconds: well under torch's 30-minute collective default, above a slow first step
DEFAULT_ELASTIC_RESTARTS = 10  # each lost or returning host is one restart of every host's workers
DEFAULT_STOP_GRACE = "60s"  # compose.yaml's default stop_grace_period: one grace period end to end
SCRIPT_LAUNCH_CHOICES = ("auto", "torchrun", "per-host")
RECOVERY_CHOICES = ("in-place", "restart")
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
# Where a platform's own grace period is visible to the launcher: compose.yaml passes its stop_grace_period,
# the Kubernetes manifests their terminationGracePeriodSeconds (tests/test_k8s_manifests.py keeps them equal).
PLATFORM_GRACE = {"COMPOSE_STOP_GRACE_PERIOD": "compose's stop_grace_period",
                  "TERMINATION_GRACE_PERIOD_SECONDS": "the pod's terminationGracePeriodSeconds"}


@dataclass(frozen=True)
class Variable:
    """One launcher setting: an environment variable trainer-launch reads (default and meaning as shown)."""
    name: str
    default: str
    meaning: str


LAUNCHER_SETTINGS = (
    Variable("NNODES", "1", "hosts in the job; MIN:MAX (e.g. 1:2) for elastic membership: a lost host's peers go on "
             "with as few as MIN hosts and the same global batch, a returning host joins; in place (RECOVERY), or "
             "from the newest checkpoint after the c10d rendezvous at MASTER_ADDR:MASTER_PORT (docs/elastic.md)"),
    Variable("NODE_RANK", "0", "this host's index, 0 .. NNODES-1; rank 0 lives on host 0 (unset under NNODES=MIN:MAX)"),
    Variable("NPROC_PER_NODE", "visible GPUs, or 2 without GPUs", "worker processes on this host"),
    Variable("MASTER_ADDR", "127.0.0.1 on one host; required on several", "address of the NODE_RANK=0 host"),
    Variable("MASTER_PORT", "a free port on one host (as torchrun --standalone); 29500 on several",
             "rendezvous port on the NODE_RANK=0 host"),
    Variable("MAX_RESTARTS", f"0 ({DEFAULT_ELASTIC_RESTARTS} under NNODES=MIN:MAX)", "times the launcher restarts the "
             "workers after a failure (they resume from the newest checkpoint); each restart is one line: "
             "restart 1 of 2: rank 1 (host H) was killed by SIGKILL; ..."),
    Variable("HANG_TIMEOUT", str(DEFAULT_HANG_TIMEOUT), "seconds without progress (a step; for a script not on "
             "trainer.api, an output line) before the launcher prints every rank's stack, names the ranks not in a "
             "collective and ends the job (exit 1); 0 turns it off"),
    Variable("STOP_GRACE_PERIOD", DEFAULT_STOP_GRACE, "how long a stop may take (Compose's name and duration: 70s, "
             "1m30s; or seconds): after SIGTERM the workers get this less a few seconds (the launcher's room to "
             "report) to checkpoint and exit before they are killed; also the longest wait for the other hosts "
             "once this host's workers are done. compose.yaml and the Kubernetes manifests give the container as "
             "long"),
    Variable("SCRIPT_LAUNCH", "auto", "per-host: your script starts its own processes (mp.spawn, a tcp:// init with "
             "its own ranks), so it runs once per host, without torchrun; torchrun: a copy per rank; auto tells them "
             "apart by the source (docs/scripts.md)"),
    Variable("RDZV_TIMEOUT", str(DEFAULT_RDZV_TIMEOUT), "seconds to wait for every host to join"),
    Variable("RECOVERY", "in-place", "what an elastic job (NNODES=MIN:MAX) does when a host is lost or comes back. "
             "in-place: the processes stay, a quorum at every step (torchft's lighthouse, run beside the launcher on "
             "the MASTER_ADDR host) says who trains it, a returning host gets the state from a live peer: seconds per "
             "change; where the job cannot (torchft not installed, --strategy fsdp, local SGD, a script not on "
             "run.steps()) it takes the restart path and says why; on GPUs only when set (no GPU has run it yet). "
             "restart: every host's workers start again from the newest checkpoint (docs/elastic.md)"),
    Variable("LIGHTHOUSE_HOSTS", "MASTER_ADDR", "in place: the hosts that run a lighthouse beside their launcher, "
             "in order, comma-separated (e.g. hostA,hostB; the same on every host; each at MASTER_PORT): the job "
             "uses one, and when its host is lost the hosts left move to the next that answers, keeping their "
             "processes, so that no host's loss ends the job; a lease in the checkpoint directory keeps hosts cut "
             "off from the job's lighthouse from training apart on another (docs/elastic.md)"),
    Variable("PREFLIGHT", "1", "run trainer-doctor before training; 0 skips it"),
    Variable("TRAIN_SCRIPT", "unset", "your own script (a path, or -m and a module) when the command line names none"),
)


def help_table() -> str:
    """The settings as trainer-launch --help shows them."""
    return "\n".join(f"    {v.name} ({v.default})\n" + textwrap.fill(v.meaning, 116, initial_indent=" " * 13,
                                                                    subsequent_indent=" " * 13)
                     for v in LAUNCHER_SETTINGS)


class Environment(dict):
    """The environment with a dotenv file's launcher settings beneath it: Compose's precedence (a variable set in the
    environment wins over the file's). `where` names the file and line of each value taken from the file."""

    def __init__(self, values: Mapping[str, str], where: Mapping[str, str] | None = None):
        super().__init__(values)
        self.where = dict(where or {})


def with_dotenv(env: Mapping[str, str], path: str = ".env", named: bool = False) -> Environment:
    """env, and beneath it the launcher settings of the dotenv file at path (the trainer's reader and its one-line
    errors; a missing default .env is none). Only the names of LAUNCHER_SETTINGS: the trainer reads its own."""
    import io

    from dotenv.parser import parse_stream

    from trainer.config.settings import _read_dotenv

    values = _read_dotenv(path, named)
    names = {v.name for v in LAUNCHER_SETTINGS}
    lines = {b.key: b.original.line for b in parse_stream(io.StringIO(Path(path).read_text(encoding="utf-8-sig")))
             if b.key in names} if values else {}
    taken = {k: v for k, v in values.items() if k in lines and k not in env}
    return Environment({**env, **taken}, {k: f"{path} line {lines[k]}" for k in taken})


def dotenv_file(args: Sequence[str]) -> tuple[str, bool]:
    """(path, named): the dotenv file the built-in trainer reads (its --env-file, default .env), which Compose
    reads too; a script's arguments are its own, so for a script it is .env."""
    builtin = bool(args) and args[0].startswith("-") and args[0] != "-m"
    for i, arg in enumerate(args if builtin else ()):
        if arg.startswith("--env-file="):
            return arg.split("=", 1)[1], True
        if arg == "--env-file" and i + 1 < len(args):
            return args[i + 1], True
    return ".env", False


def located(env: Mapping[str, str], var: str) -> str:
    """A setting's name for a message: with the dotenv file and line its value came from, if it did."""
    where = getattr(env, "where", {}).get(var)
    return f"{var} ({where})" if where else var


def env_int(env: Mapping[str, str], var: str, default: int | None, minimum: int, maximum: int | None = None,
            label: str | None = None, origin: str | None = None) -> int:
    """An integer environment setting, or the one-line error naming it (label: with where it came from; origin:
    what set it, when not the user)."""
    raw, label = env.get(var, "").strip(), label or located(env, var)
    fix = (lambda what: f"set {var} to {what}") if origin is None else (
        lambda what: f"{var} comes from {origin}: find what overwrote it (job script, image ENV) or unset it")
    if not raw:
        if default is None:
            raise UsageError(label, "is not set", fix("a whole number"))
        return default
    if not re.fullmatch(r"[+-]?[0-9]+", raw):  # int() would also take '1_000' and other digits than 0-9
        raise UsageError(label, f"'{raw}' is not an integer", fix("a whole number"))
    value = int(raw)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
        raise UsageError(label, f"{value} is out of range", fix(f"a value {bounds}"))
    return value


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h|d)")


def duration_s(raw: str) -> float | None:
    """Seconds in a Compose duration (Go's: 1m30s, 1.5h, 500ms) or a bare number of seconds; None if neither."""
    text = raw.strip()
    if re.fullmatch(r"\d+(\.\d*)?", text):
        return float(text)
    if not text or _DURATION.sub("", text):
        return None
    return sum(float(number) * _UNITS[unit] for number, unit in _DURATION.findall(text))


def grace_s(env: Mapping[str, str], var: str = "STOP_GRACE_PERIOD", default: str | None = DEFAULT_STOP_GRACE) -> float:
    raw = env.get(var, "").strip() or default
    seconds = duration_s(raw)
    if seconds is None or seconds < 1:
        what = "is not a duration" if seconds is None else "leaves no time to stop (1 s at least)"
        raise UsageError(located(env, var), f"'{raw}' {what}", f"give a duration such as {DEFAULT_STOP_GRACE} or 1m30s (Compose's "
                         "format; a bare number is seconds): the time a stop's checkpoint may take")
    return seconds


def grace_warnings(env: Mapping[str, str], grace: float) -> list[str]:
    """One line for each platform grace period, visible here, that a stop would outlast: the platform kills the
    container before the workers' checkpoint is written."""
    lines = []
    for var, what in PLATFORM_GRACE.items():
        raw = env.get(var, "").strip()
        theirs = duration_s(raw) if raw else None
        if theirs is not None and grace > theirs:
            lines.append(f"warning: STOP_GRACE_PERIOD ({grace:g} s) is longer than {what} ({var}={raw}, {theirs:g} s):"
                         f" the platform kills the container first; give both the same time")
    return lines


def workers_grace_s(grace: float) -> int:
    """The workers' share of a stop's grace period, in whole seconds (torchrun's --shutdown-timeout): the launcher
    keeps a few seconds to report and leave (under compose and Kubernetes, before their SIGKILL of the container)."""
    return max(1, int(grace - min(5.0, grace / 5)))


def boolean(env: Mapping[str, str], var: str, default: bool, meaning: str) -> bool:
    raw = env.get(var, "").strip()
    if not raw:
        return default
    if raw.lower() in TRUE_WORDS + FALSE_WORDS:
        return raw.lower() in TRUE_WORDS
    raise UsageError(located(env, var), f"'{raw}' is not a boolean", meaning)


@dataclass(frozen=True)
class LauncherSettings:
    """What trainer-launch and its agent do besides the topology, read once by read()."""
    max_restarts: int
    rdzv_timeout: int
    hang_timeout: int
    stop_grace: float  # seconds
    script_launch: str
    preflight: bool
    recovery: str = "in-place"  # an elastic job's wish (RECOVERY); launch.choose_recovery says what it gets
    lighthouse_hosts: tuple[str, ...] = ()  # in place, LIGHTHOUSE_HOSTS (empty: MASTER_ADDR's alone)

    @property
    def workers_grace(self) -> int:
        return workers_grace_s(self.stop_grace)


def read(env: Mapping[str, str], elastic: bool) -> LauncherSettings:
    restarts = DEFAULT_ELASTIC_RESTARTS if elastic else 0
    if elastic and not env.get("MAX_RESTARTS", "").strip():  # Kubeflow's elasticPolicy.maxRestarts
        restarts = env_int(env, "PET_MAX_RESTARTS", restarts, 0, label="PET_MAX_RESTARTS (torchrun-env)",
                           origin="torchrun's PET_* variables (Kubeflow Trainer v2's torch runtime sets them)")
    choice = env.get("SCRIPT_LAUNCH", "").strip().lower() or "auto"
    if choice not in SCRIPT_LAUNCH_CHOICES:
        raise UsageError(located(env, "SCRIPT_LAUNCH"), f"'{choice}' is not one of {', '.join(SCRIPT_LAUNCH_CHOICES)}",
                         "per-host runs a script that starts its own processes (mp.spawn) once on each host; "
                         "torchrun runs a copy per rank; auto (the default) tells them apart by the source")
    recovery = env.get("RECOVERY", "").strip().lower() or "in-place"
    if recovery not in RECOVERY_CHOICES:
        raise UsageError(located(env, "RECOVERY"), f"'{recovery}' is not one of {', '.join(RECOVERY_CHOICES)}",
                         "in-place keeps the processes when a host goes or comes (seconds per change); restart starts "
                         "every host's workers again from the newest checkpoint")
    named = env.get("LIGHTHOUSE_HOSTS", "").strip()
    hosts = tuple(item.strip() for item in named.split(",")) if named else ()
    if any(not item or any(c.isspace() or c in "/@" for c in item) for item in hosts) or \
            len(set(hosts)) != len(hosts):
        raise UsageError(located(env, "LIGHTHOUSE_HOSTS"), f"'{named}' is not a list of hosts",
                         "name the hosts that run a lighthouse, in order, comma-separated and each once (e.g. "
                         "10.0.0.1,10.0.0.2), the same on every host; each listens at MASTER_PORT")
    return LauncherSettings(
        max_restarts=env_int(env, "MAX_RESTARTS", restarts, 0),
        rdzv_timeout=env_int(env, "RDZV_TIMEOUT", DEFAULT_RDZV_TIMEOUT, 1),
        hang_timeout=env_int(env, "HANG_TIMEOUT", DEFAULT_HANG_TIMEOUT, 0),
        stop_grace=grace_s(env, "STOP_GRACE_PERIOD"),
        script_launch=choice,
        preflight=boolean(env, "PREFLIGHT", True, "use 1 to run trainer-doctor first or 0 to skip it"),
        recovery=recovery, lighthouse_hosts=hosts)
