"""``hpcllm bench generate``: sampling with and without the KV cache, on random weights.

Per model (a preset of any family, at ``--seq-len``), one prompt of ``--prompt`` random
token ids and ``--tokens`` new tokens at temperature 0, by
:meth:`hpcllm.model.decoder.Decoder.generate` with ``kv_cache`` on and off, in alternating
runs; each side's figure is the median of ``--repeats`` runs. The cached tokens must be the
uncached ones (the run fails otherwise), and the speed-up is the uncached median over the
cached one. Torch runs ``--threads`` threads; ``--device`` (the CPU by default, or a GPU) holds the
model, in fp32 (two orders of the same sums must pick the same tokens), and each timed run ends
when the GPU is done.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.files import atomic_write


def bench_model(
    preset: str,
    prompt: int,
    tokens: int,
    seq_len: int,
    repeats: int,
    vocab: int,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Return one model's cached and uncached times (median seconds) and whether the tokens
    agree."""
    from hpcllm import families
    from hpcllm.model import build

    family = families.preset_family(preset)
    if family is None:
        known = ", ".join(families.presets())
        raise UserError(f"--models: {preset} is no family's preset ({known})")
    sets = [f"model.arch={family}", f"model.preset={preset}", f"model.seq_len={seq_len}"]
    cfg = load_config(None, [*sets, "model.dropout=0"]).model
    device = device or torch.device("cpu")
    model = build(cfg, vocab).to(device).eval()
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    runs: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, torch.Tensor] = {}
    for r in range(repeats):
        for cached in (True, False) if r % 2 == 0 else (False, True):
            began = time.perf_counter()
            outputs[cached] = model.generate(ids, tokens, temperature=0, kv_cache=cached)
            sync()
            runs[cached].append(time.perf_counter() - began)
    same = torch.equal(outputs[True], outputs[False])
    if not same:
        raise UserError(f"{preset}: the cached tokens differ from the uncached ones")
    cached, uncached = statistics.median(runs[True]), statistics.median(runs[False])
    return {
        "model": preset,
        "family": family,
        "layers": cfg.n_layer,
        "d_model": cfg.d_model,
        "cached_s": cached,
        "uncached_s": uncached,
        "cached_runs_s": runs[True],
        "uncached_runs_s": runs[False],
        "speedup": uncached / cached,
        "same_tokens": same,
    }


def run(
    models: list[str],
    prompt: int,
    tokens: int,
    seq_len: int,
    repeats: int,
    threads: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """Return every model's row (see the module docstring)."""
    torch.set_num_threads(threads)
    try:
        where = torch.device(device)
    except RuntimeError as err:
        raise UserError(f"--device {device}: {err}") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no GPU here")
    if where.type not in ("cpu", "cuda"):
        raise UserError(f"--device {device}: cpu or cuda[:N]")
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {device}: torch sees {torch.cuda.device_count()} GPU(s) here")
    vocab = 512
    return {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu",
        "threads": threads,
        "prompt": prompt,
        "tokens": tokens,
        "seq_len": seq_len,
        "repeats": repeats,
        "vocab": vocab,
        "rows": [bench_model(m, prompt, tokens, seq_len, repeats, vocab, where) for m in models],
    }


def render(result: dict[str, Any]) -> str:
    """Return the result as a table."""
    lines = [
        f"torch {result['torch']} on {result.get('device', 'cpu')}, {result['threads']} threads: "
        f"{result['tokens']} tokens after "
        f"a {result['prompt']}-token prompt, seq_len {result['seq_len']}, temperature 0; "
        f"medians of {result['repeats']} runs each",
        "",
        "| model | layers | d_model | uncached s | KV cache s | speed-up | same tokens |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['d_model']} | {r['uncached_s']:.3f} "
            f"| {r['cached_s']:.3f} | {r['speedup']:.2f}x | {'yes' if r['same_tokens'] else 'NO'} |"
        )
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Write the result as JSON, whole or not at all."""
    atomic_write(path, json.dumps(result, indent=2) + "\n")
