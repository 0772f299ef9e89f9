"""`python -m bench --stacks trainer container`: the same run bare-metal and in the CPU container,
interleaved, with the container/bare-metal ratio (issue 5's container parity). The speed itself is
not asserted here; docs/benchmarks.md holds the measured numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from containerlib import ROOT, clean_env


def test_bench_runs_the_trainer_bare_metal_and_in_the_container_and_reports_parity(cpu_image, tmp_path):
    env = clean_env(**cpu_image, PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "bench", "--stacks", "trainer", "container", "--nproc", "2", "--rounds", "3",
               "--steps", "8", "--model", "cnn", "--batch-size", "16", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads(next(tmp_path.glob("bench-*.json")).read_text())
    order = [(r["round"], r["stack"]) for r in result["runs"]]
    assert order == [(n, stack) for n in (1, 2, 3) for stack in ("trainer", "container")]  # interleaved
    assert all(r["samples_per_second"] > 0 for r in result["runs"])
    medians = {stack: result["stacks"]["2"][stack]["median"] for stack in ("trainer", "container")}
    parity = result["ratios"]["2"]["container/trainer"]
    assert parity == pytest.approx(medians["container"] / medians["trainer"])
    assert f"container/trainer = {parity:.3f}" in next(tmp_path.glob("bench-*.md")).read_text()
