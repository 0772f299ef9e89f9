"""Seeing inside a distributed run (issue 16), grouped by promise:

- a rank slowed on purpose is named the straggler, with its host, in the log and in summary.json;
- the per-rank timing rides the loss's all-reduce: the loss is the same with timing on and off;
- every tracker (TensorBoard, metrics.csv, wandb offline, MLflow's file store) gets the same scalars
  under the same names, and the run's parameters; nothing is sent anywhere;
- a tracker whose package is missing is one line and exit 2 before training;
- --profile-steps writes Chrome/Perfetto JSON traces of exactly those steps, on the chosen ranks;
- trainer-report diagnoses a real run, finished or running, and draws its curves (or says why not).

Real torchrun processes on gloo; the straggler is a real sleep in one rank's samples, made from outside the
trainer by a user dataset (tests/user_code/straggler.py), as a slow disk on one host would make it.
"""

from __future__ import annotations

import csv
import glob
import json
import re
import shutil
import socket
import struct
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import REPO, assert_usage_error, clean_env, dirs_args, read_scalars, read_summary, run_trainer, train_ok

pytestmark = pytest.mark.slow
STEPS, LOG_EVERY = 16, 2
SMALL = ["--model", "cnn", "--synthetic-size", "1024", "--batch-size", "32", "--epochs", "1",
         "--max-steps", str(STEPS), "--log-every", str(LOG_EVERY), "--val-every", "0", "--env-file", "/dev/null"]
# The same model on a user dataset read in the training process, whose samples come slowly on one rank.
STRAGGLING = [*SMALL, "--dataset", "straggler:build", "--num-workers", "0"]
SLOW_RANK_S = 0.15  # rank 1's extra wait for every batch: several times a CNN step on a loaded 2-core runner
USER_CODE = {"PYTHONPATH": f"{REPO / 'tests' / 'user_code'}:{REPO}"}
REPORT = [sys.executable, "-m", "trainer.cli.report"]  # the trainer-report console script's module


def hiding(root: Path, *modules: str) -> dict[str, str]:
    """An environment in which `modules` cannot be imported, as on a machine without them: a
    sitecustomize marks them absent in sys.modules (importlib then finds no spec)."""
    site = root / "site-hiding"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    env = clean_env()
    return {"PYTHONPATH": f"{site}:{env['PYTHONPATH']}"}


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("straggler")
    result = train_ok([*STRAGGLING, *dirs_args(root)], root, nproc=2, env={**USER_CODE, "STRAGGLER": f"1:{SLOW_RANK_S}"})
    return root / "runs", result


# ------------------------------------------------------------------ stragglers and per-rank timing
def test_a_slowed_rank_is_named_the_straggler_with_its_host(straggler_run):
    log_dir, result = straggler_run
    host = socket.gethostname()
    summary = read_summary(log_dir)
    assert summary["straggler"]["rank"] == 1 and summary["straggler"]["host"] == host, summary["straggler"]
    assert summary["straggler"]["phase"] == "data_wait_ms"
    assert f"straggler: rank 1 on {host} is" in result.stderr and "mostly data wait" in result.stderr, \
        result.stderr[-3000:]
    fast, slow = summary["ranks"]
    assert (fast["rank"], slow["rank"]) == (0, 1) and fast["host"] == slow["host"] == host
    # Per step: the slow rank's wait for its samples holds at least its sleep, and more than the fast rank's;
    # the fast rank spends that time waiting for the slow one in the gradient all-reduce instead.
    assert slow["data_wait_ms"] >= SLOW_RANK_S * 1000 and slow["data_wait_ms"] > fast["data_wait_ms"]
    assert fast["comm_wait_ms"] > slow["comm_wait_ms"]
    assert slow["straggler_windows"] >= 1 and fast["straggler_windows"] == 0
    assert fast["steps"] == slow["steps"] == STEPS - LOG_EVERY  # the first window (start-up) left out


def test_per_rank_scalars_every_log_window(straggler_run):
    log_dir, _ = straggler_run
    scalars = read_scalars(log_dir)
    for rank in (0, 1):
        for name in ("data_wait_ms", "compute_ms", "comm_wait_ms", "optimizer_ms"):
            points = scalars[f"time/{name}/rank{rank}"]
            assert [s for s, _ in points] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
            assert all(v >= 0 for _, v in points)
    assert not any(tag.startswith("gpu/") for tag in scalars)  # CPU processes: no GPU memory to report


def test_timing_off_trains_the_same_loss_without_timing_scalars(straggler_run, tmp_path):
    """The timing travels in the loss's all-reduce; the loss itself must not change."""
    log_dir, _ = straggler_run
    train_ok([*STRAGGLING, "--step-timing", "false", *dirs_args(tmp_path)], tmp_path, nproc=2, env=USER_CODE)
    off = read_scalars(tmp_path / "runs")
    assert off["Loss/train"] == read_scalars(log_dir)["Loss/train"]
    assert not any(tag.startswith("time/") and "rank" in tag for tag in off)
    summary = read_summary(tmp_path / "runs")
    assert "ranks" not in summary and "straggler" not in summary


# ------------------------------------------------------------------ trackers
def wandb_records(run_file: Path) -> list:
    """The records of an offline wandb run file: LevelDB's log format (7-byte blocks headers in 32 KiB
    blocks, records split FIRST/MIDDLE/LAST), each a wandb Record protobuf (what `wandb sync` uploads)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = run_file.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    block, position, records, partial = 32768, 7, [], b""
    while position + 7 <= len(raw):
        if block - position % block < 7:  # too little room for a header: the block's tail is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[position:position + 7])
        chunk = raw[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            partial += chunk
        elif kind == 4:
            records.append(partial + chunk)
            partial = b""
    parsed = []
    for data in records:
        record = pb.Record()
        record.ParseFromString(data)
        parsed.append(record)
    return parsed


def assert_same_series(a: list[tuple[int, float]], b: list[tuple[int, float]], tag: str) -> None:
    """The same steps and values (TensorBoard stores float32, the others float64)."""
    assert [s for s, _ in a] == [s for s, _ in b], tag
    assert [v for _, v in a] == pytest.approx([v for _, v in b], rel=1e-6), tag


def test_every_tracker_gets_the_same_scalars_and_the_run_parameters(tmp_path, monkeypatch):
    args = [*SMALL, "--val-every", "1", "--epochs", "1", "--max-steps", "0", "--synthetic-size", "512",
            "--tracker", "tensorboard,csv,wandb,mlflow"]
    env = {"WANDB_API_KEY": "", "HOME": str(tmp_path)}  # no wandb login here: offline is the default anyway
    result = train_ok([*args, *dirs_args(tmp_path)], tmp_path, nproc=2, env=env)
    log_dir = tmp_path / "runs"
    assert "wandb sync" in result.stderr  # the hint to upload it later
    assert "cannot start" not in result.stderr and "can no longer" not in result.stderr, result.stderr[-3000:]
    board = read_scalars(log_dir)
    assert {"Loss/train", "lr", "acc1/val", "acc5/val", "Loss/val", "time/compute_ms/rank1"} <= set(board)

    # metrics.csv: one row per scalar, beside summary.json
    table: dict[str, list[tuple[int, float]]] = {}
    with (log_dir / "metrics.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            table.setdefault(row["tag"], []).append((int(row["step"]), float(row["value"])))
    assert set(table) == set(board)
    for tag, points in board.items():
        assert_same_series(table[tag], points, tag)

    params = json.loads((log_dir / "params.json").read_text())
    assert params["config"]["model"] == "cnn" and params["topology"]["world_size"] == 2
    assert params["versions"]["torch"]

    # MLflow: a file store under the log directory, one run, read back through MLflow's own client
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the README's `mlflow ui` line: MLflow 3 asks for it
    client = MlflowClient(tracking_uri=(log_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("ddp-trainer")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["config.model"] == "cnn" and run.data.params["topology.world_size"] == "2"
    assert run.data.params["versions.torch"] == params["versions"]["torch"]
    assert set(run.data.metrics) == set(table)
    for tag in ("Loss/train", "acc1/val", "time/compute_ms/rank1"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
        assert_same_series(history, table[tag], tag)

    # wandb: one offline run (rank 0 only), its history and config in the run file `wandb sync` uploads
    (run_dir,) = glob.glob(str(log_dir / "wandb" / "offline-run-*"))
    (run_file,) = Path(run_dir).glob("run-*.wandb")
    records = wandb_records(run_file)
    history: dict[str, list[tuple[int, float]]] = {}
    config = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for tag, value in row.items():
                if not tag.startswith("_"):
                    history.setdefault(tag, []).append((row["_step"], value))
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    assert set(history) == set(table)
    for tag, points in table.items():
        assert_same_series(history[tag], points, tag)
    assert config["config"]["model"] == "cnn" and config["topology"]["world_size"] == 2


def test_csv_of_a_resumed_run_holds_each_step_once(tmp_path):
    """As TensorBoard's purge_step: the steps a killed run logged after its last checkpoint come anew."""
    args = [*SMALL, "--tracker", "csv", "--checkpoint-every", "4", *dirs_args(tmp_path)]
    train_ok([*args, "--max-steps", "6"], tmp_path, forked=True)
    (tmp_path / "checkpoints" / "step-00000006.pt").unlink()  # as if killed after logging step 6
    train_ok(args, tmp_path, forked=True)  # resumes from step 4 to STEPS: steps 5 and 6 again
    with (tmp_path / "runs" / "metrics.csv").open(newline="") as f:
        rows = [(int(r["step"]), r["tag"]) for r in csv.DictReader(f)]
    assert len(rows) == len(set(rows))
    assert sorted({s for s, t in rows if t == "Loss/train"}) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))


def test_a_missing_tracker_package_is_one_line_before_training(tmp_path):
    result = run_trainer([*SMALL, "--tracker", "tensorboard,wandb", *dirs_args(tmp_path)], tmp_path,
                         env=hiding(tmp_path, "wandb"))
    line = assert_usage_error(result, "--tracker")
    assert "wandb is not installed" in line and "ddp-trainer[wandb]" in line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "checkpoints").exists()


def test_a_tracker_that_cannot_start_is_one_warning_and_the_run_goes_on(tmp_path):
    """Online MLflow asked for, with no server there: the training finishes, with TensorBoard."""
    dead = f"http://127.0.0.1:{_closed_port()}"
    result = train_ok([*SMALL, "--tracker", "tensorboard,mlflow", *dirs_args(tmp_path)], tmp_path,
                      env={"MLFLOW_TRACKING_URI": dead, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
                           "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}, forked=True)
    warnings = [line for line in result.stderr.splitlines() if "mlflow: cannot start" in line]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert read_summary(tmp_path / "runs")["status"] == "completed"
    assert "Loss/train" in read_scalars(tmp_path / "runs")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when this returns: nothing listens there


# ------------------------------------------------------------------ profiler traces
def test_profile_steps_write_a_chrome_trace_of_exactly_those_steps_on_the_chosen_rank(tmp_path):
    result = train_ok([*SMALL, "--profile-steps", "3:5", "--profile-ranks", "1", *dirs_args(tmp_path)],
                      tmp_path, nproc=2)
    profile = tmp_path / "runs" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["rank1.steps3-5.pt.trace.json"]
    trace = json.loads((profile / "rank1.steps3-5.pt.trace.json").read_text())
    steps = sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"]
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])  # the ops themselves
    assert "ui.perfetto.dev" in result.stderr and str(Path("runs") / "profile") in result.stderr


# ------------------------------------------------------------------ trainer-report
def test_report_on_a_finished_run_names_the_straggler_and_draws_the_curves(straggler_run):
    log_dir, _ = straggler_run
    result = subprocess.run([*REPORT, str(log_dir)], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "run: completed at step 16, 2 ranks" in out
    assert "throughput (samples/s): steps" in out
    assert f"slowest rank: rank 1 on {socket.gethostname()}" in out
    assert "verdict: one slow rank, rank 1" in out and "--num-workers" in out
    png = log_dir / "report.png"
    assert f"curves: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png.read_bytes()[16:24])
    assert width >= 400 and height >= 400


def test_report_on_a_running_run_reads_the_scalars(straggler_run, tmp_path):
    """No summary.json yet: the per-rank table comes from the logged scalars."""
    log_dir, _ = straggler_run
    running = tmp_path / "running"
    shutil.copytree(log_dir, running, ignore=shutil.ignore_patterns("summary.json", "report.png"))
    result = subprocess.run([*REPORT, str(running), "--png", "none"], env=clean_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "run: in progress (no summary.json yet), last logged step 16" in result.stdout
    assert "slowest rank: rank 1" in result.stdout
    assert not (running / "report.png").exists()


def test_report_without_matplotlib_says_so_in_one_line(straggler_run, tmp_path):
    log_dir, _ = straggler_run
    png = tmp_path / "curves.png"
    result = subprocess.run([*REPORT, str(log_dir), "--png", str(png)], env=clean_env(hiding(tmp_path, "matplotlib")),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("no PNG: matplotlib is not installed"), last
    # The hint names an extra pyproject.toml has, and that extra brings matplotlib.
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (extra,) = re.findall(r"ddp-trainer\[(\w+)\]", last)
    assert any(dep.startswith("matplotlib") for dep in extras[extra]), (extra, extras)
    assert not png.exists()


def test_report_on_a_folder_that_is_no_run_is_one_line(tmp_path):
    result = subprocess.run([*REPORT, str(tmp_path)], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert_usage_error(result, "log_dir")
