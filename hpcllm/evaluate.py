"""``hpcllm evaluate``: a checkpoint's loss and perplexity on a prepared dataset.

The checkpoint may be of any layout: its weights are merged into one GPT on one process
(:func:`hpcllm.generate.load_run_model`). Micro-batches come in the order the trainer's
validation reads them (the epoch-0 permutation of ``data.seed``), so ``--micro-batch-size``
set to the run's d × micro-batch size and ``--iters`` to ``train.eval_iters`` give the
``val_loss`` the run logged at that step.

``--seq-len`` evaluates at another length than the run's ``model.seq_len``: at most that for
learned positions (GPT-2's, one weight per position); any for rotary ones (Llama), which hold
no weights, though beyond the trained length the loss measures how the model extrapolates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpcllm import families
from hpcllm.config import BatchPlan
from hpcllm.datasets.reader import MicroBatchReader
from hpcllm.datasets.shards import load_manifest
from hpcllm.datasets.synthetic import check_run_data
from hpcllm.errors import UserError
from hpcllm.generate import merged_model
from hpcllm.model.documents import DocumentMasks
from hpcllm.train.reshard import checkpoint_config, select


@dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate` measured."""

    loss: float  # mean cross-entropy per token, in nats
    perplexity: float
    samples: int
    tokens: int
    step: int  # the checkpoint's (the newest that verifies, or the one asked for)
    seq_len: int  # tokens per sample

    def line(self) -> str:
        """Return the result as the one line ``hpcllm evaluate`` prints."""
        return (
            f"step {self.step}: loss {self.loss:.4f}  perplexity {self.perplexity:.2f}  "
            f"({self.samples} samples of {self.seq_len} tokens, {self.tokens} tokens)"
        )


def _length(trained: Any, seq_len: int | None) -> int:
    """Return the tokens per sample to evaluate at: ``seq_len``, or the run's; a UserError
    where the model's positions are weights and ``seq_len`` is longer than they go."""
    if seq_len is None:
        return int(trained.seq_len)
    if seq_len > trained.seq_len and families.get(trained.arch).seq_in_weights:
        raise UserError(
            f"--seq-len {seq_len} is longer than the {trained.seq_len} positions the "
            f"{trained.arch} model has weights for (its model.seq_len); give at most "
            f"{trained.seq_len}"
        )
    return seq_len


def _check_split(manifest: Any, data: Path, split: str, seq_len: int, micro_batch: int) -> None:
    """Raise a UserError, naming this command's options, where ``split`` holds fewer samples
    of ``seq_len`` tokens than one micro-batch."""
    tokens = manifest.n_tokens(split)
    if tokens == 0:
        way = "; evaluate --split train, or prepare with a larger --val-fraction"
        raise UserError(f"the {split} split of {data} is empty" + (way if split == "val" else ""))
    samples = max(0, (tokens - 1) // seq_len)
    if samples < micro_batch:
        raise UserError(
            f"the {split} split of {data} holds {samples} samples of {seq_len} tokens, fewer "
            f"than one micro-batch of {micro_batch}; give a shorter --seq-len or a smaller "
            "--micro-batch-size, or evaluate on more data"
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
    seq_len: int | None = None,
) -> Evaluation:
    """Return the mean loss of a run's checkpoint over micro-batches of ``data``'s ``split``.

    ``micro_batch_size`` and ``seed`` default to the run's; ``iters`` (micro-batches) to one
    pass over the split; ``seq_len`` (tokens per sample) to the run's ``model.seq_len`` (see
    the module docstring for another).
    """
    folder = select(run_dir, step, allow_unverified)
    saved = checkpoint_config(folder)
    length = _length(saved.model, seq_len)
    micro_batch = micro_batch_size or saved.train.micro_batch_size
    manifest = load_manifest(data)
    check_run_data(Path(run_dir), manifest, f"the run {run_dir}")
    _check_split(manifest, Path(data), split, length, micro_batch)
    model, run_cfg = merged_model(folder, verified=True, seq_len=length)
    if manifest.vocab_size > model.vocab_size:
        raise UserError(
            f"{data} was tokenized with {manifest.vocab_size} tokens, more than the model's "
            f"vocabulary of {model.vocab_size}; evaluate on data prepared with the run's "
            "tokenizer"
        )
    reader = MicroBatchReader(
        manifest,
        split=split,
        seq_len=length,
        micro_batch_size=micro_batch,
        seed=run_cfg.data.seed if seed is None else seed,
        prefetch=2,
    )
    iters = min(iters or reader.steps_per_epoch, reader.steps_per_epoch)
    # The run's own reading of the packed documents (data.reset_attention_at_eos and
    # data.mask_eod_loss), so the loss is the one its validation logged.
    documents = DocumentMasks.of(run_cfg.data, manifest.eos_id) or DocumentMasks(manifest.eos_id)
    total = torch.zeros((), dtype=torch.float64)
    batches = iter(reader)
    try:
        for _ in range(iters):
            batch = next(batches)
            ids = batch.input_ids
            labels = documents.labels(ids, batch.labels)
            total += model(ids, labels, **documents.keywords(ids)).double()
    finally:
        batches.close()
    loss = (total / iters).item()
    samples = BatchPlan(reader.micro_batch_size, iters, 1).samples_per_rank
    return Evaluation(
        loss, math.exp(min(loss, 700.0)), samples, samples * length, model.checkpoint_step, length
    )
