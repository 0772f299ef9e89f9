"""Settings and the catalogue: what a run is asked to do, validated before any process starts.

Torch-free: the launcher and the preflight read it in milliseconds. Imports only trainer.core."""
