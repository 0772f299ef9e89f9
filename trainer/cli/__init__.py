"""Console scripts: trainer-launch (the containers' entrypoint) and its preflight trainer-doctor, trainer-scale,
trainer-export, trainer-report; the built-in loop is `python -m trainer`."""
