"""trainer-doctor runs its real checks against this machine; only the env mapping is synthetic."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.doctor import (Check, check_same_versions, format_table, main, run_checks,
                            version_fingerprint)

REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT",
               "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
# Docker's default 64 MiB /dev/shm would (rightly) fail the shm check with two workers; setting
# no workers keeps the "everything passes" cases independent of where the tests run.
NO_WORKERS = {"TRAIN_NUM_WORKERS": "0"}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # Default ./checkpoints and ./runs resolve here instead of in the repository.
    monkeypatch.chdir(tmp_path)


def row(checks: list[Check], name: str) -> Check:
    (found,) = [c for c in checks if c.name == name]
    return found


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == "fail"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_defaults_pass():
    checks = run_checks(NO_WORKERS)
    assert failures(checks) == []
    assert all(c.status in ("pass", "warn", "fail") and isinstance(c.value, str) for c in checks)
    assert all(c.fix for c in checks if c.status != "pass")
    assert row(checks, "versions").status == "pass"


def test_defaults_only_shm_may_fail():
    checks = run_checks({})
    assert [c.name for c in failures(checks)] in ([], ["shared memory"])
    if failures(checks):
        assert "shm_size" in row(checks, "shared memory").fix


def test_huge_prefetch_fails_shm():
    checks = run_checks({"TRAIN_NUM_WORKERS": "64", "TRAIN_BATCH_SIZE": "100000"})
    shm = row(checks, "shared memory")
    assert shm.status == "fail" and "ipc: host" in shm.fix


def test_missing_nccl_interface_fails():
    checks = run_checks({**NO_WORKERS, "NCCL_SOCKET_IFNAME": "doesnotexist0"})
    nccl = row(checks, "NCCL_SOCKET_IFNAME")
    assert nccl.status == "fail"
    assert "doesnotexist0" in nccl.value
    assert "existing interfaces" in nccl.fix


def test_nccl_exclusion_list_is_not_an_existence_check():
    checks = run_checks({**NO_WORKERS, "NCCL_SOCKET_IFNAME": "^doesnotexist0,docker"})
    assert row(checks, "NCCL_SOCKET_IFNAME").status == "pass"


@pytest.mark.skipif("lo" not in [n for _, n in socket.if_nameindex()], reason="no lo interface")
def test_loopback_interface_fails_multi_node():
    env = {**NO_WORKERS, "NNODES": "2", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    assert row(run_checks(env), "GLOO_SOCKET_IFNAME").status == "fail"
    # On a single node loopback is fine.
    single = {**NO_WORKERS, "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}
    assert failures(run_checks(single)) == []


def test_multi_node_without_interface_warns():
    checks = run_checks({**NO_WORKERS, "NNODES": "2", "MASTER_ADDR": "127.0.0.1"})
    assert row(checks, "socket interface").status == "warn"


def test_multi_node_without_master_addr_fails():
    master = row(run_checks({**NO_WORKERS, "NNODES": "2"}), "MASTER_ADDR")
    assert master.status == "fail" and "MASTER_ADDR" in master.fix


def test_unresolvable_master_addr_fails():
    env = {**NO_WORKERS, "NNODES": "2", "MASTER_ADDR": "no-such-host.invalid"}
    assert row(run_checks(env), "MASTER_ADDR").status == "fail"


def test_loopback_master_on_node0_warns():
    env = {**NO_WORKERS, "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    assert row(run_checks(env), "MASTER_ADDR").status == "warn"


def test_unreachable_master_port_warns():
    env = {**NO_WORKERS, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    port = row(run_checks(env), "MASTER_PORT")
    assert port.status == "warn" and "start node 0 first" in port.fix


def test_listening_master_port_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        env = {**NO_WORKERS, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(server.getsockname()[1])}
        checks = run_checks(env)
    assert row(checks, "MASTER_PORT").status == "pass"
    assert row(checks, "MASTER_ADDR").status == "pass"


def test_bad_topology_fails():
    env = {**NO_WORKERS, "NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "127.0.0.1"}
    checks = run_checks(env)
    assert row(checks, "topology").status == "fail"
    assert "NODE_RANK" in row(run_checks({"NODE_RANK": "one"}), "topology").value


def test_unwritable_checkpoint_dir_fails(tmp_path):
    blocker = tmp_path / "x" / "file"
    blocker.parent.mkdir()
    blocker.write_text("not a directory")
    env = {**NO_WORKERS, "TRAIN_CHECKPOINT_DIR": str(blocker / "sub")}
    ckpt = row(run_checks(env), "checkpoint dir")
    assert ckpt.status == "fail" and "TRAIN_CHECKPOINT_DIR" in ckpt.fix


def test_directories_and_workers_come_from_the_training_options(tmp_path):
    """The launcher passes its validated options: a --checkpoint-dir flag is what gets probed."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    training = load_config(["--checkpoint-dir", str(blocker / "sub"), "--num-workers", "64",
                            "--batch-size", "100000"], {}, world_size=1)
    checks = run_checks({}, training)
    assert row(checks, "checkpoint dir").status == "fail" and str(blocker) in row(checks, "checkpoint dir").value
    assert row(checks, "shared memory").status == "fail"


def test_cli_reads_training_flags(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = _cli(tmp_path, args=["--checkpoint-dir", str(blocker / "sub")])
    assert result.returncode == 1 and "checkpoint dir" in result.stdout, result.stdout + result.stderr
    bad = _cli(tmp_path, args=["--lr", "-1"])
    assert bad.returncode == 2 and bad.stderr.startswith("error: --lr: "), bad.stderr


def test_missing_dir_is_probed_not_created(tmp_path):
    target = tmp_path / "new" / "logs"
    checks = run_checks({**NO_WORKERS, "TRAIN_LOG_DIR": str(target)})
    assert row(checks, "log dir").status in ("pass", "warn")
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []  # the probe file was removed too


def test_version_fingerprint_and_comparison():
    fp = version_fingerprint()
    assert set(fp) == {"torch", "cuda", "nccl", "python"}
    assert check_same_versions([fp, dict(fp), dict(fp)]) is None
    other = {**fp, "torch": "0.0.1"}
    msg = check_same_versions([fp, fp, other, other])
    assert msg is not None and "\n" not in msg
    assert "torch" in msg and "ranks 2,3" in msg and "ranks 0,1" in msg and "0.0.1" in msg
    assert "python" not in msg


def test_format_table_has_header_and_aligned_columns():
    checks = [Check("a", "pass", "v1"), Check("longer name", "fail", "v", "do this")]
    lines = format_table(checks).splitlines()
    assert lines[0].split() == ["check", "result", "value", "fix"]
    assert lines[0].index("result") == lines[2].index("PASS") == lines[3].index("FAIL")
    assert lines[3].endswith("do this")


def test_main_json(monkeypatch, capsys):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRAIN_NUM_WORKERS", "0")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "doesnotexist0")
    assert main(["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert {"name", "status", "value", "fix"} <= set(out["checks"][0])


def _cli(tmp_path, args: tuple[str, ...] | list[str] = (), **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith("TRAIN_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
               **NO_WORKERS, **extra)
    return subprocess.run([sys.executable, "-m", "trainer.doctor", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_exit_codes(tmp_path):
    ok = _cli(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    header = ok.stdout.splitlines()[0]
    assert header.split() == ["check", "result", "value", "fix"]
    bad = _cli(tmp_path, NCCL_SOCKET_IFNAME="doesnotexist0")
    assert bad.returncode == 1
    assert "FAIL" in bad.stdout and "doesnotexist0" in bad.stdout
