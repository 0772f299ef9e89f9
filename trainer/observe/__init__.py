"""What a run tells its user: logs, scalars to every tracker, per-rank step timing, profiler traces and
summary.json."""
