"""The GPT model, built from the layers of :mod:`hpcllm.parallel.tensor`."""
