"""Fixtures shared by the multi-process test modules."""

from __future__ import annotations

import os

import pytest

from fault_helpers import Launch


@pytest.fixture
def launches():
    """Launchers started by a test; any still running at the end are killed with their workers."""
    started: list[Launch] = []
    yield started
    for launch in started:
        if launch.proc.poll() is None:
            launch.stop_everything()


@pytest.fixture
def hosts():
    """Two hosts in network namespaces joined by a veth pair (tests/netns.py); needs root."""
    from netns import two_hosts

    yield from two_hosts()


# ------------------------------------------------------------------ a real Slurm (tests/slurmcluster.py)

def _slurm_unavailable(reason: str):
    """Skip and say why; with REQUIRE_SLURM=1 (set by .ci/run) fail instead: in CI a skip is a failure."""
    if os.environ.get("REQUIRE_SLURM", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A controller and two compute nodes on this machine, started once per session."""
    from slurmcluster import SlurmCluster, SlurmUnavailable, missing_requirements

    reason = missing_requirements()
    if reason:
        _slurm_unavailable(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-cluster"))
    try:
        cluster.__enter__()
    except SlurmUnavailable as err:
        _slurm_unavailable(str(err))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(slurm_cluster):
    """The session's cluster, idle (nothing left running by an earlier test) before and after each test."""
    slurm_cluster.wait_idle()
    yield slurm_cluster
    slurm_cluster.run(["scancel", "--full", "--quiet", "--user=root"], check=False)
    slurm_cluster.wait_idle(120)
