"""Helpers of the container tests: paths, a clean environment, compose projects."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterable

from helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
MULTINODE_FILE = ROOT / "compose.multinode.yaml"
LOCAL_BASE = "local/debian:bookworm"  # scripts/offline-build's base image and wheelhouse image
WHEELHOUSE_IMAGE = "ddp-trainer:wheelhouse"
CPU_IMAGE = "ddp-trainer:cpu-test"
EMPTY_ENV_FILE = Path(tempfile.gettempdir()) / "ddp-container-tests-empty.env"
EMPTY_ENV_FILE.write_text("")

# Variables that would leak a developer's settings into the tests.
KNOB_PATTERN = re.compile(
    r"^(COMPOSE_|TRAIN_|NCCL_|GLOO_|TORCH_|TENSORBOARD_|NNODES$|NODE_RANK$|NPROC_PER_NODE$|MASTER_|"
    r"MAX_RESTARTS$|RDZV_TIMEOUT$|PREFLIGHT$|GPU_COUNT$|IPC_MODE$|SHM_SIZE$|STOP_GRACE_PERIOD$|"
    r"RESTART_POLICY$|DATA_DIR$|CHECKPOINT_DIR$|RUNS_DIR$|TRAINER_|BASE_IMAGE$|CUDA_VISIBLE_DEVICES$|"
    r"CPU_|ULIMIT_|WHEELHOUSE_IMAGE$|SRC_DIR$)")


def clean_env(**overrides: str) -> dict[str, str]:
    """The process environment minus every stack knob (a fresh clone, no .env), plus overrides."""
    env = {k: v for k, v in os.environ.items() if not KNOB_PATTERN.match(k)}
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def build_env() -> dict[str, str]:
    """How to build the CPU image on this machine (see the module docstring)."""
    env: dict[str, str] = {}
    if os.environ.get("CPU_BASE_IMAGE"):
        env["CPU_BASE_IMAGE"] = os.environ["CPU_BASE_IMAGE"]
    elif subprocess.run(["docker", "image", "inspect", LOCAL_BASE], capture_output=True).returncode == 0:
        env["CPU_BASE_IMAGE"] = LOCAL_BASE
    if os.environ.get("CPU_TORCH_SOURCE"):
        env["CPU_TORCH_SOURCE"] = os.environ["CPU_TORCH_SOURCE"]
    elif subprocess.run(["docker", "image", "inspect", WHEELHOUSE_IMAGE], capture_output=True).returncode == 0:
        env["CPU_TORCH_SOURCE"] = "wheelhouse"
    if env.get("CPU_TORCH_SOURCE") == "wheelhouse":
        env["WHEELHOUSE_IMAGE"] = os.environ.get("WHEELHOUSE_IMAGE") or WHEELHOUSE_IMAGE
    if os.environ.get("TORCH_INDEX_URL"):
        env["TORCH_INDEX_URL"] = os.environ["TORCH_INDEX_URL"]
    return env


def image_exists(client, tag: str) -> bool:
    import docker

    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


class Project:
    """One compose project with its own name, host directories and ports; `down -v` at the end."""

    def __init__(self, compose_cli: list[str], client, base_env: dict[str, str], files: Iterable[Path],
                 name: str, tmp: Path):
        self.cli, self.client = compose_cli, client
        self.files = list(files)
        self.name = f"ddpt-{name}-{uuid.uuid4().hex[:8]}"
        self.dir = tmp / self.name
        self.runs, self.checkpoints, self.data = (self.dir / "runs", self.dir / "checkpoints", self.dir / "data")
        for d in (self.runs, self.checkpoints, self.data):
            d.mkdir(parents=True)
            d.chmod(0o777)  # the containers run as uid 1000
        self.env = clean_env(**base_env, RUNS_DIR=str(self.runs), CHECKPOINT_DIR=str(self.checkpoints),
                             DATA_DIR=str(self.data), MASTER_PORT=str(free_port()),
                             TENSORBOARD_PORT=str(free_port()), ENV_FILE=str(EMPTY_ENV_FILE))
        self.background: list[subprocess.Popen] = []
        self.logfiles = []

    def argv(self, *args: str, profile: str | tuple[str, ...] | None = "cpu") -> list[str]:
        files = [a for f in self.files for a in ("-f", str(f))]
        profiles = [a for p in ((profile,) if isinstance(profile, str) else profile or ()) for a in ("--profile", p)]
        # An empty env file: a developer's .env must not leak into the tests.
        return [*self.cli, *files, "--env-file", str(EMPTY_ENV_FILE), "-p", self.name, *profiles, *args]

    def run(self, *args: str, profile: str | tuple[str, ...] | None = "cpu", timeout: float = 300, check: bool = True,
            **env: str) -> subprocess.CompletedProcess:
        out = subprocess.run(self.argv(*args, profile=profile), cwd=ROOT, env={**self.env, **env},
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"{' '.join(out.args)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
        return out

    def up_attached(self, *args: str, profile: str | tuple[str, ...] | None = "cpu", **env: str) -> subprocess.Popen:
        """`docker compose [--profile P] up ARGS` in the foreground of a background process."""
        log = open(self.dir / f"up-{len(self.background)}.log", "w")  # noqa: SIM115 (closed in logfiles' cleanup)
        self.logfiles.append(log)
        proc = subprocess.Popen(self.argv("up", "--no-build", *args, profile=profile), cwd=ROOT,
                                env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT)
        self.background.append(proc)
        return proc

    def container(self, service: str, timeout: float = 120):
        """The service's container once it exists."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.client.containers.list(all=True, filters={
                "label": [f"com.docker.compose.project={self.name}", f"com.docker.compose.service={service}"]})
            if found:
                return found[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no container for {service} in {self.name} after {timeout:.0f} s")
            time.sleep(0.5)

    def wait_exit(self, service: str, timeout: float) -> dict:
        """Waits until the container has stopped for good (not restarting); returns its State."""
        container = self.container(service)
        deadline = time.monotonic() + timeout
        while True:
            container.reload()
            state = container.attrs["State"]
            if state["Status"] in ("exited", "dead") and not state.get("Restarting"):
                time.sleep(1.0)  # a restart policy may still pick it up: look again
                container.reload()
                again = container.attrs["State"]
                if again["Status"] in ("exited", "dead") and not again.get("Restarting"):
                    return {**again, "RestartCount": container.attrs.get("RestartCount", 0)}
            if time.monotonic() > deadline:
                raise AssertionError(f"{service} still {state['Status']} after {timeout:.0f} s; logs:\n"
                                     f"{self.logs(service)[-3000:]}")
            time.sleep(1.0)

    def logs(self, service: str) -> str:
        return self.container(service).logs(stdout=True, stderr=True).decode(errors="replace")

    def wait_log(self, service: str, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.logs(service), re.M)
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no /{pattern}/ in {service}'s log after {timeout:.0f} s:\n"
                                     f"{self.logs(service)[-3000:]}")
            time.sleep(0.5)

    def summary(self) -> dict:
        return json.loads((self.runs / "summary.json").read_text())

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "--timeout", "20", profile="*", check=False, timeout=180)
        for proc in self.background:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logfiles:
            log.close()
