"""Checkpoints: what they hold, committing them atomically (a file, or a directory of shards under fsdp), and
finding the newest valid one to resume from."""
