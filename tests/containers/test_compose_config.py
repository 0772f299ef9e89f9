"""`docker compose config` of every compose file and profile: what a fresh clone (no .env) gets.

These need only the Compose v2 CLI, not a running engine.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from containerlib import COMPOSE_FILE, EMPTY_ENV_FILE, MULTINODE_FILE, ROOT, clean_env

FILES = {"compose.yaml": COMPOSE_FILE, "compose.multinode.yaml": MULTINODE_FILE}
PROFILE_SERVICES = {"gpu": {"trainer", "tensorboard"}, "cpu": {"trainer-cpu", "summary-cpu"},
                    "tensorboard": {"tensorboard-cpu"}}
TRAINERS = {"gpu": "trainer", "cpu": "trainer-cpu"}
TENSORBOARDS = {"gpu": ("gpu", "tensorboard"), "cpu": ("tensorboard", "tensorboard-cpu")}  # profile, service
ENV_EXAMPLE = ROOT / ".env.example"


def compose_config(compose_cli, file, *args: str, env_file=EMPTY_ENV_FILE, **env: str):
    """(parsed config, stderr) of `docker compose -f FILE ARGS config --format json`."""
    out = subprocess.run([*compose_cli, "-f", str(file), "--env-file", str(env_file), *args,
                          "config", "--format", "json"],
                         cwd=ROOT, env=clean_env(**{"ENV_FILE": str(env_file), **env}), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"compose config failed:\n{out.stderr}"
    return json.loads(out.stdout), out.stderr


def seconds(duration) -> float:
    if isinstance(duration, (int, float)):
        return duration / 1e9 if duration > 10_000 else float(duration)  # nanoseconds in JSON
    total, units = 0.0, {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    for number, unit in re.findall(r"([\d.]+)(ms|h|m|s)", duration):
        total += float(number) * units[unit]
    return total


@pytest.mark.parametrize("profile", list(PROFILE_SERVICES))
@pytest.mark.parametrize("name", list(FILES))
def test_every_file_and_profile_renders_without_unset_variables(compose_cli, name, profile):
    config, stderr = compose_config(compose_cli, FILES[name], "--profile", profile)
    assert "variable is not set" not in stderr, stderr
    assert "warn" not in stderr.lower(), stderr
    assert set(config["services"]) == PROFILE_SERVICES[profile]
    for service_name, service in config["services"].items():
        assert service["network_mode"] == "host", service_name


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
@pytest.mark.parametrize("name", list(FILES))
def test_trainer_has_shm_ulimits_volumes_and_a_checkpoint_grace_period(compose_cli, name, profile):
    config, _ = compose_config(compose_cli, FILES[name], "--profile", profile)
    trainer = config["services"][TRAINERS[profile]]
    assert trainer["ipc"] == "host"
    assert int(trainer["shm_size"]) >= 1 << 30
    if profile == "gpu":  # NVIDIA's recommendation for NCCL
        assert trainer["ulimits"]["memlock"] in (-1, {"soft": -1, "hard": -1})
    else:  # gloo locks no memory, and engines that may not raise the limit would refuse the container
        assert "memlock" not in trainer["ulimits"]
    assert trainer["ulimits"]["stack"] in (67108864, {"soft": 67108864, "hard": 67108864})
    mounts = {v["target"]: v for v in trainer["volumes"]}
    assert mounts["/data"].get("read_only") is True
    # The user's code: ./src of the clone, read-only, where the image's PYTHONPATH points.
    assert mounts["/workspace/src"].get("read_only") is True
    assert mounts["/workspace/src"]["type"] == "bind" and mounts["/workspace/src"]["source"] == str(ROOT / "src")
    assert not mounts["/checkpoints"].get("read_only") and not mounts["/runs"].get("read_only")
    assert seconds(trainer["stop_grace_period"]) >= 30
    # One grace period: the launcher's STOP_GRACE_PERIOD and compose's own, from the same variable.
    assert seconds(trainer["environment"]["STOP_GRACE_PERIOD"]) == seconds(trainer["stop_grace_period"])
    assert trainer["environment"]["COMPOSE_STOP_GRACE_PERIOD"] == trainer["environment"]["STOP_GRACE_PERIOD"]
    policy, _, retries = trainer["restart"].partition(":")
    assert policy == "on-failure" and 0 < int(retries) <= 5, "bounded restarts, never on-failure:0 (= forever)"
    environment = trainer["environment"]
    assert (environment["TRAIN_DATA_DIR"], environment["TRAIN_CHECKPOINT_DIR"], environment["TRAIN_LOG_DIR"]) == (
        "/data", "/checkpoints", "/runs")
    # Empty: on one host the launcher takes a free port (host networking shares the host's ports); several
    # hosts default to 29500, the same on every host.
    assert environment["MASTER_PORT"] == ""
    # Pass-through variables are absent (not empty) when unset.
    assert environment.get("NCCL_SOCKET_IFNAME") is None and environment.get("GLOO_SOCKET_IFNAME") is None


@pytest.mark.parametrize("name", list(FILES))
def test_gpu_trainer_reserves_nvidia_gpus_from_env(compose_cli, name):
    config, _ = compose_config(compose_cli, FILES[name], "--profile", "gpu")
    (device,) = config["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert device["count"] == -1  # "all"
    config, _ = compose_config(compose_cli, FILES[name], "--profile", "gpu", GPU_COUNT="2")
    (device,) = config["services"]["trainer"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == 2


@pytest.mark.parametrize("name", list(FILES))
def test_cpu_profile_is_gloo_on_two_processes_without_gpu_reservation(compose_cli, name):
    config, _ = compose_config(compose_cli, FILES[name], "--profile", "cpu")
    trainer = config["services"]["trainer-cpu"]
    assert "deploy" not in trainer
    env = trainer["environment"]
    assert (env["TRAIN_BACKEND"], env["NPROC_PER_NODE"], env["TRAIN_DATASET"]) == ("gloo", "2", "synthetic")
    assert trainer["build"]["network"] == "host"


@pytest.mark.parametrize("stack", ["gpu", "cpu"])
@pytest.mark.parametrize("name", list(FILES))
def test_tensorboard_binds_loopback_unless_opted_in(compose_cli, name, stack):
    profile, service = TENSORBOARDS[stack]
    config, _ = compose_config(compose_cli, FILES[name], "--profile", profile)
    tensorboard = config["services"][service]
    assert "tensorboard --logdir /runs" in " ".join(tensorboard["entrypoint"])
    assert tensorboard["environment"]["TENSORBOARD_HOST"] == "127.0.0.1"
    assert tensorboard["environment"]["TENSORBOARD_PORT"] == "6006"
    assert tensorboard["volumes"][0]["target"] == "/runs" and tensorboard["volumes"][0]["read_only"] is True
    config, _ = compose_config(compose_cli, FILES[name], "--profile", profile, TENSORBOARD_HOST="0.0.0.0")
    assert config["services"][service]["environment"]["TENSORBOARD_HOST"] == "0.0.0.0"


def test_plain_up_is_the_gpu_stack_and_cpu_profile_never_selects_it(compose_cli):
    # The README's two commands: `docker compose up` (GPU) and `docker compose --profile cpu up`.
    config, _ = compose_config(compose_cli, COMPOSE_FILE)
    assert set(config["services"]) == PROFILE_SERVICES["gpu"]
    config, _ = compose_config(compose_cli, COMPOSE_FILE, "--profile", "cpu")
    assert set(config["services"]) == PROFILE_SERVICES["cpu"]
    # The same with .env.example copied to .env, and with COMPOSE_PROFILES=gpu set there.
    for env_file, extra in ((ENV_EXAMPLE, {}), (EMPTY_ENV_FILE, {"COMPOSE_PROFILES": "gpu"})):
        config, _ = compose_config(compose_cli, COMPOSE_FILE, env_file=env_file, **extra)
        assert set(config["services"]) == PROFILE_SERVICES["gpu"]
        config, _ = compose_config(compose_cli, COMPOSE_FILE, "--profile", "cpu", env_file=env_file, **extra)
        assert set(config["services"]) == PROFILE_SERVICES["cpu"]


@pytest.mark.parametrize("name", list(FILES))
def test_cpu_up_ends_with_the_trainer_status(compose_cli, name):
    # `up` returns when every started container has exited for good: no server in the cpu profile
    # (TensorBoard is opt-in), and summary-cpu's dependency makes a failed trainer fail `up`.
    config, _ = compose_config(compose_cli, FILES[name], "--profile", "cpu")
    summary = config["services"]["summary-cpu"]
    assert summary["depends_on"]["trainer-cpu"]["condition"] == "service_completed_successfully"
    assert summary["restart"] == "no" and summary["volumes"][0]["target"] == "/runs"
    assert all("tensorboard" not in service for service in config["services"])


@pytest.mark.parametrize("name", list(FILES))
def test_src_dir_and_user_code_settings_pass_through(compose_cli, name, tmp_path):
    settings = {"TRAIN_MODEL": "mymodels:build", "TRAIN_DATASET": "mydata:build",
                "TRAIN_SCRIPT": "/workspace/src/train.py", "TRAIN_IMAGE_SIZE": "64", "TRAIN_AUGMENT": "light"}
    for profile in ("gpu", "cpu"):
        config, _ = compose_config(compose_cli, FILES[name], "--profile", profile, SRC_DIR=str(tmp_path), **settings)
        trainer = config["services"][TRAINERS[profile]]
        mount = next(v for v in trainer["volumes"] if v["target"] == "/workspace/src")
        assert mount["source"] == str(tmp_path) and mount["read_only"] is True
        assert {k: trainer["environment"][k] for k in settings} == settings
    config, _ = compose_config(compose_cli, FILES[name], "--profile", "cpu")
    assert config["services"]["trainer-cpu"]["environment"].get("TRAIN_SCRIPT") is None  # unset: the built-in trainer


def test_multinode_defaults_and_passthrough(compose_cli):
    config, _ = compose_config(compose_cli, MULTINODE_FILE, "--profile", "gpu")
    env = config["services"]["trainer"]["environment"]
    assert env["NNODES"] == "2" and env["NODE_RANK"] == "" and env["MASTER_ADDR"] == ""
    config, _ = compose_config(compose_cli, MULTINODE_FILE, "--profile", "gpu", NODE_RANK="3", NNODES="4",
                               MASTER_ADDR="10.0.0.1", NCCL_SOCKET_IFNAME="eth1", GLOO_SOCKET_IFNAME="eth1",
                               NCCL_DEBUG="INFO", NCCL_IB_DISABLE="1")
    env = config["services"]["trainer"]["environment"]
    assert (env["NNODES"], env["NODE_RANK"], env["MASTER_ADDR"]) == ("4", "3", "10.0.0.1")
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"], env["NCCL_DEBUG"], env["NCCL_IB_DISABLE"]) == (
        "eth1", "eth1", "INFO", "1")
    assert config["services"]["tensorboard"]["environment"]["NODE_RANK"] == "3"  # it exits on NODE_RANK != 0


def _compose_variables() -> set[str]:
    names = set()
    for path in FILES.values():
        text = path.read_text()
        names |= set(re.findall(r"(?<!\$)\$\{([A-Z][A-Z0-9_]*)", text))
        names |= set(re.findall(r"^\s+([A-Z][A-Z0-9_]+):", text, re.M))  # environment keys
        names |= set(re.findall(r"^\s+- ([A-Z][A-Z0-9_]+)\s*(?:#.*)?$", text, re.M))  # build args
    return names - {"TORCH_SOURCE"}


FIXED_IN_COMPOSE = {"TRAIN_DATA_DIR", "TRAIN_CHECKPOINT_DIR", "TRAIN_LOG_DIR"}  # container paths, not knobs
# Set from another variable, not a knob: the launcher's copy of compose's stop_grace_period (STOP_GRACE_PERIOD).
DERIVED_IN_COMPOSE = {"COMPOSE_STOP_GRACE_PERIOD", "COMPOSE_DATA_MOUNT"}  # and DATA_DIR's, for the data errors


def _env_example_keys() -> set[str]:
    return set(re.findall(r"^#?([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), re.M))


def test_env_example_lists_every_variable_of_the_compose_files():
    missing = _compose_variables() - FIXED_IN_COMPOSE - DERIVED_IN_COMPOSE - _env_example_keys()
    assert not missing, f".env.example lacks {sorted(missing)}"


def test_every_training_option_is_passed_and_documented():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # not installed: the working tree's package
    from trainer.config.settings import OPTIONS, env_name

    options = {env_name(f.name) for f in OPTIONS}
    assert not options - _compose_variables(), "compose.yaml does not pass " + str(sorted(options - _compose_variables()))
    undocumented = options - FIXED_IN_COMPOSE - _env_example_keys()
    assert not undocumented, f".env.example lacks {sorted(undocumented)}"


def test_env_example_renders_cleanly_with_every_line_enabled(compose_cli, tmp_path):
    enabled = tmp_path / "all.env"
    enabled.write_text(re.sub(r"^#([A-Z])", r"\1", ENV_EXAMPLE.read_text(), flags=re.M))
    for profile in PROFILE_SERVICES:
        config, stderr = compose_config(compose_cli, COMPOSE_FILE, "--profile", profile, env_file=enabled)
        assert "warn" not in stderr.lower(), stderr
        assert set(config["services"]) == PROFILE_SERVICES[profile]
    gpu, _ = compose_config(compose_cli, COMPOSE_FILE, "--profile", "gpu", env_file=enabled)
    assert gpu["services"]["trainer"]["environment"]["TRAIN_MODEL"] == "resnet18"
