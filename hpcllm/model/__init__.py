"""The models' torch halves; :func:`build` makes one for any registered family."""

from __future__ import annotations

from typing import Any

from torch import nn

from hpcllm import families
from hpcllm.config import ModelConfig


def build(cfg: ModelConfig, vocab_size: int, **stage: Any) -> nn.Module:
    """Return the model (or, with ``layers``/``pre``/``post``, one pipeline stage of it) of
    family ``cfg.arch``, with the keywords every family's module takes: ``tp_group``,
    ``seed``, ``sequence_parallel``, ``layers``, ``pre``, ``post``, ``ep``."""
    return families.model_class(cfg.arch)(cfg, vocab_size, **stage)
