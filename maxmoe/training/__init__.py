"""The training loop's parts: the pure train step, optimizer, checkpoints, metrics."""
