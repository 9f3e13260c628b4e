"""The packed documents' attention (data.reset_attention_at_eos) on this machine, in one process.

A Llama of ``--preset`` trains forward and backward on samples of ``--seq`` tokens holding
documents of about ``--doc-len`` tokens (end-of-text ids at random), three ways: causal over
the whole sample (no documents), within documents by a boolean mask for
scaled_dot_product_attention, and (on CUDA) within documents by FlexAttention's block mask.
It prints, as JSON and a table:

- the block mask against the boolean mask: the loss and the largest gradient difference, on
  the same weights and samples (fp32, so the rounding is the kernels');
- the compiled graphs each side made after its first step (``--compile``: each block
  compiled, as ``model.compile: blocks`` does): new documents every step must not recompile;
- each side's forward + backward time, the median of ``--steps`` steps after a warm-up,
  taken in alternating rounds, and its ratio to causal attention's.

    python scripts/document_masks.py [--preset llama-tiny] [--seq 2048] [--batch 4]
        [--doc-len 512] [--steps 5] [--rounds 3] [--compile] [--precision bf16]

On the CPU the block mask is skipped (FlexAttention runs there only as its unfused reference)
and the rest runs, at small shapes, as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from hpcllm.config import load_config
from hpcllm.model import build
from hpcllm.model import documents as docmod
from hpcllm.train.parallelize import compile_chunks

EOS = 0  # any id of the vocabulary serves: the ids are random


def _samples(batch: int, seq: int, vocab: int, doc_len: int, seed: int, device: Any) -> Any:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq + 1), generator=gen)
    ids[torch.rand(batch, seq + 1, generator=gen) < 1.0 / doc_len] = EOS
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _step(model: Any, side: str, ids: Any, labels: Any, precision: str) -> tuple[float, Any]:
    """Run one forward and backward of ``side``; return (loss, seconds)."""
    docmod.FLEX_ON_CUDA = side == "flex"
    keywords = {} if side == "causal" else {"documents": docmod.document_ids(ids, EOS)}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype is not None):
        loss = model(ids, labels, **keywords)
    loss.backward()
    sync()
    return loss.item(), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-tiny")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sides = ["causal", "dense"] + (["flex"] if device.type == "cuda" else [])
    sets = ["model.arch=llama", f"model.preset={args.preset}", f"model.seq_len={args.seq}"]
    cfg = load_config(None, [*sets, "model.dropout=0"]).model
    vocab = 8192
    model = build(cfg, vocab).to(device)
    docmod.masks_ready()
    report: dict[str, Any] = {"device": str(device), "torch": torch.__version__, **vars(args)}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name()

    # The block mask against the boolean mask, in fp32 on the same weights and samples.
    ids, labels = _samples(args.batch, args.seq, vocab, args.doc_len, 0, device)
    report["documents_per_sample"] = float((ids == EOS).sum(dim=1).float().mean() + 1)
    grads = {}
    for side in sides[1:]:
        model.zero_grad(set_to_none=True)
        loss, _ = _step(model, side, ids, labels, "fp32")
        grads[side] = (loss, [p.grad.clone() for p in model.parameters()])
    if "flex" in grads:
        (dense_loss, dense), (flex_loss, flex) = grads["dense"], grads["flex"]
        worst = max(
            ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
            for a, b in zip(flex, dense, strict=True)
        )
        report["flex_vs_dense"] = {"loss": [flex_loss, dense_loss], "grad_rel_max": worst}

    if args.compile:
        compile_chunks(torch.nn.ModuleList([model]), "blocks")
    times: dict[str, list[float]] = {side: [] for side in sides}
    graphs: dict[str, int] = {}
    for round_ in range(args.rounds):
        for side in sides:
            first = _samples(args.batch, args.seq, vocab, args.doc_len, round_, device)
            model.zero_grad(set_to_none=True)
            _step(model, side, *first, args.precision)  # warm-up (and compilation)
            before = _graphs()
            for step in range(args.steps):
                batch = _samples(args.batch, args.seq, vocab, args.doc_len, 100 + step, device)
                model.zero_grad(set_to_none=True)
                times[side].append(_step(model, side, *batch, args.precision)[1])
            graphs[side] = graphs.get(side, 0) + _graphs() - before
    causal = statistics.median(times["causal"])
    report["sides"] = {
        side: {
            "step_ms": 1e3 * statistics.median(times[side]),
            "vs_causal": statistics.median(times[side]) / causal,
            "graphs_after_warmup": graphs[side],
        }
        for side in sides
    }
    print(json.dumps(report), flush=True)
    print(f"{'side':<8} {'ms/step':>9} {'vs causal':>10} {'new graphs':>11}")
    for side, row in report["sides"].items():
        print(
            f"{side:<8} {row['step_ms']:>9.2f} {row['vs_causal']:>9.2f}x "
            f"{row['graphs_after_warmup']:>11}"
        )


if __name__ == "__main__":
    main()
