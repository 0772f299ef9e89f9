"""The README's setup scripts as a newcomer's host has them: what they refuse to do to what is already there.

scripts/install-compose on a host that already has a docker-compose plugin of its own (Docker's package, another
version, a link by hand): it is left alone, with one line naming --force, before anything is installed. (The
install itself, from PyPI, and scripts/offline-build against an engine: tests/containers/test_quickstart.py.)
The test suite itself, run in one process with xdist turned off, as scripts/test passes pytest's own flags on.
"""

from __future__ import annotations

import os
import subprocess
import sys

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
