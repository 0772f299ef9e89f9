"""trainer-doctor runs its real checks against this machine; only the env mapping is synthetic."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port, skip_or_fail_in_ci, write_cifar10, write_image_folder, write_mnist

from trainer.cli.doctor import (
    PREFETCH_FACTOR,
    Check,
    container_runtime,
    data_shape,
    dataloader_workers,
    format_table,
    limit_fixes,
    main,
    parameter_count,
    run_checks,
)
from trainer.cluster.versions import check_same_versions, version_fingerprint
from trainer.config.catalog import MODELS
from trainer.config.settings import load_config

REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT",
               "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
DOCKER_DEFAULT_SHM = "64m"


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    # Default ./checkpoints and ./runs resolve here instead of in the repository.
    monkeypatch.chdir(tmp_path)


def row(checks: list[Check], name: str) -> Check:
    (found,) = [c for c in checks if c.name == name]
    return found


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == "fail"]


def test_defaults_pass():
    """Wherever the tests run: the default synthetic data starts no DataLoader worker, so even Docker's
    64 MiB /dev/shm is no failure (at most a warning about the gradient all-reduce)."""
    checks = run_checks({})
    assert failures(checks) == []
    assert all(c.status in ("pass", "warn", "fail") and isinstance(c.value, str) for c in checks)
    assert all(c.fix for c in checks if c.status != "pass")
    assert row(checks, "versions").status == "pass"


def test_huge_prefetch_fails_shm():
    checks = run_checks({"TRAIN_NUM_WORKERS": "64", "TRAIN_BATCH_SIZE": "100000", "TRAIN_SYNTHETIC_SIZE": "200000", "TRAIN_LOADER": "dataloader"})
    shm = row(checks, "shared memory")
    assert shm.status == "fail" and "ipc: host" in shm.fix
    assert "DataLoader 64 workers x 2 procs" in shm.value


def test_workers_count_only_where_they_start():
    """In-memory datasets on the auto (or memory) input path start no DataLoader worker."""
    for loader in ("auto", "memory"):
        env = {"TRAIN_NUM_WORKERS": "64", "TRAIN_BATCH_SIZE": "100000", "TRAIN_SYNTHETIC_SIZE": "200000", "TRAIN_LOADER": loader,
               "TRAIN_SHM_ALLREDUCE": "false"}
        shm = row(run_checks(env), "shared memory")
        assert shm.status != "fail" and "no DataLoader workers" in shm.value, (loader, shm)


def test_missing_nccl_interface_fails():
    checks = run_checks({"NCCL_SOCKET_IFNAME": "doesnotexist0"})
    nccl = row(checks, "NCCL_SOCKET_IFNAME")
    assert nccl.status == "fail"
    assert "doesnotexist0" in nccl.value
    assert "existing interfaces" in nccl.fix


def test_nccl_exclusion_list_is_not_an_existence_check():
    checks = run_checks({"NCCL_SOCKET_IFNAME": "^doesnotexist0,docker"})
    assert row(checks, "NCCL_SOCKET_IFNAME").status == "pass"


@pytest.mark.skipif("lo" not in [n for _, n in socket.if_nameindex()], reason="no lo interface")
def test_loopback_interface_fails_multi_node():
    env = {"NNODES": "2", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    assert row(run_checks(env), "GLOO_SOCKET_IFNAME").status == "fail"
    # On a single node loopback is fine.
    single = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}
    assert failures(run_checks(single)) == []


def test_multi_node_without_interface_warns():
    checks = run_checks({"NNODES": "2", "MASTER_ADDR": "127.0.0.1"})
    assert row(checks, "socket interface").status == "warn"


def test_multi_node_without_master_addr_fails():
    topology = row(run_checks({"NNODES": "2"}), "topology")
    assert topology.status == "fail" and topology.value.startswith("MASTER_ADDR (explicit): ")


def test_unresolvable_master_addr_fails():
    env = {"NNODES": "2", "MASTER_ADDR": "no-such-host.invalid"}
    assert row(run_checks(env), "MASTER_ADDR").status == "fail"


def test_loopback_master_on_node0_warns():
    env = {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    assert row(run_checks(env), "MASTER_ADDR").status == "warn"


def test_unreachable_master_port_warns():
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    port = row(run_checks(env), "MASTER_PORT")
    assert port.status == "warn" and "start node 0 first" in port.fix


def test_listening_master_port_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(server.getsockname()[1])}
        checks = run_checks(env)
    assert row(checks, "MASTER_PORT").status == "pass"
    assert row(checks, "MASTER_ADDR").status == "pass"


def test_bad_topology_fails():
    env = {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "127.0.0.1"}
    checks = run_checks(env)
    assert row(checks, "topology").status == "fail"
    assert "NODE_RANK" in row(run_checks({"NODE_RANK": "one"}), "topology").value


def test_unwritable_checkpoint_dir_fails(tmp_path):
    blocker = tmp_path / "x" / "file"
    blocker.parent.mkdir()
    blocker.write_text("not a directory")
    env = {"TRAIN_CHECKPOINT_DIR": str(blocker / "sub")}
    ckpt = row(run_checks(env), "checkpoint dir")
    assert ckpt.status == "fail" and "TRAIN_CHECKPOINT_DIR" in ckpt.fix


def test_directories_and_workers_come_from_the_training_options(tmp_path):
    """The launcher passes its validated options: a --checkpoint-dir flag is what gets probed."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    training = load_config(["--checkpoint-dir", str(blocker / "sub"), "--num-workers", "64",
                            "--batch-size", "100000", "--synthetic-size", "200000", "--loader", "dataloader"],
                           {}, world_size=1)
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
    checks = run_checks({"TRAIN_LOG_DIR": str(target)})
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
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "doesnotexist0")
    assert main(["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert {"name", "status", "value", "fix"} <= set(out["checks"][0])


def _cli(tmp_path, args: tuple[str, ...] | list[str] = (), module: str = "trainer.cli.doctor",
         prefix: tuple[str, ...] = (), **extra: str) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` (trainer-doctor by default), under a command prefix if given."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith("TRAIN_")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])), **extra)
    return subprocess.run([*prefix, sys.executable, "-m", module, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def json_rows(result: subprocess.CompletedProcess) -> list[Check]:
    return [Check(**c) for c in json.loads(result.stdout)["checks"]]


def test_cli_exit_codes(tmp_path):
    ok = _cli(tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    header = ok.stdout.splitlines()[0]
    assert header.split() == ["check", "result", "value", "fix"]
    bad = _cli(tmp_path, NCCL_SOCKET_IFNAME="doesnotexist0")
    assert bad.returncode == 1
    assert "FAIL" in bad.stdout and "doesnotexist0" in bad.stdout


def test_cli_reports_the_launchers_topology_error(tmp_path):
    """One parser: what trainer-launch refuses, trainer-doctor fails with the same words."""
    doctor = _cli(tmp_path, ["--json"], MASTER_PORT="70000")
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    topology = row(json_rows(doctor), "topology")
    launcher = _cli(tmp_path, module="trainer.cli.launch", MASTER_PORT="70000")
    assert launcher.returncode == 2
    assert topology.status == "fail"
    assert launcher.stderr.strip() == f"error: {topology.value} ({topology.fix})"
    assert topology.value == "MASTER_PORT (explicit): 70000 is out of range"


def test_cli_unknown_option_names_trainer_doctor(tmp_path):
    result = _cli(tmp_path, ["--jsn"])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: arguments: unrecognized arguments: --jsn (see `trainer-doctor --help`)"]
    usage = _cli(tmp_path, ["--help"])
    assert usage.returncode == 0 and "--json" in usage.stdout and "--num-workers" in usage.stdout


# A mount namespace with its own /dev/shm of Docker's default size: what `docker run` gives.
SMALL_SHM = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
             f'mount -t tmpfs -o size={DOCKER_DEFAULT_SHM} tmpfs /dev/shm && exec "$@"', "sh")


@pytest.fixture(scope="module")
def small_shm() -> tuple[str, ...]:
    try:
        probe = subprocess.run([*SMALL_SHM, "true"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        skip_or_fail_in_ci("no unshare command (util-linux)")
    if probe.returncode != 0:
        skip_or_fail_in_ci(f"cannot mount a private /dev/shm (needs root): {probe.stderr.strip()}")
    return SMALL_SHM


SHM_CASES = {  # the doctor's verdict in Docker's default 64 MiB /dev/shm (2 CPU processes, 2 workers each)
    "synthetic: no workers start": (["--model", "cnn"], "pass", "all-reduce"),
    "all-reduce larger than /dev/shm: gloo's TCP instead": (["--model", "resnet18"], "warn", "all-reduce"),
    "all-reduce off": (["--model", "resnet18", "--shm-allreduce", "false"], "pass", "no DataLoader workers"),
    "ImageNet-sized DataLoader batches": (["--model", "cnn", "--loader", "dataloader",
                                           "--synthetic-image-size", "224"], "fail", "DataLoader 2 workers"),
}


@pytest.mark.parametrize("args, status, shown", SHM_CASES.values(), ids=SHM_CASES.keys())
def test_shm_verdict_in_dockers_default_shm(tmp_path, small_shm, args, status, shown):
    result = _cli(tmp_path, ["--json", *args], prefix=small_shm)
    assert result.returncode == (1 if status == "fail" else 0), result.stdout + result.stderr
    shm = row(json_rows(result), "shared memory")
    assert shm.status == status and shown in shm.value and "/dev/shm 64 MiB" in shm.value, shm


def write_pack(root):
    from trainer.data.pack import pack

    write_image_folder(root.with_name("folder"))
    pack(root.with_name("folder"), root, max_side=64, workers=1, progress=False)


DATASET_FILES = {"synthetic": None, "cifar10": write_cifar10, "mnist": write_mnist,
                 "imagefolder": write_image_folder, "packed": write_pack}


@pytest.mark.parametrize("dataset", DATASET_FILES)
def test_shm_facts_are_those_of_the_data_and_models_the_trainer_builds(tmp_path, dataset):
    """The doctor reads image shapes, workers and gradient sizes off the options (without torch):
    they must be what trainer/data/datasets.py and trainer/engine/models.py build."""
    import torch

    from trainer.cluster.topology import WORKER, resolve
    from trainer.data.datasets import Batches, InMemoryImages, build_datasets
    from trainer.parallel.context import DistContext
    from trainer.engine.models import build_model

    if DATASET_FILES[dataset]:
        DATASET_FILES[dataset](tmp_path / "data")
    ctx = DistContext(resolve({}, WORKER), "none", torch.device("cpu"))
    options = ["--dataset", dataset, "--data-dir", str(tmp_path / "data"), "--synthetic-size", "8",
               "--synthetic-image-size", "40", "--batch-size", "2", "--num-workers", "1"]
    training = load_config(options, {}, world_size=1)
    train, _, spec = build_datasets(training, ctx)
    channels, side, classes = data_shape(training)
    in_memory = isinstance(train, InMemoryImages)
    image = train.images[0] if in_memory else train[(0, 0)][0]
    assert (image.dtype, tuple(image.shape), spec.num_classes) == (torch.uint8, (channels, side, side), classes)

    for loader in ["auto", "dataloader"] + ["memory"] * in_memory:  # memory for files on disk: an error
        cfg = load_config([*options, "--loader", loader], {}, world_size=1)
        batches = Batches(train, spec, cfg, ctx, train=True)
        started = 0 if batches.memory is not None else batches.loader.num_workers
        assert dataloader_workers(cfg) == started, loader
        assert batches.memory is not None or batches.loader.prefetch_factor == PREFETCH_FACTOR

    for model in MODELS:
        with torch.device("meta"):
            built = build_model(model, spec)
        gradient_bytes = sum(p.numel() * p.element_size() for p in built.parameters() if p.requires_grad)
        assert 4 * parameter_count(model, channels, side, classes) == gradient_bytes, model


def test_a_limited_memlock_passes_without_gpus(tmp_path):
    # gloo (and NCCL without InfiniBand/RoCE) locks no memory: the cpu profile sets no memlock limit and
    # rootless engines cannot raise it, so a finite limit (here 1 MiB) is no warning on a CPU host.
    import resource

    def lower_memlock():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))

    out = subprocess.run([sys.executable, "-m", "trainer.cli.doctor", "--json", "--checkpoint-dir", str(tmp_path / "c"),
                          "--log-dir", str(tmp_path / "r"), "--env-file", os.devnull],
                         capture_output=True, text=True, cwd=tmp_path, preexec_fn=lower_memlock, timeout=120,
                         env={k: v for k, v in os.environ.items() if k not in LAUNCH_VARS})
    (memlock,) = [c for c in json.loads(out.stdout)["checks"] if c["name"] == "ulimit memlock"]
    assert memlock["status"] == "pass" and memlock["value"].startswith("1.0 MiB (enough: gloo"), memlock


def test_the_stack_fix_is_in_the_syntax_of_where_it_runs(tmp_path):
    # A bare-metal user raises a limit with the shell's `ulimit -s`; inside Docker or Podman only the engine's
    # --ulimit can. The process below runs with an 8 MiB stack, and gets the fix for where this test runs.
    import resource

    def lower_stack():
        resource.setrlimit(resource.RLIMIT_STACK, (8 << 20, resource.getrlimit(resource.RLIMIT_STACK)[1]))

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    out = subprocess.run([sys.executable, "-m", "trainer.cli.doctor", "--json", "--checkpoint-dir", str(tmp_path / "c"),
                          "--log-dir", str(tmp_path / "r"), "--env-file", os.devnull],
                         capture_output=True, text=True, cwd=tmp_path, preexec_fn=lower_stack, timeout=120, env=env)
    (stack,) = [c for c in json.loads(out.stdout)["checks"] if c["name"] == "ulimit stack"]
    # No GPU here: 8 MiB trains on the CPU, a pass that says so (a bare WARN was read as a failure's cause).
    assert stack["status"] == "pass" and stack["value"] == "8.0 MiB (enough on the CPU; NVIDIA's containers run " \
        "CUDA with 64 MiB)", stack
    # With a GPU it is a warning, with the fix for where this test runs.
    probe = ("import json, os; from dataclasses import asdict; from trainer.cli.doctor import check_ulimits; "
             "print(json.dumps([asdict(c) for c in check_ulimits(1, os.environ) if c.name == 'ulimit stack']))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         preexec_fn=lower_stack, timeout=120, env=env)
    (stack,) = json.loads(out.stdout)
    here = container_runtime(env)
    assert stack["status"] == "warn" and stack["value"] == "8.0 MiB (below the 64 MiB NVIDIA's containers run CUDA " \
        "with)" and stack["fix"] == limit_fixes(here)[1], stack

    # Where each kind of place is recognised, on a root of its own: the marker files the engines write.
    (tmp_path / "docker").mkdir()
    (tmp_path / "docker" / ".dockerenv").touch()
    (tmp_path / "podman" / "run").mkdir(parents=True)
    (tmp_path / "podman" / "run" / ".containerenv").touch()
    (tmp_path / "host").mkdir()
    assert container_runtime({}, str(tmp_path / "docker")) == "docker"
    assert container_runtime({}, str(tmp_path / "podman")) == "podman"
    assert container_runtime({}, str(tmp_path / "host")) is None
    assert container_runtime({"APPTAINER_CONTAINER": "/x.sif"}, str(tmp_path / "host")) == "apptainer"
    assert container_runtime({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, str(tmp_path / "docker")) == "kubernetes"
    assert limit_fixes(None)[1].startswith("ulimit -s 65536 in the shell") and "--ulimit" not in limit_fixes(None)[1]
    assert "ulimit -l unlimited" in limit_fixes(None)[0]
    assert limit_fixes("docker")[1] == "compose: ulimits: stack: 67108864 / docker run --ulimit stack=67108864"
    assert limit_fixes("podman")[1].endswith("podman run --ulimit stack=67108864")
    assert limit_fixes("apptainer")[1].startswith("ulimit -s 65536 before apptainer exec")


def test_doctor_data_lists_every_file_that_does_not_decode_and_every_class_folder_without_an_image(tmp_path):
    """`trainer-doctor --data DIR` decodes every image file as training would (in every core) and lists what
    training would skip or refuse, ahead of the run; a clean folder passes."""
    write_image_folder(tmp_path / "data", per_class={"train": 5, "val": 2})
    truncated = tmp_path / "data" / "train" / "cat" / "3.png"
    truncated.write_bytes(truncated.read_bytes()[:len(truncated.read_bytes()) // 2])
    not_an_image = tmp_path / "data" / "val" / "dog" / "notes.jpg"
    not_an_image.write_text("not an image\n")
    (tmp_path / "data" / "train" / "emu").mkdir()
    (tmp_path / "data" / "train" / "emu" / "README").write_text("the emus are late\n")
    found = _cli(tmp_path, ["--data", "data", "--json"], module="trainer.cli.doctor")
    assert found.returncode == 1, found.stdout + found.stderr
    report = json.loads(found.stdout)
    assert report["files"] == 15 and report["where"] == ["data/train", "data/val"]
    assert {bad["path"]: bad["reason"] for bad in report["bad"]} == {
        "data/train/cat/3.png": "image file is truncated", "data/val/dog/notes.jpg": "not an image PIL can decode"}
    assert report["empty_class_folders"] == ["data/train/emu"]
    shown = _cli(tmp_path, ["--data", "data"], module="trainer.cli.doctor")
    assert "  does not decode: data/train/cat/3.png (image file is truncated)" in shown.stdout.splitlines()
    for path in (truncated, not_an_image, tmp_path / "data" / "train" / "emu" / "README"):
        path.unlink()
    (tmp_path / "data" / "train" / "emu").rmdir()
    clean = _cli(tmp_path, ["--data", "data"], module="trainer.cli.doctor")
    assert clean.returncode == 0 and clean.stdout.startswith("checked 13 image files in data/train, data/val ("), \
        clean.stdout + clean.stderr
