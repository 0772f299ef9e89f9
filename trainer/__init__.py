"""Env-driven DistributedDataParallel trainer: the same worker under torchrun, Slurm or alone."""

__version__ = "0.1.0"
