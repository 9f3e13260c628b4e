"""The trainer and its components: the step, checkpoints, metrics, validation."""
