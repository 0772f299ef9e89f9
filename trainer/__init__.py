"""Env-driven distributed (DDP and FSDP2) training for PyTorch: one engine, two doors.

- `python -m trainer` (and `trainer-launch` in the containers): the built-in loop;
- `trainer-launch my_train.py` with `trainer.api`: your own loop, with every capability of the built-in one.

`DataSpec` (what a model factory is told about the data, and what a dataset factory returns) is importable
from here: `from trainer import DataSpec`.

The package is in rooms, each importing only the ones below it (pyproject.toml's import-linter contract):
    core        the one-line error contract, atomic writes
    config      settings (every TRAIN_* variable and flag) and the catalogue of models and datasets
    cluster     topology, the launch plan, the agent that runs the workers; torch-free at import
    parallel    a worker's side: its bootstrap, the process group, collectives, what it does for its launcher
                (the stop, its record), strategies (ddp, fsdp)
    data | checkpoint | observe
    engine      the loop's pieces (Run) and the built-in loop
    api | cli   the public helper API; the console scripts (trainer-launch, trainer-doctor, ...)
"""

from trainer.config.catalog import DataSpec

__version__ = "0.1.0"
__all__ = ["DataSpec", "__version__"]
