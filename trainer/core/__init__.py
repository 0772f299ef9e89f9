"""The bottom room: the one-line error contract and atomic writes. Torch-free; imports nothing of the trainer."""
