"""`python -m bench --stacks trainer container`: the same run bare-metal and in the CPU container,
interleaved, with the container/bare-metal ratio (issue 5's container parity). The speed itself is
not asserted here; docs/benchmarks.md holds the measured numbers."""

from __future__ import annotations

from containerlib import ROOT, clean_env
from helpers import run_bench_pair


def test_bench_runs_the_trainer_bare_metal_and_in_the_container_and_reports_parity(cpu_image, tmp_path):
    run_bench_pair(tmp_path, ("trainer", "container"), 2, "container/trainer",
                   ["--steps", "8", "--model", "cnn", "--batch-size", "16"],
                   env=clean_env(**cpu_image, PYTHONPATH=str(ROOT)), timeout=900)
