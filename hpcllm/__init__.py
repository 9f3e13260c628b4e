"""hpcllm: GPT training on supercomputers with tensor, pipeline and data parallelism."""

__version__ = "0.1.0"
