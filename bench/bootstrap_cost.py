"""`python -m bench.bootstrap_cost`: what the launcher's bootstrap adds to a worker's start, in milliseconds.

Every worker trainer-launch starts begins in trainer.parallel.bootstrap (the parent-death signal, the sentinel
fork, faulthandler, the progress stream, the join watch, its record) before the program's first line. This
starts the same tiny program (no torch import: only the difference is measured) both ways, interleaved, with a
records folder as the supervisor gives one, and reports the median of each and of their paired differences.

    python -m bench.bootstrap_cost --runs 30
    python -m bench.bootstrap_cost --runs 30 --before /tmp/before   # and another checkout's bootstrap, interleaved
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


def start(command: list[str], env: dict[str, str], cwd: Path | None = None) -> float:
    began = time.perf_counter()
    # A session of its own, as torchrun starts a worker: the bootstrap's sentinel needs a group to guard.
    subprocess.run(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, start_new_session=True, check=True)
    return time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30, help="starts of each kind, interleaved")
    parser.add_argument("--before", type=Path, help="another checkout (git worktree add DIR COMMIT): its bootstrap "
                        "too, in each round (trainer/parallel/bootstrap.py, or trainer/cluster/bootstrap.py where it was)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "program.py"
        program.write_text(PROGRAM)
        records = Path(tmp) / "records"
        records.mkdir()
        env = {**os.environ, "TRAINER_AGENT_DIR": str(records), "RANK": "0",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        plain, booted, before = [], [], []
        old = "trainer.parallel.bootstrap" if args.before and (args.before / "trainer/parallel/bootstrap.py").is_file() \
            else "trainer.cluster.bootstrap"
        for _ in range(args.runs):
            plain.append(start([sys.executable, str(program)], env))
            booted.append(start([sys.executable, "-m", "trainer.parallel.bootstrap", str(program)], env))
            if args.before:
                before.append(start([sys.executable, "-m", old, str(program)], {**env, "PYTHONPATH": str(args.before)},
                                    cwd=args.before))
    median_ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    print(f"plain start {median_ms(plain):.1f} ms, through the bootstrap {median_ms(booted):.1f} ms: the bootstrap "
          f"adds {median_ms([b - p for p, b in zip(plain, booted)]):.1f} ms (median of {args.runs} paired starts)")
    if args.before:
        print(f"before ({args.before}): {median_ms(before):.1f} ms, adding "
              f"{median_ms([b - p for p, b in zip(plain, before)]):.1f} ms; this checkout's minus before's "
              f"{median_ms([n - b for n, b in zip(booted, before)]):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
