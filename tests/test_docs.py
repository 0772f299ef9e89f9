"""The docs as a new user reads them: every link resolves, every command block says which test runs it, and
the bare-metal commands of docs/getting-started.md run as written in a fresh clone (the container commands:
tests/containers/test_quickstart.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docs_commands import KINDS, blocks, commands, unmarked

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '# comment' in a code block is no heading
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_link_of_the_readme_and_docs_resolves():
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_every_command_block_says_which_test_runs_it():
    assert unmarked(REPO) == [], "a ```bash block without a <!-- commands: KIND --> marker"
    found = blocks(REPO)
    assert {kind for _, kind, _, _ in found} <= set(KINDS)
    assert all(why for _, kind, why, _ in found if kind == "not-run"), "a not-run block must say why"
    # `ci` lines are what .ci/run runs, word for word (its own arguments after them).
    ci = (REPO / ".ci" / "run").read_text()
    for line in commands(REPO, "ci"):
        assert re.search(rf"^\s*(\w+=\S+\s+)*{re.escape(line)}\b", ci, re.M), f".ci/run does not run `{line}`"
    # The one test command, everywhere.
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        assert "python -m pytest" not in page.read_text(), f"{page.name}: the test command is scripts/test"


@pytest.mark.slow
def test_the_bare_metal_commands_run_as_written_in_a_fresh_clone(tmp_path):
    """A fresh clone of HEAD (commit first), no .env, no stack settings: the getting-started page's bare-metal
    block, line by line, with this venv's commands on PATH standing in for its (not-run) install block."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    assert not (clone / ".env").exists()
    lines = commands(clone, "bare-metal")
    assert lines, "docs/getting-started.md has no bare-metal block"
    env = {k: v for k, v in os.environ.items()
           if not re.match(r"^(TRAIN_|NNODES$|NODE_RANK$|NPROC_PER_NODE$|MASTER_|PREFLIGHT$|CUDA_VISIBLE)", k)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    outputs = []
    for line in lines:
        out = subprocess.run(["bash", "-c", line], cwd=clone, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=600)
        assert out.returncode == 0, f"`{line}` exited {out.returncode}:\n{out.stdout[-3000:]}"
        outputs.append(out.stdout)
    assert "completed at step 128" in outputs[0], outputs[0][-3000:]
    assert (clone / "runs" / "summary.json").is_file() and "verdict:" in outputs[-1], outputs[-1][-2000:]


def test_the_quoted_demo_line_is_what_the_summary_service_prints(tmp_path):
    """README.md and docs/getting-started.md quote the demo's last line: the summary service of compose.yaml, run
    here on a summary.json with the quoted values, prints exactly that (it used to lack the line's suffix)."""
    import json

    import yaml

    service = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["summary-cpu"]
    program = service["entrypoint"][-1].replace('open("/runs/summary.json")', f'open({str(tmp_path / "s.json")!r})')
    assert str(tmp_path) in program, "the summary service no longer reads /runs/summary.json as it did"
    quoted = [line for page in (REPO / "README.md", REPO / "docs" / "getting-started.md")
              for line in page.read_text().splitlines() if line.startswith("summary-cpu-1  | ")]
    assert len(quoted) == 2, quoted
    for line in quoted:
        shown = re.match(r"summary-cpu-1  \| (\w+) at step (\d+), world size (\d+): train loss (\S+), val acc@1 (\S+) ",
                         line)
        assert shown, line
        status, step, world, loss, acc = shown.groups()
        (tmp_path / "s.json").write_text(json.dumps({"status": status, "global_step": int(step), "world_size":
                                                     int(world), "train_loss": float(loss), "val_acc1": float(acc)}))
        printed = subprocess.run([sys.executable, "-c", program], env={"NODE_RANK": "0"}, capture_output=True,
                                 text=True, timeout=60)
        assert printed.returncode == 0, printed.stderr
        assert f"summary-cpu-1  | {printed.stdout.strip()}" == line
