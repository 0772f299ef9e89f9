"""The engine: the built-in loop, the models and optimizers it builds, on the pieces below."""
