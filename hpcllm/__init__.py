"""hpcllm: GPT training on supercomputers with tensor, pipeline and data parallelism.

``hpcllm.load_model(run_dir, step=None)`` returns a trained run's model (see
:func:`hpcllm.generate.load_model`); the name resolves on first use, so ``import hpcllm``
imports no torch.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Resolve ``load_model`` on first use (PEP 562): importing the package stays light."""
    if name == "load_model":
        from hpcllm.generate import load_model

        return load_model
    raise AttributeError(f"module 'hpcllm' has no attribute {name!r}")
