"""Where rank 0's scalars go: TensorBoard, metrics.csv, Weights & Biases, MLflow (--tracker).

Every tracker gets the same names, TensorBoard's tags (`Loss/train`, `acc1/val`, `lr`,
`time/compute_ms/rank1`), so a run reads the same in each. Compute nodes often have no internet:
wandb runs offline (WANDB_MODE=offline unless the environment says otherwise) into the log
directory, and MLflow writes a file store under it (MLFLOW_TRACKING_URI overrides); both sync
later from a host that has a network (docs/performance.md, "See inside a run"). A tracker that cannot
start or stops working costs one warning, never the training run.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from trainer.core.errors import first_line
from trainer.core.files import atomic_file

log = logging.getLogger("trainer")
PARAMS_FILE = "params.json"  # the run's config, topology and versions, beside summary.json
METRICS_CSV = "metrics.csv"
DEFAULT_PROJECT = "ddp-trainer"  # the wandb project and MLflow experiment unless WANDB_PROJECT/MLFLOW_EXPERIMENT_NAME


def run_params(cfg, ctx) -> dict[str, Any]:
    """What the trackers record as the run's parameters (and params.json holds): every setting, who ran it
    where, and with which software."""
    import torch

    from trainer import __version__ as trainer_version
    from trainer.cluster.versions import version_fingerprint

    topology = ctx.topology
    return {
        "config": cfg.as_dict(),
        "topology": {"world_size": ctx.world_size, "nodes": max(1, ctx.world_size // topology.local_world_size),
                     "local_world_size": topology.local_world_size, "started_by": topology.started_by,
                     "backend": ctx.backend, "device": str(ctx.device),
                     "gpu": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None},
        "versions": {**version_fingerprint(), "torchvision": _version("torchvision"), "trainer": trainer_version,
                     "platform": platform.platform()},
    }


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def flat(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"config": {"lr": 0.1}} -> {"config.lr": 0.1}: MLflow's parameters are flat."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class TensorBoardTracker:
    name, what = "tensorboard", "TensorBoard events"

    def __init__(self, log_dir: str, purge_step: int | None, params: dict | None):
        self.where = log_dir
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events a killed run wrote after its last checkpoint.
        self.writer = SummaryWriter(log_dir, purge_step=purge_step)
        _quiet_event_writer_thread()
        if params and purge_step is None:
            self.writer.add_text("run/params", "```\n" + json.dumps(params, indent=2) + "\n```", 0)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


def _quiet_event_writer_thread() -> None:
    """TensorBoard's writer thread dies with a traceback when a write fails, then hands the same error to
    the training thread's next add_scalar (Scalars reports it there, in one line)."""
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError)):
            previous(args)

    threading.excepthook = hook


class CsvTracker:
    """<log-dir>/metrics.csv, one row per scalar (step, tag, value, wall_time): tags come and go
    (validation every few epochs), so a long table never needs its header rewritten."""

    name, what = "csv", METRICS_CSV
    header = ["step", "tag", "value", "wall_time"]

    def __init__(self, log_dir: str, purge_step: int | None, params: dict | None):
        path = Path(log_dir) / METRICS_CSV
        self.where = log_dir
        if purge_step is not None and path.exists():  # as TensorBoard's purge_step: the resumed steps anew
            with path.open(newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) < purge_step]
            with atomic_file(path, "w", durable=False) as f:
                writer = csv.DictWriter(f, self.header)
                writer.writeheader()
                writer.writerows(kept)
        new = not path.exists()
        self.file = path.open("a", newline="")
        self.writer = csv.writer(self.file)
        if new:
            self.writer.writerow(self.header)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        now = f"{time.time():.3f}"
        self.writer.writerows([step, tag, repr(float(value)), now] for tag, value in values.items())
        self.file.flush()  # a running run can be read (trainer-report) and nothing is lost to a kill

    def close(self) -> None:
        self.file.close()


class WandbTracker:
    """Offline unless WANDB_MODE says otherwise: <log-dir>/wandb/offline-run-*, uploaded later with
    `wandb sync`. A resumed run continues the same wandb run (its id is kept in the log directory)."""

    name, what = "wandb", "wandb scalars"

    def __init__(self, log_dir: str, purge_step: int | None, params: dict | None):
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")  # its banners would interleave with the training log
        id_file = Path(log_dir) / ".wandb-run-id"
        run_id = id_file.read_text().strip() if purge_step is not None and id_file.exists() else None
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", DEFAULT_PROJECT), dir=log_dir,
                              config=params, id=run_id, resume="allow" if run_id else None)
        id_file.write_text(self.run.id)
        self.where = self.run.dir
        if os.environ["WANDB_MODE"] == "offline":
            log.info("wandb: offline run in %s (upload it later: wandb sync %s)", self.run.dir,
                     Path(self.run.dir).parent)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """A file store under <log-dir>/mlruns unless MLFLOW_TRACKING_URI names a server; a resumed run
    continues the same MLflow run."""

    name, what = "mlflow", "MLflow scalars"

    def __init__(self, log_dir: str, purge_step: int | None, params: dict | None):
        import warnings

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # A file store, not MLflow 3's preferred SQLite: SQLite's locking is unsafe on the shared file
            # systems of clusters, and mlflow-skinny has no database driver. MLflow 3 allows it on request.
            uri = (Path(log_dir).resolve() / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        with warnings.catch_warnings():  # MLflow 3 nudges file stores towards a database: here the point is none
            warnings.simplefilter("ignore", FutureWarning)
            self.client = MlflowClient(tracking_uri=uri)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_PROJECT)
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        id_file = Path(log_dir) / ".mlflow-run-id"
        self.run_id = id_file.read_text().strip() if purge_step is not None and id_file.exists() else None
        if self.run_id is None:
            self.run_id = self.client.create_run(experiment_id, run_name=Path(log_dir).resolve().name).info.run_id
            if params:  # MLflow refuses a parameter logged twice with another value: only a new run logs them
                items = [Param(k, str(v)[:500]) for k, v in flat(params).items()]
                for start in range(0, len(items), 100):  # log_batch takes at most 100 parameters
                    self.client.log_batch(self.run_id, params=items[start:start + 100])
            id_file.write_text(self.run_id)
        self.where = uri

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(tag, float(value), now, step)
                                                    for tag, value in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKER_CLASSES = {t.name: t for t in (TensorBoardTracker, CsvTracker, WandbTracker, MlflowTracker)}


def start(names: list[str], log_dir: str, purge_step: int | None, params: dict | None) -> list:
    """The trackers that start; each one that cannot is one warning."""
    started = []
    for name in names:
        try:
            started.append(TRACKER_CLASSES[name](log_dir, purge_step, params))
        except Exception as err:  # noqa: BLE001 (a tracker is worth less than the run: see the module doc)
            log.warning("%s: cannot start (%s: %s): training goes on without it", name, type(err).__name__,
                        first_line(err))
    return started
