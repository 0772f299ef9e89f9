"""The engine: Run (run.py), the pieces a training loop calls, and the built-in loop (loop.py), one user of them;
the validator, and the models and optimizers the built-in loop builds by name."""
