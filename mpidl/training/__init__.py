"""The training front end: the loop (Trainer), checkpoints, metrics, progress, logging."""
