"""Where the processes run: the topology resolver, the launch plan (what runs, with which settings) and the agent
that runs and watches the workers (torch's elastic agent, the hang watchdog, the hosts' presence).

Torch-free at import (tests/test_rooms.py proves it): the launcher must answer in milliseconds, and a
host without GPUs never pays for torch's import. Imports trainer.config and trainer.core only."""
