"""A trained run as one model: :func:`load_model` (``hpcllm.load_model``), and ``hpcllm generate``,
which samples text from a prompt with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcllm.config import Config
from hpcllm.datasets.synthetic import trained_on_synthetic
from hpcllm.datasets.tokenizer import load_tokenizer
from hpcllm.errors import UserError
from hpcllm.model import build
from hpcllm.train import reshard


def load_model(
    run_dir: str | Path, step: int | None = None, allow_unverified: bool = False
) -> nn.Module:
    """Return a trained run's model, whole, in eval mode on the CPU: ``model(ids)`` gives the
    logits (batch, tokens, vocabulary) of token ids (batch, tokens).

    From the newest checkpoint of ``run_dir`` that verifies, or the one of ``step``; of any
    layout (tensor-parallel slices and pipeline stages are merged in memory) and any model
    family. A checkpoint without a manifest is refused unless ``allow_unverified``. Also
    ``hpcllm.load_model``.
    """
    folder = reshard.select(Path(run_dir), step, allow_unverified)
    model, _ = merged_model(folder, verified=True)
    return model


def merged_model(folder: Path, *, verified: bool = False) -> tuple[nn.Module, Config]:
    """Return (the whole model in eval mode, on the CPU; its run's config) from a checkpoint
    folder.

    Any layout: tensor-parallel slices and pipeline stages are merged in memory.
    ``verified``: :func:`hpcllm.train.reshard.select` checked the folder already.
    """
    cfg, vocab, weights = reshard.whole_model_state(folder, verified=verified)
    with torch.device("meta"):
        model = build(cfg.model, vocab)
    model.load_state_dict(weights, assign=True)
    return model.eval(), cfg


def load_run_model(
    run_dir: Path,
    device: torch.device | None = None,
    step: int | None = None,
    allow_unverified: bool = False,
) -> tuple[nn.Module, Any]:
    """Return (model in eval mode, tokenizer) from a run's checkpoint of any layout.

    The newest checkpoint that verifies, or the one of ``step``.
    """
    run_dir = Path(run_dir)
    tokenizer_path = run_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        if trained_on_synthetic(run_dir):
            raise UserError(
                f"{run_dir} was trained on synthetic data (data.synthetic: true): it has no "
                "tokenizer to read a prompt or write text with"
            )
        raise UserError(f"{tokenizer_path} is missing; it is copied there when training starts")
    model = load_model(run_dir, step, allow_unverified)
    return model.to(device or torch.device("cpu")), load_tokenizer(tokenizer_path)


def generate(
    run_dir: Path,
    prompt: str,
    tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    step: int | None = None,
    allow_unverified: bool = False,
) -> str:
    """Return ``prompt`` followed by ``tokens`` sampled tokens, decoded."""
    model, tokenizer = load_run_model(run_dir, step=step, allow_unverified=allow_unverified)
    ids = tokenizer.encode_batch([prompt])[0] or [tokenizer.eos_id]
    gen = torch.Generator().manual_seed(seed)
    out = model.generate(
        torch.tensor([ids]), tokens, temperature=temperature, top_k=top_k, gen=gen
    )[0].tolist()
    new = out[len(ids) :]
    if tokenizer.eos_id in new:
        new = new[: new.index(tokenizer.eos_id)]
    if tokenizer.kind == "byte":
        return prompt + bytes(new).decode("utf-8", errors="replace")
    return prompt + tokenizer.decode(new)
