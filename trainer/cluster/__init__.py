"""Where the processes run: the topology resolver, the launcher, the preflight checks and the supervisor.

Torch-free at import (tests/test_rooms.py proves it): the launcher must answer in milliseconds, and a
host without GPUs never pays for torch's import. Imports trainer.config and trainer.core only."""
