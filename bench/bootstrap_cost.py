"""`python -m bench.bootstrap_cost`: what the launcher's bootstrap adds to a worker's start, in milliseconds.

Every worker trainer-launch starts begins in trainer.parallel.bootstrap (the parent-death signal, the sentinel
fork, faulthandler, the progress stream, the join watch, its record) before the program's first line. This
starts the same tiny program (no torch import: only the difference is measured) both ways, interleaved, with a
records folder as the supervisor gives one, and reports the median of each and of their paired differences.

    python -m bench.bootstrap_cost --runs 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROGRAM = "print('ready')\n"


def start(command: list[str], env: dict[str, str]) -> float:
    began = time.perf_counter()
    # A session of its own, as torchrun starts a worker: the bootstrap's sentinel needs a group to guard.
    subprocess.run(command, env=env, stdout=subprocess.DEVNULL, start_new_session=True, check=True)
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30, help="starts of each kind, interleaved")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "program.py"
        program.write_text(PROGRAM)
        records = Path(tmp) / "records"
        records.mkdir()
        env = {**os.environ, "TRAINER_AGENT_DIR": str(records), "RANK": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        plain, booted = [], []
        for _ in range(args.runs):
            plain.append(start([sys.executable, str(program)], env))
            booted.append(start([sys.executable, "-m", "trainer.parallel.bootstrap", str(program)], env))
    differences = [b - p for p, b in zip(plain, booted)]
    print(f"plain start {statistics.median(plain) * 1e3:.1f} ms, through the bootstrap "
          f"{statistics.median(booted) * 1e3:.1f} ms: the bootstrap adds {statistics.median(differences) * 1e3:.1f} ms "
          f"(median of {args.runs} paired starts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
