"""trainer-scale runs the real trainer under torchrun at 1 and 2 processes and reports what it measured."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import as_unprivileged, assert_usage_error, clean_env

from trainer.observe.metrics import WARMUP_STEPS_EXCLUDED

TINY = ["--model", "cnn", "--batch-size", "16"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def scale(args: list[str], cwd: Path, env: dict | None = None, unprivileged: bool = False) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "trainer.cli.scale", *args]
    return subprocess.run(as_unprivileged(command) if unprivileged else command, cwd=cwd, env=clean_env(env),
                          capture_output=True, text=True, timeout=600)


def has_matplotlib() -> bool:
    return subprocess.run([sys.executable, "-c", "import matplotlib"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    """One real scaling run (1 and 2 processes, a tiny CNN) shared by the tests below."""
    root = tmp_path_factory.mktemp("scale")
    result = scale(["--max-procs", "2", "--steps", "10", "--repeats", "1", "--out", "out", "--", *TINY], root)
    assert result.returncode == 0, result.stderr[-4000:]
    return root / "out"


@pytest.mark.slow
def test_table_json_and_plot_hold_what_the_runs_measured(measured):
    report = json.loads((measured / "scaling.json").read_text())
    rows = report["rows"]
    assert [r["processes"] for r in rows] == [1, 2]
    # Each row's number is the samples/s the trainer itself wrote in that run's summary.json.
    for row, run in zip(rows, report["runs"]):
        summary = json.loads(Path(run["summary"]).read_text())
        assert summary["world_size"] == row["processes"] and summary["status"] == "completed"
        assert row["samples_per_second"] == pytest.approx(summary["samples_per_second"]) and row["samples_per_second"] > 0
    one, two = rows
    assert one["speedup"] == pytest.approx(1.0) and one["efficiency"] == pytest.approx(1.0)
    assert two["speedup"] == pytest.approx(two["samples_per_second"] / one["samples_per_second"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    table = (measured / "scaling.md").read_text()
    assert f"| 2 | {two['samples_per_second']:.1f} |" in table and f"| {two['efficiency']:.2f} |" in table
    # The noise each number carries: other work's cores during every run, and its median in the table.
    assert all(run["other_cores_busy"] >= 0 for run in report["runs"])
    assert "other work on the machine during the runs: median" in table
    assert not list(measured.rglob("*.pt")), "checkpoints of the timing runs are removed"
    if has_matplotlib():
        assert (measured / "scaling.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_report_from_summaries_reproduces_the_rows(measured, tmp_path):
    summaries = [run["summary"] for run in json.loads((measured / "scaling.json").read_text())["runs"]]
    result = scale(["--from-summaries", *summaries, "--out", "again"], tmp_path)
    assert result.returncode == 0, result.stderr
    rebuilt = json.loads((tmp_path / "again" / "scaling.json").read_text())["rows"]
    assert rebuilt == json.loads((measured / "scaling.json").read_text())["rows"]


@pytest.mark.slow
def test_without_matplotlib_table_and_json_are_still_written(measured, tmp_path):
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib blocked for this test')\n")
    summaries = [run["summary"] for run in json.loads((measured / "scaling.json").read_text())["runs"]]
    env = {"PYTHONPATH": f"{tmp_path / 'block'}:{clean_env()['PYTHONPATH']}"}
    result = scale(["--from-summaries", *summaries, "--out", "plain"], tmp_path, env)
    assert result.returncode == 0, result.stderr
    assert "matplotlib is not installed" in result.stderr
    assert (tmp_path / "plain" / "scaling.md").is_file() and (tmp_path / "plain" / "scaling.json").is_file()
    assert not (tmp_path / "plain" / "scaling.png").exists()


def test_too_few_steps_is_one_line_error(tmp_path):
    for steps in ("3", str(WARMUP_STEPS_EXCLUDED)):  # the trainer would time none of them
        assert_usage_error(scale(["--steps", steps], tmp_path), "--steps")


@pytest.mark.parametrize("args, setting, hint", [
    (["--steps", "abc"], "--steps", "invalid int value: 'abc'"),
    (["--maxprocs", "2"], "arguments", "see `trainer-scale --help`"),
    (["--max-procs", "1", "--model", "cnn"], "arguments",
     "trainer options go after `--`: trainer-scale [options] -- --model cnn"),
    (["--max-procs", "1", "--", "--max-steps", "3"], "trainer options", "--max-steps is set by the harness"),
], ids=["not a number", "misspelt option", "trainer option before --", "the harness's own flag"])
def test_argument_mistakes_are_one_line_errors(tmp_path, args, setting, hint):
    assert hint in assert_usage_error(scale(args, tmp_path), setting)


@pytest.mark.parametrize("trainer_args, setting", [
    (["--batch-size", "0"], "--batch-size"),
    (["--global-batch-size", "3"], "--global-batch-size"),  # wrong only at 2 processes, the second run
])
def test_bad_trainer_option_fails_before_any_run(tmp_path, trainer_args, setting):
    assert_usage_error(scale(["--max-procs", "2", "--", *trainer_args], tmp_path), setting)
    assert not (tmp_path / "scaling").exists()


def test_failed_run_ends_with_the_workers_error_and_exit_code(tmp_path):
    """A mistake only the worker can see (a file that is no checkpoint): its own one-line error, the
    supervisor's line naming the rank, and the worker's exit code; no torchrun traceback, no report."""
    (tmp_path / "bad.pt").write_text("not a checkpoint\n")
    result = scale(["--max-procs", "1", "--steps", str(WARMUP_STEPS_EXCLUDED + 1), "--repeats", "1", "--",
                    *TINY, "--resume", "bad.pt"], tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert any(line.startswith("error: --resume: 'bad.pt'") for line in lines), result.stderr[-3000:]
    assert lines[-1].startswith("error: training failed: rank 0 exited with code 2"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    assert not (tmp_path / "scaling" / "scaling.md").exists()


def write_summary(path: Path, **fields) -> str:
    path.write_text(json.dumps({"world_size": 1, "samples_per_second": 100.0, **fields}))
    return path.name


def test_summary_of_unfinished_run_is_rejected(tmp_path):
    name = write_summary(tmp_path / "summary.json", world_size=2, samples_per_second=None)
    assert_usage_error(scale(["--from-summaries", name], tmp_path), "--from-summaries")


@pytest.mark.parametrize("field", ["world_size", "samples_per_second"])
def test_summary_with_a_zero_is_rejected_naming_file_and_field(tmp_path, field):
    good = write_summary(tmp_path / "good.json")
    bad = write_summary(tmp_path / "bad.json", **{field: 0})
    line = assert_usage_error(scale(["--from-summaries", good, bad], tmp_path), "--from-summaries")
    assert f"bad.json: {field} is 0" in line
    assert not (tmp_path / "scaling").exists()


def test_out_that_is_a_file_or_below_one_is_one_line_error(tmp_path):
    summary = write_summary(tmp_path / "summary.json")
    (tmp_path / "outf").write_text("a file\n")
    for out in ("outf", "outf/report"):
        assert "outf" in assert_usage_error(scale(["--from-summaries", summary, "--out", out], tmp_path), "--out")
    assert (tmp_path / "outf").read_text() == "a file\n"


def test_unwritable_out_is_one_line_error(tmp_path):
    summary = write_summary(tmp_path / "summary.json")
    (tmp_path / "locked").mkdir(mode=0o555)
    for out in ("locked", "locked/report"):
        assert_usage_error(scale(["--from-summaries", summary, "--out", out], tmp_path, unprivileged=True), "--out")


def test_summaries_of_different_models_are_not_compared(tmp_path):
    one = write_summary(tmp_path / "one.json", model="cnn", device="cpu")
    two = write_summary(tmp_path / "two.json", world_size=2, model="resnet50", device="cpu")
    line = assert_usage_error(scale(["--from-summaries", one, two, "--out", "report"], tmp_path), "--from-summaries")
    assert "the summaries mix models (cnn, resnet50)" in line
    assert not (tmp_path / "report").exists()
