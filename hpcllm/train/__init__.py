"""The training step, optimizer and schedule, checkpoints."""
