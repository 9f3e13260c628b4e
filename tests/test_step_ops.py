"""A CPU proxy for launch overhead: hpcllm's training step dispatches no more aten ops than plain
PyTorch's.

On a GPU every aten operator is at least one kernel launch, and a small model's step is bound
by launches; on the CPU the two step times are equal whatever the count, so the count is what
a test here can hold. One training step of a 4-layer, d 256, seq 128 GPT, kernels off and
``model.compile: none``: hpcllm's ``Trainer.train_step`` (schedule, engine, global-norm
clipping, AMP scaler) against the plain nanoGPT-style model and loop of ``bench step``, same
shapes and precision. Both counts are printed on failure, with the ops that differ. The
step must not read anything back from the device either (bf16 and fp32).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpcllm.bench.step import plain_optimizer
from hpcllm.config import load_config
from hpcllm.model.plain_gpt2 import PlainGPT2
from hpcllm.train.trainer import Trainer

SHAPE = {"n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 128}
MICRO_BATCH = 4


class _CountOps(TorchDispatchMode):
    """Count every aten operator that reaches the backend kernels, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _hpcllm_ops(stdlib: Path, run_dir: Path, precision: str) -> tuple[collections.Counter, Any]:
    overrides = [f"model.{k}={v}" for k, v in SHAPE.items()] + [
        "model.preset=null",
        "model.fused_kernels=off",
        "model.compile=none",
        f"train.micro_batch_size={MICRO_BATCH}",
        f"train.global_batch_size={MICRO_BATCH}",
        f"train.precision={precision}",
        "train.grad_clip=1.0",
        f"data.path={stdlib}",
        f"run.dir={run_dir}",
        "run.resume=none",
        "run.tensorboard=false",
    ]
    with Trainer(load_config(None, overrides)) as trainer:
        batches = iter(trainer.reader)
        trainer.train_step(batches)  # the first step creates the optimizer state
        with _CountOps() as count:
            trainer.train_step(batches, wait=False)  # as the loop runs steps it does not log
        batch = next(batches)
        batches.close()
        vocab = trainer.vocab_size
    return count.ops, (batch, vocab)


def _plain_ops(batch: Any, vocab: int, precision: str) -> collections.Counter:
    sizes = [f"model.{k}={v}" for k, v in SHAPE.items()]
    model = PlainGPT2(load_config(None, sizes).model, (vocab + 63) // 64 * 64)
    optimizer = plain_optimizer(model, 1e-3, 0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    ids = batch.input_ids.reshape(-1, SHAPE["seq_len"])[:MICRO_BATCH].contiguous()
    labels = batch.labels.reshape(-1, SHAPE["seq_len"])[:MICRO_BATCH].contiguous()

    def step() -> None:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        with torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
            loss = model(ids, labels)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    step()
    with _CountOps() as count:
        step()
    return count.ops


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_dispatches_at_most_5_percent_more_ops_than_plain_pytorch(
    stdlib: Path, tmp_path: Path, precision: str
) -> None:
    ours, (batch, vocab) = _hpcllm_ops(stdlib, tmp_path / "run", precision)
    plain = _plain_ops(batch, vocab, precision)
    difference = collections.Counter(ours)
    difference.subtract(plain)
    extra = {op: n for op, n in difference.most_common() if n}
    assert sum(plain.values()) > 400  # forward, backward and AdamW of 4 blocks were counted
    # No host read of a tensor (.item(), float()) beyond the plain loop's (foreach AdamW reads
    # its CPU step counters): on a GPU each would make the CPU wait for the step's kernels
    # before it could queue the next step's.
    assert difference["aten._local_scalar_dense"] <= 0, extra
    assert sum(ours.values()) <= 1.05 * sum(plain.values()), (
        f"hpcllm {sum(ours.values())} ops, plain {sum(plain.values())}; difference by op: {extra}"
    )


class _CountWeightCasts(TorchDispatchMode):
    """Count the dtype casts (``_to_copy``) of each of the given tensors, by storage."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.watched = {t.data_ptr() for t in tensors}
        self.casts: collections.Counter[int] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket is torch.ops.aten._to_copy and args[0].data_ptr() in self.watched:
            self.casts[args[0].data_ptr()] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_bf16_casts_each_weight_once_per_step_not_once_per_micro_batch(
    stdlib: Path, tmp_path: Path
) -> None:
    overrides = [f"model.{k}={v}" for k, v in SHAPE.items()] + [
        "model.preset=null",
        "model.n_layer=2",
        "model.fused_kernels=off",
        "model.compile=none",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",  # four micro-batches
        "train.precision=bf16",
        f"data.path={stdlib}",
        f"run.dir={tmp_path}",
        "run.resume=none",
        "run.tensorboard=false",
    ]
    with Trainer(load_config(None, overrides)) as trainer:
        batches = iter(trainer.reader)
        matrices = [p for p in trainer.model.parameters() if p.dim() == 2]
        with _CountWeightCasts(matrices) as count:
            trainer.train_step(batches)
        batches.close()
    # Every matrix feeds a matmul; the position table is added in fp32 and never cast.
    assert len(count.casts) == len(matrices) - 1
    assert set(count.casts.values()) == {1}
