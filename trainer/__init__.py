"""Env-driven DistributedDataParallel trainer: the same worker under torchrun, Slurm or alone.

`DataSpec` (what a model factory is told about the data, and what a dataset factory returns) is
importable from here: `from trainer import DataSpec`.
"""

from trainer.catalog import DataSpec

__version__ = "0.1.0"
__all__ = ["DataSpec", "__version__"]
