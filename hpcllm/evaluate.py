"""``hpcllm evaluate``: a checkpoint's loss and perplexity on a prepared dataset.

The checkpoint may be of any layout: its weights are merged into one GPT on one process
(:func:`hpcllm.generate.load_run_model`). Micro-batches come in the order the trainer's
validation reads them (the epoch-0 permutation of ``data.seed``), so ``--micro-batch-size``
set to the run's d × micro-batch size and ``--iters`` to ``train.eval_iters`` give the
``val_loss`` the run logged at that step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from hpcllm.config import BatchPlan
from hpcllm.datasets.reader import MicroBatchReader
from hpcllm.datasets.shards import load_manifest
from hpcllm.datasets.synthetic import check_run_data
from hpcllm.errors import UserError
from hpcllm.generate import merged_model
from hpcllm.train.reshard import select


@dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate` measured."""

    loss: float  # mean cross-entropy per token, in nats
    perplexity: float
    samples: int
    tokens: int
    step: int  # the checkpoint's (the newest that verifies, or the one asked for)

    def line(self) -> str:
        """Return the result as the one line ``hpcllm evaluate`` prints."""
        return (
            f"step {self.step}: loss {self.loss:.4f}  perplexity {self.perplexity:.2f}  "
            f"({self.samples} samples, {self.tokens} tokens)"
        )


@torch.no_grad()
def evaluate(
    run_dir: Path,
    data: Path,
    *,
    step: int | None = None,
    split: str = "val",
    micro_batch_size: int | None = None,
    iters: int | None = None,
    seed: int | None = None,
    allow_unverified: bool = False,
) -> Evaluation:
    """Return the mean loss of a run's checkpoint over micro-batches of ``data``'s ``split``.

    ``micro_batch_size`` and ``seed`` default to the run's; ``iters`` (micro-batches) to one
    pass over the split.
    """
    model, run_cfg = merged_model(select(run_dir, step, allow_unverified), verified=True)
    cfg = model.cfg
    manifest = load_manifest(data)
    check_run_data(Path(run_dir), manifest, f"the run {run_dir}")
    if manifest.vocab_size > model.vocab_size:
        raise UserError(
            f"{data} was tokenized with {manifest.vocab_size} tokens, more than the model's "
            f"vocabulary of {model.vocab_size}; evaluate on data prepared with the run's "
            "tokenizer"
        )
    reader = MicroBatchReader(
        manifest,
        split=split,
        seq_len=cfg.seq_len,
        micro_batch_size=micro_batch_size or run_cfg.train.micro_batch_size,
        seed=run_cfg.data.seed if seed is None else seed,
        prefetch=2,
    )
    iters = min(iters or reader.steps_per_epoch, reader.steps_per_epoch)
    total = torch.zeros((), dtype=torch.float64)
    batches = iter(reader)
    try:
        for _ in range(iters):
            batch = next(batches)
            total += model(batch.input_ids, batch.labels).double()
    finally:
        batches.close()
    loss = (total / iters).item()
    samples = BatchPlan(reader.micro_batch_size, iters, 1).samples_per_rank
    return Evaluation(
        loss, math.exp(min(loss, 700.0)), samples, samples * cfg.seq_len, model.checkpoint_step
    )
