"""The command blocks of README.md and docs/getting-started.md, as the tests that run them read them.

Each fenced ```bash block there follows a marker `<!-- commands: KIND -->` or `<!-- commands: not-run (why) -->`:
container and container-fails (tests/containers/test_quickstart.py, in a fresh clone), offline (that test's
clone fixture, without a registry), bare-metal (tests/test_docs.py, in a fresh clone), ci (.ci/run runs the line).
"""
from __future__ import annotations

import re
from pathlib import Path

PAGES = ("README.md", "docs/getting-started.md")
KINDS = ("container", "container-fails", "offline", "bare-metal", "ci", "not-run")
FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$", re.M)
MARKED = re.compile(r"<!-- commands: ([a-z-]+)(?: \(([^)]*)\))? -->\n```bash\n(.*?)\n```", re.S)


def blocks(root: Path) -> list[tuple[str, str, str, list[str]]]:
    """(page, kind, why, command lines) for every marked block, in page order."""
    found = []
    for page in PAGES:
        text = (root / page).read_text()
        for kind, why, body in MARKED.findall(text):
            found.append((page, kind, why, [line for line in body.splitlines() if line.strip()]))
    return found


def unmarked(root: Path) -> list[str]:
    """Pages whose shell blocks outnumber their markers (a command no test runs)."""
    return [page for page in PAGES
            if len(FENCE.findall((root / page).read_text())) != len(MARKED.findall((root / page).read_text()))]


def commands(root: Path, kind: str) -> list[str]:
    """The command lines of one kind, each once, in the order a reader meets them."""
    seen: list[str] = []
    for _, k, _, lines in blocks(root):
        seen += [line for line in lines if k == kind and line not in seen]
    return seen
