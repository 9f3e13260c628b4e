"""``hpcllm plan``: the layout, micro-batch, schedule and recomputation to run a GPT with.

Pure Python (no torch): :mod:`~hpcllm.plan.hardware` describes GPUs and clusters,
:mod:`~hpcllm.plan.costs` estimates one layout's memory and step time, and
:mod:`~hpcllm.plan.search` ranks every layout. The model, its constants and its validation
against the SC21 paper's measurements: docs/plan.md.
"""
