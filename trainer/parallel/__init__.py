"""A worker's side: its start (bootstrap), the process group and what runs over it: joining it (context), the
helpers for who does what (collectives), what it does for its launcher (supervised: the stop, its record), how
the model is spread (strategy: ddp or fsdp) and the shared-memory collectives of CPU processes on one host."""
