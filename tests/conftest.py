"""Fixtures shared by the multi-process test modules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fault_helpers import Launch

HERE = Path(__file__).parent
# One Docker engine's images and one Slurm cluster: their tests share session fixtures (an image build, a cluster
# of three daemons on fixed ports), which a second worker would build or start a second time.
ONE_MACHINE = (HERE / "containers", HERE / "slurm")


def pytest_collection_modifyitems(config, items):
    """Under scripts/test's workers (pytest-xdist, --dist loadgroup): each test file on one worker, so its module
    fixtures (a reference run, a packed dataset) are made once, and every container and Slurm test on one worker."""
    for item in items:
        path = Path(str(item.fspath))
        group = "containers-and-slurm" if any(d in path.parents for d in ONE_MACHINE) else path.stem
        item.add_marker(pytest.mark.xdist_group(group))


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
