"""Fixtures shared by the multi-process test modules."""

from __future__ import annotations

import os

import pytest

from fault_helpers import Launch

# scripts/test's workers (pytest-xdist): each test file on one worker, so its module fixtures (a reference run, a
# packed dataset) are made once; and every container and Slurm test on one worker, in the order collected, first:
# they share session fixtures (one image build, one Slurm cluster of three daemons on fixed ports) that a second
# worker would build or start a second time, and they take longest.
ONE_MACHINE = ("tests/containers/", "tests/slurm/")
try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest without xdist (scripts/test installs it): one process, nothing to schedule
    pass
else:
    class ByFile(LoadScopeScheduling):
        """xdist's scope scheduling with the scopes above (its xdist_group marks do not reach pytest 9's node ids)."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "containers-and-slurm" if path.startswith(ONE_MACHINE) else path

    # Optional: under `-p no:xdist` (one process, as scripts/test's users may ask) pytest knows no such hook.
    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(config, log):
        config.option.loadscopereorder = False  # the order below: the longest first, the short ones fill the gaps
        return ByFile(config, log)

# The files whose tests take longest (a local CI run's junit report, 2026-11-29, two workers), scheduled first after the
# container and Slurm group so that no long file starts last and runs alone. A scheduling hint: a file missing here
# only starts later.
SLOWEST_FIRST = ("test_inplace", "test_launcher_truth", "test_faults", "test_user_code", "test_bench", "test_elastic",
                 "test_recipe", "test_fsdp", "test_resume", "test_scripts", "test_bad_input", "test_shm_allreduce",
                 "test_api", "test_training", "test_pack", "test_speed_settings", "test_pipeline",
                 "test_async_checkpoint",
                 "test_observe", "test_config")


def pytest_collection_modifyitems(config, items):
    """Under the workers (each collects the same order, which the scheduler keeps): the container and Slurm tests,
    then SLOWEST_FIRST's files, then the rest as collected; within a file the order stays. In one process: as
    collected."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        if path.startswith(ONE_MACHINE):
            return 0
        name = path.rsplit("/", 1)[-1].removesuffix(".py")
        return 1 + SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else 1 + len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: the order within each file is kept


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
