"""Fixtures for the container tests: a Docker engine, Compose v2, the CPU image, compose projects.

Without an engine or Compose v2 these tests skip and say why; with REQUIRE_DOCKER=1 (CI) they
fail instead. Each test uses its own compose project name, host directories and ports, and takes
its containers and volumes down afterwards (docker compose down -v).

Knobs (environment):
  REQUIRE_DOCKER=1        fail instead of skip when the engine or Compose v2 is missing
  CPU_BASE_IMAGE          base of the CPU image (default: local/debian:bookworm when that image
                          exists, else compose.yaml's default)
  CPU_TORCH_SOURCE        index | wheelhouse (default: wheelhouse when scripts/offline-build's wheelhouse
                          image ddp-trainer:wheelhouse exists; WHEELHOUSE_IMAGE names another)
  TEST_REUSE_IMAGE=1      use an existing ddp-trainer:cpu-test image as is, without "docker compose build"
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable

import pytest

from containerlib import COMPOSE_FILE, CPU_IMAGE, EMPTY_ENV_FILE, ROOT, Project, build_env, clean_env, image_exists


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.container)


def _unavailable(reason: str):
    if os.environ.get("REQUIRE_DOCKER", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"REQUIRE_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def compose_cli() -> list[str]:
    """`docker compose` (v2) as an argv prefix; skips (or fails under REQUIRE_DOCKER=1) without it."""
    if shutil.which("docker") is None:
        _unavailable("no docker CLI on PATH")
    try:
        out = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True,
                             text=True, timeout=30)
    except subprocess.TimeoutExpired:
        _unavailable("`docker compose version` timed out")
    version = out.stdout.strip().lstrip("v")
    if out.returncode != 0 or not version.startswith("2"):
        _unavailable(f"Compose v2 is not installed as a docker CLI plugin "
                     f"(`docker compose version`: {(out.stderr or out.stdout).strip()[:200]})")
    return ["docker", "compose"]


@pytest.fixture(scope="session")
def docker_client(compose_cli):
    """A docker SDK client of a running engine; skips (or fails) without one."""
    try:
        import docker
    except ImportError:
        _unavailable("the docker Python SDK is not installed (pip install -e '.[test]')")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except Exception as err:  # noqa: BLE001 - any failure means "no engine"
        _unavailable(f"no Docker engine answers ({type(err).__name__}: {str(err)[:200]})")
    yield client
    client.close()


@pytest.fixture(scope="session")
def cpu_image(docker_client, compose_cli) -> dict[str, str]:
    """Builds the CPU image once per session with `docker compose --profile cpu build`.

    BuildKit's layer cache makes a rebuild of unchanged sources take seconds, so the image always
    matches the working tree; TEST_REUSE_IMAGE=1 skips even that when the tag exists.
    Returns the environment every compose call of the tests needs (the image tag and how it was built).
    """
    env = {"TRAINER_CPU_IMAGE": CPU_IMAGE, **build_env()}
    reuse = os.environ.get("TEST_REUSE_IMAGE", "").strip().lower() in ("1", "true", "yes")
    if not (reuse and image_exists(docker_client, CPU_IMAGE)):
        started = time.monotonic()
        out = subprocess.run([*compose_cli, "-f", str(COMPOSE_FILE), "--env-file", str(EMPTY_ENV_FILE),
                              "--profile", "cpu", "build", "trainer-cpu"],
                             cwd=ROOT, env=clean_env(**env), capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            pytest.fail(f"building the CPU image failed ({env}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}",
                        pytrace=False)
        print(f"\nCPU image {CPU_IMAGE} built in {time.monotonic() - started:.0f} s with {env}")
    return env


@pytest.fixture
def make_project(compose_cli, docker_client, cpu_image):
    """make_project(name, files=[compose.yaml]) -> Project; all are taken down after the test."""
    projects: list[Project] = []
    tmp = Path(tempfile.mkdtemp(prefix="ddp-container-tests-"))
    tmp.chmod(0o755)

    def make(name: str, files: Iterable[Path] = (COMPOSE_FILE,)) -> Project:
        project = Project(compose_cli, docker_client, cpu_image, files, name, tmp)
        projects.append(project)
        return project

    yield make
    for project in projects:
        project.down()
    # Files the containers wrote belong to uid 1000; removing them as another user may fail.
    shutil.rmtree(tmp, ignore_errors=True)
