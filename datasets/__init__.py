"""Corpora, tokenizers and HDF5 shards (imported as ``hpcllm.datasets``)."""
