"""After the last backward of a step: finish every gradient, then step the optimizer.

:func:`finish_gradients` completes the gradients in one place, in the order Megatron-Core's
``finalize_model_grads`` does:

1. the data-parallel engine makes the averaged gradients available (DDP reduced them during
   the backward, Horovod waits for its all-reduces, the parameter server reduces to its root);
2. whole parameters used in sequence-parallel regions (LayerNorms, row-parallel biases,
   positions) sum their partial gradients over the tensor-parallel group;
3. the tied embedding's two copies, on the first and the last pipeline stage, sum theirs.

:func:`optimizer_step` is the default step: unscale, clip by the global norm across tp and
pp, step under the AMP scaler, update the scale. :func:`step` hands it to the engine's one
hook, :meth:`Engine.step <hpcllm.parallel.data_parallel.Engine.step>`: DDP runs it as it is,
Horovod runs it without a second synchronisation of its optimizer, and the parameter server
runs it on its root alone, then broadcasts the new weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcllm.parallel.data_parallel import Engine
from hpcllm.parallel.tensor.layers import is_split
from hpcllm.parallel.tensor.mappings import group_size


def reduce_sequence_parallel_grads(model: nn.Module, group: Any) -> None:
    """Sum over the tp group the gradients of whole parameters used in sequence-parallel regions.

    LayerNorms, row-parallel biases and positions are whole on every tp rank, but under
    sequence parallelism each rank sees only its part of the sequence, so each holds a partial
    gradient. One all-reduce of the flattened gradients completes them (Megatron does the same).
    """
    if group_size(group) == 1:
        return
    grads = [
        p.grad
        for p in model.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, reduced in zip(
        grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
    ):
        grad.copy_(reduced)


def sync_tied_embedding(chunks: nn.ModuleList, group: Any) -> None:
    """Sum the embedding's gradient over its first-stage and last-stage copies."""
    if group is None:
        return
    for chunk in chunks:
        if (chunk.pre or chunk.post) and not (chunk.pre and chunk.post):
            grad = chunk.wte.weight.grad
            if grad is None:
                grad = chunk.wte.weight.grad = torch.zeros_like(chunk.wte.weight)
            dist.all_reduce(grad, group=group)


def finish_gradients(
    chunks: nn.ModuleList,
    engine: Engine,
    optimizer: torch.optim.Optimizer,
    tp_group: Any = None,
    embedding_group: Any = None,
) -> None:
    """Complete every gradient of this rank's chunks after the step's last backward.

    The tp and tied-embedding sums are linear, so they may come before or after the data-
    parallel average: after it for engines that write the averaged gradient over ``.grad``
    (Horovod's synchronize would overwrite an earlier sum), before it for the distributed
    optimizer, whose reduce-scatter leaves each rank 1/d of the gradient.
    """
    if engine.reduces_after_model_grads:
        reduce_sequence_parallel_grads(chunks, tp_group)
        sync_tied_embedding(chunks, embedding_group)
        engine.finish_gradients(optimizer)
        return
    engine.finish_gradients(optimizer)
    reduce_sequence_parallel_grads(chunks, tp_group)
    sync_tied_embedding(chunks, embedding_group)


def global_grad_norm(
    parameters: Sequence[torch.Tensor], tp_group: Any = None, pp_group: Any = None
) -> torch.Tensor:
    """Return the L2 norm of the whole model's gradient, across tp slices and pp stages.

    Sliced parameters contribute their squares from every tp rank (an all-reduce); whole
    ones (LayerNorm, row-parallel biases, positions) hold the same gradient on every tp rank
    and are counted once. Each pipeline stage holds different parameters, so the stages' sums
    are added; a parameter marked ``pipeline_duplicate`` (the last stage's copy of the tied
    embedding) is not counted, since the first stage counts it.
    """
    counted = [
        p for p in parameters if p.grad is not None and not getattr(p, "pipeline_duplicate", False)
    ]
    if not counted and group_size(tp_group) == 1 and group_size(pp_group) == 1:
        return torch.zeros(())
    device = counted[0].grad.device if counted else parameters[0].device
    # With one tp rank every parameter is whole; otherwise split and whole ones sum apart.
    tp = group_size(tp_group) > 1
    split = _squared_norm([p.grad for p in counted if tp and is_split(p)], device)
    whole = _squared_norm([p.grad for p in counted if not (tp and is_split(p))], device)
    if group_size(tp_group) > 1:
        dist.all_reduce(split, group=tp_group)
    total = split + whole
    if group_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def _squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Return the fp32 sum of squares of ``grads``: one foreach kernel, as clip_grad_norm_."""
    if not grads:
        return torch.zeros((), device=device)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).square()


def _clip(parameters: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    grads = [p.grad for p in parameters if p.grad is not None]
    if max_norm > 0 and grads:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)


def clip_grad_norm(
    parameters: Sequence[torch.Tensor], max_norm: float, tp_group: Any = None, pp_group: Any = None
) -> torch.Tensor:
    """Clip gradients to ``max_norm`` (0: no clipping) by the global norm; return that norm."""
    norm = global_grad_norm(parameters, tp_group, pp_group)
    _clip(parameters, max_norm, norm)
    return norm


def optimizer_step(
    parameters: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    clip: float,
    tp_group: Any = None,
    pp_group: Any = None,
    norm_fn: Callable[[], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscale, clip, step and update the scaler; return (grad norm, step skipped).

    ``parameters`` hold the gradients the optimizer steps with; ``norm_fn`` returns their
    global norm (default: :func:`global_grad_norm` across tp and pp).

    Both are 0-d device tensors. A step whose gradients are not finite on any tp or pp rank
    (the global norm is not) is skipped on all of them, in every precision, so a NaN never
    reaches the weights:

    - Under fp16 the overflow must also back off every rank's scale alike, as Megatron-LM
      does by all-reducing found-inf. The global norm spans those ranks, so it is computed
      first, on the scaled gradients (the scale is a power of two: dividing by it afterwards
      is exact). Where it is not finite but this rank's own gradients are, one of them is set
      to inf before ``unscale_``, so that the scaler finds the overflow itself and skips and
      backs off through its public interface. fp16 reads its overflow back on the host, as
      the scaler does.
    - Under bf16 and fp32 a fused AdamW (hpcllm's, on CUDA and CPU) takes the verdict on the
      device (its ``found_inf``, the argument GradScaler feeds it), so nothing is read back;
      another optimizer reads it on the host.
    """
    enabled = scaler.is_enabled()
    scale = scaler.get_scale() if enabled else 1.0
    norm = norm_fn() if norm_fn else global_grad_norm(parameters, tp_group, pp_group)
    if enabled:
        if not torch.isfinite(norm):
            grad = next((p.grad for p in parameters if p.grad is not None), None)
            if grad is not None:
                grad[(0,) * grad.dim()] = float("inf")
        scaler.unscale_(optimizer)
        norm = norm / scale
        _clip(parameters, clip, norm)
        scaler.step(optimizer)
        scaler.update()
        return norm, torch.tensor(scaler.get_scale() < scale, device=norm.device)
    bad = ~torch.isfinite(norm)
    _clip(parameters, clip, norm)
    if all(group.get("fused") for group in optimizer.param_groups):
        optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
    elif not bool(bad):
        optimizer.step()
    # No host read of the norm: on a GPU the next step's kernels queue behind this one's.
    return norm, bad


def step(
    engine: Engine,
    parameters: Sequence[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    clip: float,
    tp_group: Any = None,
    pp_group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step the optimizer through the engine; return (grad norm, step skipped), on device."""
    sharded = engine.gradients_for_step(tp_group, pp_group)
    stepped, norm_fn = sharded if sharded is not None else (parameters, None)
    return engine.step(
        optimizer,
        scaler,
        lambda: optimizer_step(stepped, optimizer, scaler, clip, tp_group, pp_group, norm_fn),
    )
