"""`python -m bench --stacks trainer baseline`: the trainer with two sets of options side by side,
interleaved, with their ratio. The speed itself is not asserted; docs/benchmarks.md holds numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.slow
def test_bench_runs_the_trainer_against_a_baseline_of_other_options(tmp_path):
    command = [sys.executable, "-m", "bench", "--stacks", "trainer", "baseline", "--nproc", "1", "--rounds", "3",
               "--steps", "8", "--model", "cnn", "--batch-size", "16", "--image-size", "40",
               "--trainer-args", "--loader memory", "--baseline-args", "--loader dataloader --num-workers 0",
               "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    assert [(r["round"], r["stack"]) for r in result["runs"]] == [
        (n, stack) for n in (1, 2, 3) for stack in ("trainer", "baseline")]
    assert all(r["samples_per_second"] > 0 for r in result["runs"])
    assert result["settings"]["baseline_args"] == "--loader dataloader --num-workers 0"
    medians = {stack: result["stacks"]["1"][stack]["median"] for stack in ("trainer", "baseline")}
    ratio = result["ratios"]["1"]["trainer/baseline"]
    assert ratio == pytest.approx(medians["trainer"] / medians["baseline"])
    assert f"trainer/baseline = {ratio:.3f}" in next(tmp_path.glob("bench-*.md")).read_text()


def test_bench_rejects_a_baseline_option_the_trainer_does_not_know(tmp_path):
    command = [sys.executable, "-m", "bench", "--stacks", "trainer", "baseline", "--nproc", "1", "--rounds", "3",
               "--steps", "8", "--model", "cnn", "--baseline-args=--no-such-option", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "baseline failed" in done.stderr and "--no-such-option" in done.stderr
