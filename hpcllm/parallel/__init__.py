"""Tensor, pipeline and data parallelism."""
