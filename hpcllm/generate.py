"""A trained run as one model: :func:`load_model` (``hpcllm.load_model``), and ``hpcllm generate``,
which samples text from a prompt with it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcllm import families
from hpcllm.config import Config
from hpcllm.datasets.synthetic import trained_on_synthetic
from hpcllm.datasets.tokenizer import Tokenizer, load_tokenizer
from hpcllm.errors import UserError
from hpcllm.model import build
from hpcllm.train import reshard
from hpcllm.train.run_dir import IMPORTED_CONFIG


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


def merged_model(
    folder: Path, *, verified: bool = False, seq_len: int | None = None
) -> tuple[nn.Module, Config]:
    """Return (the whole model in eval mode, on the CPU; its run's config) from a checkpoint
    folder.

    Any layout: tensor-parallel slices and pipeline stages are merged in memory.
    ``verified``: :func:`hpcllm.train.reshard.select` checked the folder already.
    ``seq_len``: a longer sequence than the run's the model takes, where its positions hold
    no weights (rotary); a learned position embedding keeps its length.
    """
    from hpcllm.train.checkpoint import step_of

    cfg, vocab, weights = reshard.whole_model_state(folder, verified=verified)
    shape = cfg.model
    if seq_len is not None and seq_len > shape.seq_len:
        if families.get(shape.arch).seq_in_weights:
            raise UserError(
                f"a {shape.arch} model has weights for {shape.seq_len} positions, not {seq_len}"
            )
        shape = dataclasses.replace(shape, seq_len=seq_len)
    with torch.device("meta"):
        model = build(shape, vocab)
    model.load_state_dict(weights, assign=True)
    model.checkpoint_step = step_of(folder)  # which checkpoint: the commands say it
    return model.eval(), cfg


def say_step(model: nn.Module) -> None:
    """Say on stderr which checkpoint's step a command samples from (stdout is the sample)."""
    import sys

    print(f"hpcllm: sampling from step {model.checkpoint_step}", file=sys.stderr, flush=True)


def load_run_model(
    run_dir: Path,
    device: torch.device | None = None,
    step: int | None = None,
    allow_unverified: bool = False,
    tokenizer: Path | None = None,
) -> tuple[nn.Module, Any]:
    """Return (model in eval mode, tokenizer) from a run's checkpoint of any layout.

    The newest checkpoint that verifies, or the one of ``step``. The tokenizer: ``tokenizer``
    (a tokenizer.json or a Hugging Face tokenizer folder), else the run's; a UserError where
    there is neither.
    """
    run_dir = Path(run_dir)
    if tokenizer is None and not (run_dir / "tokenizer.json").is_file():
        if trained_on_synthetic(run_dir):
            raise UserError(
                f"{run_dir} was trained on synthetic data (data.synthetic: true): it has no "
                "tokenizer to read a prompt or write text with; --prompt-ids samples ids"
            )
        raise UserError(
            f"{run_dir} has no tokenizer.json (it is copied there when training starts; a "
            "Hugging Face import without one has none): pass --tokenizer PATH, or sample ids "
            "with --prompt-ids"
        )
    tok = load_tokenizer(tokenizer if tokenizer is not None else run_dir / "tokenizer.json")
    model = load_model(run_dir, step, allow_unverified)
    if tok.vocab_size > model.vocab_size:
        raise UserError(
            f"the tokenizer has {tok.vocab_size} ids, {run_dir}'s model only {model.vocab_size}"
        )
    return model.to(device or torch.device("cpu")), tok


def _sample(model: nn.Module, ids: list[int], tokens: int, opts: dict[str, Any]) -> list[int]:
    """Return the ``tokens`` new ids sampled after ``ids``."""
    gen = torch.Generator().manual_seed(opts.pop("seed"))
    out = model.generate(torch.tensor([ids]), tokens, gen=gen, **opts)[0].tolist()
    return out[len(ids) :]


def generate(
    run_dir: Path,
    prompt: str,
    tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    step: int | None = None,
    allow_unverified: bool = False,
    tokenizer: Path | None = None,
) -> str:
    """Return ``prompt`` followed by up to ``tokens`` sampled tokens, decoded; the text ends
    before an EOS id (the tokenizer's, or any of the imported config.json's). The prompt starts
    with BOS where the tokenizer has one."""
    model, tok = load_run_model(
        run_dir, step=step, allow_unverified=allow_unverified, tokenizer=tokenizer
    )
    say_step(model)
    ids = tok.with_bos(tok.encode_batch([prompt])[0]) or [tok.eos_id]
    opts = {"temperature": temperature, "top_k": top_k, "seed": seed}
    new = _sample(model, ids, tokens, opts)
    stops = stop_ids(special_ids(Path(run_dir), tok)) | {tok.eos_id}
    ends = [i for i, token in enumerate(new) if token in stops]
    new = new[: ends[0]] if ends else new
    if tok.kind == "byte":
        return prompt + bytes(new).decode("utf-8", errors="replace")
    return prompt + tok.decode(new)


def generate_ids(
    run_dir: Path,
    prompt_ids: list[int],
    tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    step: int | None = None,
    allow_unverified: bool = False,
) -> list[int]:
    """Return ``prompt_ids`` followed by up to ``tokens`` sampled ids, with no tokenizer.

    Sampling stops after the run's EOS id (its tokenizer's, or the imported config.json's),
    which ends the list.
    """
    model = load_model(run_dir, step, allow_unverified)
    say_step(model)
    bad = [i for i in prompt_ids if not 0 <= i < model.vocab_size]
    if not prompt_ids or bad:
        raise UserError(
            f"--prompt-ids needs ids from 0 to {model.vocab_size - 1} (the model's vocabulary)"
            + (f"; {bad[0]} is not" if bad else "")
        )
    tok_path = Path(run_dir) / "tokenizer.json"
    tok = load_tokenizer(tok_path) if tok_path.is_file() else None
    stops = stop_ids(special_ids(Path(run_dir), tok))
    opts = {"temperature": temperature, "top_k": top_k, "seed": seed}
    new = _sample(model, prompt_ids, tokens, opts)
    ends = [i for i, token in enumerate(new) if token in stops]
    return prompt_ids + (new[: ends[0] + 1] if ends else new)


def special_ids(run_dir: Path, tok: Tokenizer | None) -> dict[str, Any]:
    """Return a run's ``bos_token_id`` and ``eos_token_id``: those of the config.json it was
    imported from when they agree with its tokenizer (Llama 3 Instruct's list of EOS ids,
    say), else its tokenizer's, else the imported ones, else none."""
    imported: dict[str, Any] = {}
    path = Path(run_dir) / IMPORTED_CONFIG
    if path.is_file():
        hf = json.loads(path.read_text())
        imported = {k: hf.get(k) for k in ("bos_token_id", "eos_token_id")}
    if tok is None:
        return imported
    if tok.eos_id in stop_ids(imported):
        return imported
    return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}


def stop_ids(special: dict[str, Any]) -> set[int]:
    """Return the ids that end a generation: ``special``'s ``eos_token_id`` (one, or a list)."""
    eos = special.get("eos_token_id")
    return set(eos) if isinstance(eos, list) else set() if eos is None else {eos}
