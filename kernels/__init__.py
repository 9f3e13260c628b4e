"""Fused operators (imported as ``hpcllm.kernels``): Triton on CUDA, a torch reference elsewhere."""
