"""Each fused op's torch reference by the op's name (``reference.layer_norm``): what runs
without Triton, and the kernels' test oracle.

The references live in their ops' modules (:mod:`hpcllm.kernels.ops`); this names them for
the auto chooser (:mod:`hpcllm.kernels.choice`), ``hpcllm bench kernels`` and the tests.
"""

from __future__ import annotations

from hpcllm.kernels.ops import OPS

globals().update({op.name: op.reference for op in OPS})
