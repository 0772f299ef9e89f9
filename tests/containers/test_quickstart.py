"""The README's quickstart, literally, as a new user runs it: a fresh `git clone` (of this checkout's HEAD)
with no .env, the commands the README and docs/containers.md give, the exit status `up` returns and what
the demo learns. No test-only settings: default ports, default image tags, default restart policy.

On a machine without a container registry (CI's), the README's offline path comes first: scripts/offline-build.
Several minutes: four CPU trainings (world sizes 2 and 4, and the two-"host" multi-node pair) and failures.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from containerlib import ROOT, clean_env

RESULT = re.compile(r"summary-cpu-1\s+\| completed at step \d+, world size (\d+): train loss \S+, val acc@1 (\S+)")


@pytest.fixture(scope="module")
def clone(compose_cli, docker_client):
    """A fresh clone in a uniquely named directory (the compose project name), its image built as the README
    says (on a machine without a registry: scripts/offline-build), all taken down afterwards."""
    parent = Path(tempfile.mkdtemp(prefix="ddp-quickstart-"))
    path = parent / f"quickstart-{uuid.uuid4().hex[:8]}"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(path)], check=True, timeout=120)
    assert not (path / ".env").exists()
    if not registry_reachable():  # the README: no registry? scripts/offline-build first
        status, output, took = sh(path, "scripts/offline-build", timeout=1800)
        assert status == 0, output[-4000:]
        print(f"\nscripts/offline-build in the clone: {took:.0f} s")
    yield path
    for args in (["--profile", "*"], ["-f", "compose.multinode.yaml", "-p", "node0", "--profile", "*"],
                 ["-f", "compose.multinode.yaml", "-p", "node1", "--profile", "*"]):
        subprocess.run(["docker", "compose", *args, "down", "-v", "--timeout", "10"], cwd=path, env=clean_env(),
                       capture_output=True, timeout=180)
    shutil.rmtree(parent, ignore_errors=True)


def sh(clone: Path, command: str, timeout: float = 900, **env: str) -> tuple[int, str, float]:
    """A command line as typed in the clone (a shell, the user's environment minus stack settings)."""
    started = time.monotonic()
    out = subprocess.run(["bash", "-c", command], cwd=clone, env=clean_env(**env), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return out.returncode, out.stdout, time.monotonic() - started


def learned(output: str, world_size: int) -> float:
    found = RESULT.findall(output)
    assert found, f"no result line in the output of up:\n{output[-4000:]}"
    size, acc = found[-1]
    assert int(size) == world_size, output[-3000:]
    return float(acc)


def registry_reachable() -> bool:
    out = subprocess.run(["docker", "pull", "--quiet", "debian:bookworm-slim"], capture_output=True, timeout=300)
    return out.returncode == 0


def test_the_readme_quickstart_from_a_fresh_clone(clone):
    readme, containers_md = (clone / "README.md").read_text(), (clone / "docs" / "containers.md").read_text()
    commands = {
        "up": "docker compose --profile cpu up",
        "offline": "scripts/offline-build",
        "world4": "NPROC_PER_NODE=4 docker compose --profile cpu up",
        "again": "docker compose --profile cpu down -v",
        "result": "docker compose --profile cpu cp trainer-cpu:/runs/summary.json .",
        "node0": "NODE_RANK=0 MASTER_ADDR=127.0.0.1 docker compose -f compose.multinode.yaml -p node0 --profile cpu up",
        "node1": "NODE_RANK=1 MASTER_ADDR=127.0.0.1 docker compose -f compose.multinode.yaml -p node1 --profile cpu up",
    }
    for name, command in commands.items():  # what this test (and its fixture) types is what the docs say
        assert command in readme + containers_md, f"the docs no longer show `{command}` ({name})"

    # World size 2: `up` trains, prints the result and ends with the trainer's status.
    status, output, took = sh(clone, commands["up"])
    assert status == 0, output[-4000:]
    assert learned(output, 2) >= 0.9, output[-3000:]
    first_step = re.search(r"trainer-cpu-1\s+\| .*first step done", output)
    assert first_step, output[-3000:]
    print(f"docker compose --profile cpu up, world size 2: {took:.0f} s")
    status, output, _ = sh(clone, commands["result"])
    summary = json.loads((clone / "summary.json").read_text())
    assert status == 0 and summary["status"] == "completed" and summary["val_acc1"] >= 0.9, summary
    # The trainer's own log carries no terminal control codes (Compose's printer adds its own \r ESC[K).
    logs = subprocess.run(["docker", "compose", "--profile", "cpu", "logs", "--no-log-prefix", "trainer-cpu"],
                          cwd=clone, env=clean_env(), capture_output=True, text=True, timeout=60).stdout
    assert "first step done" in logs and "\x1b" not in logs and "\r" not in logs

    # World size 4, from scratch.
    status, output, _ = sh(clone, commands["again"])
    assert status == 0, output
    status, output, took = sh(clone, commands["world4"])
    assert status == 0, output[-4000:]
    assert learned(output, 4) >= 0.9, output[-3000:]
    print(f"NPROC_PER_NODE=4 docker compose --profile cpu up: {took:.0f} s")

    # Two "hosts" on this machine: node0 in the background, node1 in the foreground, as in the docs.
    status, output, took = sh(clone, f"{commands['node0']} > node0.log 2>&1 &\nnode0=$!\n{commands['node1']}\n"
                              "node1_status=$?\nwait $node0; node0_status=$?\ncat node0.log\n"
                              "echo \"statuses: $node0_status $node1_status\"")
    assert "statuses: 0 0" in output, output[-5000:]
    assert learned(output, 4) >= 0.9, output[-3000:]  # node0's summary; node1's points to it
    assert "NODE_RANK 0 host" in output
    print(f"compose.multinode.yaml node0 + node1: {took:.0f} s")


@pytest.mark.parametrize("restart_policy", [None, "no", "on-failure:5"])
def test_a_failing_run_ends_up_with_its_error_and_status_within_seconds(clone, restart_policy):
    policy = {"RESTART_POLICY": restart_policy} if restart_policy else {}
    status, output, took = sh(clone, "docker compose --profile cpu up", timeout=300, TRAIN_BATCH_SIZE="abc",
                              **policy)
    assert status != 0, output[-3000:]
    errors = set(re.findall(r"^trainer-cpu-1\s+\| (error: .*)$", output, re.M))
    assert errors == {"error: TRAIN_BATCH_SIZE: 'abc' is not an integer (give a whole number)"}, output[-3000:]
    assert re.search(r"""service "trainer-cpu" didn't complete successfully: exit 2""", output), output[-3000:]
    assert "Traceback" not in output
    runs = 1 + int((restart_policy or "on-failure:2").partition(":")[2] or 0)
    assert output.count("exited with code 2") == runs, output[-3000:]
    assert took < 10 * runs, f"{took:.0f} s for {runs} runs of a bad setting"
