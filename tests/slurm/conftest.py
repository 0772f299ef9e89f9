"""A real Slurm cluster for the tests in this folder, started once per session (see slurmcluster.py).

Without the packages or root these tests skip and say why; with REQUIRE_SLURM=1 (set by .ci/run)
they fail instead: in CI a skip is a failure.
"""

from __future__ import annotations

import os

import pytest

from slurmcluster import SlurmCluster, SlurmUnavailable, missing_requirements


def _unavailable(reason: str):
    if os.environ.get("REQUIRE_SLURM", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    reason = missing_requirements()
    if reason:
        _unavailable(reason)
    try:
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-cluster"))
        cluster.__enter__()
    except SlurmUnavailable as err:
        _unavailable(str(err))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(slurm_cluster):
    """The session's cluster, idle (no job left running by an earlier test) before and after each test."""
    slurm_cluster.wait_idle()
    yield slurm_cluster
    slurm_cluster.run(["scancel", "--full", "--quiet", "--user=root"], check=False)
    slurm_cluster.wait_idle(120)
