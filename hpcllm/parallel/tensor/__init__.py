"""Tensor and sequence parallelism along Megatron-LM's seams.

``mappings``: the autograd collectives between tp ranks; ``layers``: column- and row-parallel
linear layers and the vocab-parallel embedding built on them; ``cross_entropy``: the loss over
vocabulary-split logits; ``deferred``: the linear every layer runs, whose weight gradient
zb-h1 can leave for its W.
"""
