"""``hpcllm generate``: load a run's latest checkpoint and sample text from a prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from hpcllm.config import config_from_dict
from hpcllm.datasets.tokenizer import load_tokenizer
from hpcllm.errors import UserError
from hpcllm.model.gpt import GPT
from hpcllm.train import checkpoint


def load_run_model(run_dir: Path, device: torch.device | None = None) -> tuple[GPT, Any]:
    """Return (model in eval mode, tokenizer) from a run folder's latest checkpoint."""
    run_dir = Path(run_dir)
    folder = checkpoint.latest(run_dir)
    if folder is None:
        raise UserError(f"{run_dir} has no checkpoint (no checkpoints/latest)")
    cfg = config_from_dict(yaml.safe_load((folder / "config.yaml").read_text()))
    meta = checkpoint.read_meta(folder)
    if (meta["tp"], meta["pp"]) != (1, 1):
        raise UserError(
            f"{folder} is sharded (tp={meta['tp']}, pp={meta['pp']}); generate "
            "reads tp=1, pp=1 checkpoints: merge tensor-parallel shards with "
            "hpcllm convert --tp 1 (pipeline stages cannot be merged yet)"
        )
    shard = checkpoint.load_shard(folder, 0, 0, 1, 1)
    model = GPT(cfg.model, meta["vocab_size"], seed=cfg.train.seed)
    model.load_state_dict(shard["model"])
    tokenizer_path = run_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise UserError(f"{tokenizer_path} is missing; it is copied there when training starts")
    return model.to(device or torch.device("cpu")).eval(), load_tokenizer(tokenizer_path)


def generate(
    run_dir: Path,
    prompt: str,
    tokens: int = 100,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> str:
    """Return ``prompt`` followed by ``tokens`` sampled tokens, decoded."""
    model, tokenizer = load_run_model(run_dir)
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
