"""Checkpoints are data: one whose pickle would run code is refused, and the code never runs.

The payload below calls os.system to create a marker file when unpickled. The first test proves the
payload is live (a plain torch.load runs it); the others prove the trainer never gives it the chance.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fault_helpers import tiny_run
from helpers import REPO, clean_env, read_summary


class RunsCode:
    """Unpickling this calls os.system(command)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def write_malicious_checkpoint(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": 1, "model": RunsCode(f"touch {marker}"), "global_step": 99}, path)


@pytest.fixture
def payload(tmp_path) -> tuple[Path, Path]:
    checkpoint, marker = tmp_path / "evil.pt", tmp_path / "pwned"
    write_malicious_checkpoint(checkpoint, marker)
    return checkpoint, marker


def test_the_payload_runs_code_when_loaded_without_weights_only(payload):
    checkpoint, marker = payload
    subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(checkpoint)!r}, weights_only=False)"],
                   env=clean_env(), check=True, capture_output=True, timeout=120)
    assert marker.exists(), "the test payload must be live, or the refusals below prove nothing"


def test_explicit_resume_refuses_the_payload_in_one_line(tmp_path, payload):
    checkpoint, marker = payload
    result = subprocess.run([sys.executable, "-m", "trainer", *tiny_run(tmp_path, samples=64), "--resume",
                             str(checkpoint)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --resume: '{checkpoint}' is not a loadable checkpoint (UnpicklingError: ")
    assert not marker.exists()
    assert not (tmp_path / "checkpoints").exists()


def test_auto_resume_skips_the_payload_with_a_warning(tmp_path):
    """A checkpoint planted in the checkpoint volume is skipped with a warning at resume, never run: the run
    resumes from the newest real one. Planted alone, it is never run either, and the run does not quietly
    start over (every checkpoint there is unreadable: the user decides)."""
    marker = tmp_path / "pwned"
    planted = tmp_path / "checkpoints" / "step-00000099.pt"
    write_malicious_checkpoint(planted, marker)
    alone = subprocess.run([sys.executable, "-m", "trainer", *tiny_run(tmp_path, samples=320), "--max-steps", "3"],
                           cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert alone.returncode == 2 and "1 are set aside as corrupt (step-00000099.pt.corrupt)" in alone.stderr
    assert not marker.exists()

    (tmp_path / "checkpoints" / "step-00000099.pt.corrupt").unlink()
    first = subprocess.run([sys.executable, "-m", "trainer", *tiny_run(tmp_path, samples=320), "--max-steps", "3"],
                           cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    write_malicious_checkpoint(planted, marker)
    result = subprocess.run([sys.executable, "-m", "trainer", *tiny_run(tmp_path, samples=320), "--max-steps", "6"],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not marker.exists()
    assert any("WARNING" in line and str(planted) in line and "does not load" in line
               for line in result.stderr.splitlines()), result.stderr[-3000:]
    summary = read_summary(tmp_path / "runs")
    assert summary["resumed_from_step"] == 3 and summary["global_step"] == 6


def torch_load_calls(source: str) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"]


def test_every_torch_load_in_the_trainer_passes_weights_only_true():
    """Belt and braces for the behavioural tests: a new torch.load call must opt in as well."""
    calls = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for call in torch_load_calls(path.read_text()):
            weights_only = [k.value for k in call.keywords if k.arg == "weights_only"]
            calls.append((f"{path.name}:{call.lineno}", weights_only))
    assert calls, "the trainer loads checkpoints somewhere"
    unsafe = [where for where, flag in calls if not (len(flag) == 1 and isinstance(flag[0], ast.Constant)
                                                     and flag[0].value is True)]
    assert not unsafe, f"torch.load without weights_only=True at {unsafe}"


def test_the_launchers_look_at_a_checkpoint_runs_none_of_its_code(tmp_path, payload):
    """trainer-launch reads what it would resume before torchrun, without torch: its unpickler builds nothing a
    pickle names (os.system included), for an explicit checkpoint and for the newest one under --resume auto."""
    checkpoint, marker = payload
    planted = tmp_path / "checkpoints" / "step-00000099.pt"
    write_malicious_checkpoint(planted, marker)
    for resume in (str(checkpoint), "auto"):
        result = subprocess.run([sys.executable, "-m", "trainer.cli.launch", "--dry-run", "--model", "cnn",
                                 "--resume", resume, "--checkpoint-dir", str(tmp_path / "checkpoints")], cwd=tmp_path,
                                env=clean_env({"NPROC_PER_NODE": "2"}), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        assert not marker.exists()
    from trainer.config.resume import peek

    state = peek(checkpoint)
    assert state is not None and state["format"] == 1 and state["global_step"] == 99 and not marker.exists()
