"""``hpcllm convert --tp N``: a checkpoint saved at one tensor-parallel size, re-cut for another.

Through a consolidated form: every tensor-parallel slice (weights and Adam's moments) is
merged into the whole tensor, the embedding's padding rows are dropped, then the whole
tensors are cut for the new size (padding the vocabulary to 128·t again, with zeros). The
optimizer's step, the loss scale, the data position and the RNG states carry over, so the
converted run resumes where the original stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from hpcllm.config import config_from_dict, load_yaml, padded_vocab
from hpcllm.errors import UserError
from hpcllm.model.gpt import GPT
from hpcllm.parallel.tensor.layers import merge_shards, shard_of
from hpcllm.train import checkpoint


def _template(folder: Path) -> tuple[Any, GPT, int]:
    cfg = config_from_dict(load_yaml((folder / "config.yaml").read_text()))
    vocab = checkpoint.read_meta(folder)["vocab_size"]
    # A t = 1 model gives every parameter's name, shape class and how tp slices it.
    return cfg, GPT(cfg.model, vocab), vocab


def _optimizer_names(model: GPT) -> list[str]:
    """Return parameter names in the optimizer's index order (see build_optimizer)."""
    named = list(model.named_parameters())
    return [n for n, p in named if p.dim() >= 2] + [n for n, p in named if p.dim() < 2]


def _merge(
    name: str, parts: list[torch.Tensor], partition: tuple[int, int] | None, vocab: int
) -> torch.Tensor:
    whole = merge_shards(parts, *partition) if partition else parts[0]
    return whole[:vocab] if name == "wte.weight" else whole


def _cut(
    name: str,
    whole: torch.Tensor,
    partition: tuple[int, int] | None,
    vocab: int,
    rank: int,
    tp: int,
) -> torch.Tensor:
    if name == "wte.weight":
        rows = padded_vocab(vocab, tp)
        whole = torch.cat([whole, whole.new_zeros(rows - vocab, *whole.shape[1:])])
    return shard_of(whole, *partition, rank, tp).clone() if partition else whole.clone()


def reshard(folder: Path, tp: int) -> tuple[list[dict[str, Any]], dict[str, Any], Any]:
    """Return (one shard per new tp rank, meta, config) for a checkpoint folder."""
    cfg, template, vocab = _template(folder)
    meta = checkpoint.read_meta(folder)
    if meta["pp"] != 1:
        raise UserError(
            f"{folder} has pp={meta['pp']}; converting pipeline stages is not supported yet"
        )
    if cfg.model.n_head % tp:
        raise UserError(f"model.n_head {cfg.model.n_head} is not divisible by --tp {tp}")
    old = [checkpoint.load_shard(folder, r, 0, meta["tp"], 1) for r in range(meta["tp"])]
    partition = {n: getattr(p, "partition", None) for n, p in template.named_parameters()}
    whole = {n: _merge(n, [s["model"][n] for s in old], partition[n], vocab) for n in partition}
    names = _optimizer_names(template)
    moments: dict[int, dict[str, Any]] = {}
    if old[0].get("optimizer") is not None:
        for index, state in old[0]["optimizer"]["state"].items():
            name = names[index]
            moments[index] = {
                key: (
                    _merge(
                        name,
                        [s["optimizer"]["state"][index][key] for s in old],
                        partition[name],
                        vocab,
                    )
                    if torch.is_tensor(value) and value.dim() > 0
                    else value
                )
                for key, value in state.items()
            }
    shards = []
    for rank in range(tp):
        shard = {k: v for k, v in old[0].items() if k not in ("model", "optimizer")}
        shard["model"] = {n: _cut(n, w, partition[n], vocab, rank, tp) for n, w in whole.items()}
        if old[0].get("optimizer") is not None:
            state = {
                index: {
                    key: (
                        _cut(names[index], value, partition[names[index]], vocab, rank, tp)
                        if torch.is_tensor(value) and value.dim() > 0
                        else value
                    )
                    for key, value in entry.items()
                }
                for index, entry in moments.items()
            }
            shard["optimizer"] = {
                "state": state,
                "param_groups": old[0]["optimizer"]["param_groups"],
            }
        shards.append(shard)
    cfg.parallel.tp = tp
    cfg.parallel.dp = None
    return shards, {**meta, "tp": tp}, cfg


def convert_tp(run_dir: Path, out_dir: Path, tp: int) -> Path:
    """Write ``run_dir``'s latest checkpoint, re-cut for ``tp``, as a new run folder."""
    folder = checkpoint.latest(run_dir)
    if folder is None:
        raise UserError(f"{run_dir} has no checkpoint (no checkpoints/latest)")
    if Path(out_dir).resolve() == Path(run_dir).resolve():
        raise UserError("--out must be a new run folder, not the one converted")
    shards, meta, cfg = reshard(folder, tp)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.dump(out_dir / "config.yaml")
    tokenizer = Path(run_dir) / "tokenizer.json"
    if tokenizer.is_file():
        (out_dir / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    step = meta.pop("step")
    checkpoint.write_offline(
        out_dir,
        step,
        {(r, 0): s for r, s in enumerate(shards)},
        {k: v for k, v in meta.items() if k not in ("tp", "pp", "dp")},
        config_yaml,
        tp=tp,
        pp=1,
        dp=meta.get("dp", 1),
    )
    return out_dir
