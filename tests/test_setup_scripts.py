"""The README's setup scripts as a newcomer's host has them: what they refuse to do to what is already there.

scripts/install-compose on a host that already has a docker-compose plugin of its own (Docker's package, another
version, a link by hand): it is left alone, with one line naming --force, before anything is installed. (The
install itself, from PyPI, and scripts/offline-build against an engine: tests/containers/test_quickstart.py.)
The test suite itself, run in one process with xdist turned off, as scripts/test passes pytest's own flags on; the
torch scripts/test installs (PyPI's CUDA build, or PyTorch's CPU wheels on a host without an NVIDIA GPU when that index
answers), decided against a stand-in venv whose python only notes its arguments (nothing is installed).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import REPO, clean_env


def install_compose(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = clean_env({"DOCKER_CONFIG": str(tmp_path / "docker"), "COMPOSE_VENV": str(tmp_path / "venv")})
    return subprocess.run([str(REPO / "scripts" / "install-compose"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("theirs", ["a file", "a link elsewhere"])
def test_install_compose_refuses_to_replace_a_plugin_that_is_not_its_own(tmp_path, theirs):
    plugin = tmp_path / "docker" / "cli-plugins" / "docker-compose"
    plugin.parent.mkdir(parents=True)
    if theirs == "a file":
        plugin.write_text("#!/bin/sh\necho Docker's own compose\n")
        plugin.chmod(0o755)
        shown = "a file, not this script's link"
    else:
        plugin.symlink_to("/usr/libexec/docker/cli-plugins/docker-compose")
        shown = "a link to /usr/libexec/docker/cli-plugins/docker-compose"
    before = (plugin.is_symlink(), os.readlink(plugin) if plugin.is_symlink() else plugin.read_text())
    result = install_compose(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"error: {plugin}: a docker-compose plugin is already there ({shown}) (keep it, or run "
        "scripts/install-compose --force to replace it)"]
    assert (plugin.is_symlink(), os.readlink(plugin) if plugin.is_symlink() else plugin.read_text()) == before
    assert not (tmp_path / "venv").exists()  # refused before anything was installed


def test_install_compose_takes_an_unknown_argument_as_a_mistake(tmp_path):
    result = install_compose(tmp_path, "--forse")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: scripts/install-compose: unknown argument '--forse' (use --force "
                                          "or --help)"]


def test_the_suite_runs_in_one_process_with_xdist_turned_off(tmp_path):
    """`scripts/test -p no:xdist ...`: tests/conftest.py's scheduler hook for xdist's workers is optional, so pytest
    without the plugin runs the tests instead of stopping at an unknown hook (INTERNALERROR)."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                           "tests/test_drivers.py"], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


@contextlib.contextmanager
def package_index(tmp_path, answers: bool):
    """A package index on a local port: one that serves torch's page, or one that takes the connection and never
    answers (a firewall that drops, a proxy that stalls: what must not hang scripts/test)."""
    if not answers:
        with socket.socket() as silent:
            silent.bind(("127.0.0.1", 0))
            silent.listen(8)
            yield f"http://127.0.0.1:{silent.getsockname()[1]}/whl/cpu"
        return
    (tmp_path / "index" / "whl" / "cpu" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "whl" / "cpu" / "torch" / "index.html").write_text("<a>torch-2.14.1+cpu</a>\n")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=tmp_path / "index"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/whl/cpu"
    finally:
        server.shutdown()
        server.server_close()


def install_decision(tmp_path, index: str, gpu: bool) -> tuple[list[str], str, float]:
    """scripts/test with a stand-in venv (its python notes each call and does nothing) and `index` as the CPU index:
    (the pip install of the project, its line, seconds taken). gpu: an `nvidia-smi` on PATH."""
    venv, bin_dir = tmp_path / "venv", tmp_path / "bin"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\necho "$*" >> "$(dirname "$0")/../calls"\n')
    python.chmod(0o755)
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = clean_env({"VENV": str(venv), "TORCH_CPU_INDEX": index, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    began = time.monotonic()
    done = subprocess.run([str(REPO / "scripts" / "test"), "-q"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    took = time.monotonic() - began
    assert done.returncode == 0, done.stdout + done.stderr
    installs = [line.split() for line in (venv / "calls").read_text().splitlines() if "-e .[test]" in line]
    assert len(installs) == 1, (venv / "calls").read_text()
    lines = [line for line in done.stderr.splitlines() if line.startswith("scripts/test: ")]
    assert len(lines) == 1, done.stderr
    return installs[0], lines[0], took


def no_gpu_here() -> None:
    if shutil.which("nvidia-smi") or glob.glob("/dev/nvidia*"):
        pytest.skip("this host has an NVIDIA GPU: scripts/test rightly takes PyPI's CUDA build here")


def test_scripts_test_takes_the_cpu_wheels_on_a_host_without_a_gpu_when_their_index_answers(tmp_path):
    no_gpu_here()
    with package_index(tmp_path, answers=True) as index:
        install, line, _ = install_decision(tmp_path, index, gpu=False)
    assert install == ["-m", "pip", "install", "--extra-index-url", index, "-e", ".[test]"], install
    assert "--quiet" not in install  # pip says what it fetches for the minutes it takes
    assert line.endswith(f"; torch: the CPU build from {index} (no NVIDIA GPU here): about 2 GB and a few minutes")


def test_scripts_test_falls_back_to_pypi_at_once_when_the_cpu_index_does_not_answer(tmp_path):
    """A closed network (this CI machine's): the probe gives up after 5 s, and the install is the one from PyPI."""
    no_gpu_here()
    with package_index(tmp_path, answers=False) as index:
        install, line, took = install_decision(tmp_path, index, gpu=False)
    assert install == ["-m", "pip", "install", "-e", ".[test]"], install
    assert line.endswith(f"; torch: PyPI's CUDA build (no NVIDIA GPU here, but {index} did not answer within 5 s): "
                         "about 6 GB and 5 minutes"), line
    assert took < 20, took


def test_scripts_test_takes_pypis_cuda_build_where_nvidia_smi_is(tmp_path):
    with package_index(tmp_path, answers=True) as index:
        install, line, _ = install_decision(tmp_path, index, gpu=True)
    assert install == ["-m", "pip", "install", "-e", ".[test]"], install
    assert line.endswith("; torch: PyPI's CUDA build (an NVIDIA GPU is here): about 6 GB and 5 minutes"), line
