"""`python -m bench --stacks trainer baseline`: the trainer with two sets of options side by side,
interleaved, with their ratio. The speed itself is not asserted; docs/benchmarks.md holds numbers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, run_bench_pair


@pytest.mark.slow
def test_bench_runs_the_trainer_against_a_baseline_of_other_options(tmp_path):
    result = run_bench_pair(tmp_path, ("trainer", "baseline"), 1, "trainer/baseline",
                            ["--steps", "8", "--model", "cnn", "--batch-size", "16", "--image-size", "40",
                             "--trainer-args", "--loader memory",
                             "--baseline-args", "--loader dataloader --num-workers 0"])
    assert result["settings"]["baseline_args"] == "--loader dataloader --num-workers 0"


def test_bench_rejects_a_baseline_option_the_trainer_does_not_know(tmp_path):
    command = [sys.executable, "-m", "bench", "--stacks", "trainer", "baseline", "--nproc", "1", "--rounds", "3",
               "--steps", "8", "--model", "cnn", "--baseline-args=--no-such-option", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "baseline failed" in done.stderr and "--no-such-option" in done.stderr
