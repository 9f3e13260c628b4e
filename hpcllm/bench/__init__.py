"""Benchmarks, one module per `hpcllm bench <target>`."""
