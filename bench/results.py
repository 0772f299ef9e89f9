"""What every bench command writes: the machine it ran on, and its table and runs under --out.

Shared by `python -m bench` (bench/run.py) and its input-only mode (bench/inputpath.py), so both
describe the machine the same way and their results files have one layout.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path


def describe_machine() -> str:
    import torch  # lazily: the harness's argument checks run before torch is imported

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{os.cpu_count()} CPUs ({cpu}), {device}, torch {torch.__version__}, Python {platform.python_version()}"


def now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def write_results(out: Path, prefix: str, header: dict, runs: list, summary: dict, table: str) -> None:
    """<out>/<prefix>-<time>.md (the table) and .json (header, every run, the summary), then say where."""
    stem = out / datetime.datetime.now().strftime(f"{prefix}-%Y%m%d-%H%M%S")
    stem.with_suffix(".md").write_text(table)
    stem.with_suffix(".json").write_text(json.dumps({**header, "runs": runs, **summary}, indent=2) + "\n")
    print(table + f"\nwritten: {stem}.md, {stem}.json")
