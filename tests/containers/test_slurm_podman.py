"""The CPU image under the real Slurm (tests/slurmcluster.py) through Podman: slurm/train-container.sbatch
with CONTAINER_RUNTIME=podman, one container per node, as users run the GPU image with their runtime.

Podman, not Docker: `podman run --network=host` joins the network namespace of the process that starts
it (the node's), while Docker's containers live in dockerd's. The image goes from Docker's store into
Podman's (docker-daemon: transport), and leaves it when the test is done.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from containerlib import CPU_IMAGE
from helpers import REPO
from slurmcluster import SlurmJob

pytestmark = pytest.mark.slurm

# This machine's runc may not raise a limit (no CAP_SYS_RESOURCE) and rootful Podman asks for more
# open files and processes than it has: the limits are given, as a site gives its own Podman options.
# No --device: there are no GPUs (the script's default asks for them by CDI).
PODMAN_OPTIONS = "--ulimit nofile=4096:4096 --ulimit nproc=16384:16384"


@pytest.fixture(scope="module")
def podman_image(cpu_image) -> str:
    if shutil.which("podman") is None:
        pytest.fail("podman is not installed (apt-get install podman; .ci/run does)", pytrace=False)
    done = subprocess.run(["podman", "pull", "--quiet", f"docker-daemon:{CPU_IMAGE}"], capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    image = done.stdout.strip().splitlines()[-1]  # the image id, the same as Docker's
    yield image
    # A second copy of a multi-GB image: gone once used (a CI run once ran out of disk here; .ci/run prunes the rest).
    subprocess.run(["podman", "rmi", "--force", image], capture_output=True)
    subprocess.run(["podman", "image", "prune", "--force"], capture_output=True)


def test_the_image_under_slurm_and_podman_trains_on_two_nodes_one_container_each(cluster, podman_image, tmp_path):
    tmp_path.chmod(0o777)
    for name in ("runs", "checkpoints", "data"):  # written by the image's unprivileged user (uid 1000)
        (tmp_path / name).mkdir(mode=0o777)
        (tmp_path / name).chmod(0o777)
    job = SlurmJob(cluster, tmp_path, ["--gres=none", "--cpus-per-task=2", str(REPO / "slurm" / "train-container.sbatch"),
                                       "--model", "cnn", "--synthetic-size", "640", "--batch-size", "16",
                                       "--epochs", "1", "--checkpoint-every", "5"],
                   CONTAINER_RUNTIME="podman", TRAINER_IMAGE=podman_image, PODMAN_OPTIONS=PODMAN_OPTIONS)
    job.assert_completed_on_both_nodes(tmp_path / "runs", tmp_path / "checkpoints", steps=10)
    output = job.output()
    assert "under podman on 2 nodes" in output
    for node_rank in (0, 1):
        assert f"topology: nnodes=2 node_rank={node_rank} nproc_per_node=2 world_size=4" in output
    assert "checkpoint committed: /checkpoints/step-00000010.pt" in output  # the container's mount
