"""`python -m bench --stacks trainer container`: the same run bare-metal and in the CPU container,
interleaved, with the container/bare-metal ratio (issue 5's container parity). The speed itself is
not asserted here; docs/benchmarks.md holds the measured numbers."""

from __future__ import annotations

import json
from pathlib import Path

from containerlib import ROOT, clean_env
from helpers import run_bench_pair

CONTAINER_DIR = "/bench"  # bench/run.py's: where the container sees each run's folder


def test_bench_runs_the_trainer_bare_metal_and_in_the_container_and_reports_parity(cpu_image, tmp_path):
    result = run_bench_pair(tmp_path, ("trainer", "container"), 2, "container/trainer",
                            ["--steps", "8", "--model", "cnn", "--batch-size", "16"],
                            env=clean_env(**cpu_image, PYTHONPATH=str(ROOT)), timeout=900)
    # The container runs' trainer wrote its files under /bench, and they came out in the host's run folder,
    # where the host has no /bench: only the container's mount put them there. The bare-metal runs wrote
    # theirs where they are.
    assert not Path(CONTAINER_DIR).exists()
    for run in result["runs"]:
        params = json.loads((Path(run["record"]) / "params.json").read_text())
        inside = params["config"]["log_dir"].startswith(f"{CONTAINER_DIR}/")
        assert inside == (run["stack"] == "container"), (run["stack"], params["config"]["log_dir"])
