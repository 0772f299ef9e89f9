"""The package in rooms: one import direction between them, no circle inside one, and the launcher's side
torch-free (the launcher and the preflight must answer in milliseconds, and a host without GPUs never
pays for torch's import)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import REPO, clean_env

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_the_rooms_import_in_one_direction_and_have_no_circles():
    """pyproject.toml's import-linter contracts: the layers (core -> config -> cluster -> dist ->
    data | checkpoint | observe -> engine -> api | cli) and no circle among the modules of any room."""
    result = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=REPO, env=clean_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout, result.stdout


def test_every_room_is_in_the_contract_and_none_is_named_like_build_output():
    """A room the layers do not list escapes the contract; one named dist/, build/ or out/ escapes linters and
    .gitignore templates too (ruff's defaults exclude `dist` and `build`)."""
    import tomllib

    contract = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    listed = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    rooms = {f"trainer.{p.name}" for p in (REPO / "trainer").iterdir() if (p / "__init__.py").is_file()}
    assert rooms <= listed, sorted(rooms - listed)
    assert "trainer.parallel" in rooms
    assert not {room.split(".")[1] for room in rooms} & {"dist", "build", "out", "target", "_build"}


def test_a_back_edge_breaks_the_contract(tmp_path):
    """The contract can fail: the same package with one upward import (config importing the engine) is refused."""
    copy = tmp_path / "trainer"
    subprocess.run(["cp", "-r", str(REPO / "trainer"), str(copy)], check=True)
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    settings = copy / "config" / "settings.py"
    settings.write_text(settings.read_text() + "\n\ndef _upward():\n    from trainer.engine import loop  # noqa\n")
    result = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, env=clean_env({"PYTHONPATH": str(tmp_path)}),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "trainer.config.settings -> trainer.engine.loop" in result.stdout, result.stdout


def _imports_torch(code: str, cwd: Path) -> bool:
    probe = code + "\nimport sys\nprint('TORCH' if 'torch' in sys.modules else 'NO TORCH')\n"
    result = subprocess.run([sys.executable, "-c", probe], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1] == "TORCH"


def test_the_launcher_the_topology_and_the_preflight_import_no_torch(tmp_path):
    """Importing them, resolving the topology, `trainer-launch --dry-run` and the preflight's checks of the
    default run on this GPU-less host: none imports torch."""
    assert not _imports_torch("import trainer.cluster.launch, trainer.cluster.topology, trainer.cli.doctor, "
                              "trainer.cli.launch, "
                              "trainer.cluster.agent, trainer.parallel.bootstrap, trainer.config.settings", tmp_path)
    assert not _imports_torch("import os\nfrom trainer.cluster.topology import LAUNCHER, resolve\n"
                              "resolve(os.environ, LAUNCHER, lambda: 0)", tmp_path)
    assert not _imports_torch("import contextlib, io\nfrom trainer.cli import launch\n"
                              "with contextlib.redirect_stdout(io.StringIO()):\n"
                              "    assert launch.main(['--dry-run', '--epochs', '1']) == 0", tmp_path)
    assert not _imports_torch("import os\nfrom trainer.cli.doctor import run_checks\n"
                              "assert run_checks(os.environ)", tmp_path)
    # The probe can tell: the worker's side does import torch.
    assert _imports_torch("import trainer.parallel.context\nimport torch", tmp_path)


def test_the_public_names_stay_where_users_import_them():
    """trainer.api's names, trainer.DataSpec and `python -m trainer`: the doors users know."""
    from trainer import DataSpec, api  # noqa: F401

    for name in ("Run", "ResumableSampler", "epoch_shard", "dataloader_worker_init", "UsageError"):
        assert hasattr(api, name), name
    result = subprocess.run([sys.executable, "-m", "trainer", "--help"], env=clean_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "--strategy" in result.stdout, result.stderr
