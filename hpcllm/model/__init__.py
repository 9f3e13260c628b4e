"""The GPT model, built from :mod:`hpcllm.parallel.tensor.layers`, and its cut into stages."""
