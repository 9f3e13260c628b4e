"""The gradient sums that complete a model's gradients, and the global gradient norm.

What every engine's :meth:`~hpcllm.parallel.data.engine.Engine.finalize_grads` runs besides
its own reduction over d, as Megatron-Core's ``finalize_model_grads`` does:

a sum of each gradient kind a parameter's role names (:mod:`hpcllm.parallel.roles`), each over
its own group (:data:`SUMS`):

1. ``tp-sum-if-sequence-parallel``: whole parameters used in sequence-parallel regions
   (norms, row-parallel biases, positions) sum their partial gradients over the
   tensor-parallel group, in one all-reduce with item 4's;
2. ``tied``: the tied embedding's two copies, on the first and the last pipeline stage, sum
   theirs over the embedding group;
3. ``kv-replicas``: a key/value head kept on several tp ranks (grouped-query attention with
   fewer heads than ranks) sums its gradient over the ranks that hold it;
4. ``tp-sum``: whole parameters applied to each rank's own heads (per-head q and k norms)
   sum theirs over the tensor-parallel group.

All are linear, so they may come before or after the data-parallel average: an engine puts
them where its reduction needs them. :func:`global_grad_norm` is the norm the optimizer clips
by and skips on; it counts each tensor once, as the roles say.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcllm.parallel.roles import GRADIENT_KINDS, role
from hpcllm.parallel.tensor.mappings import group_size
from hpcllm.topology import ProcessGroups


def reduce_whole_grads_over_tp(params: Iterable[nn.Parameter], group: Any) -> None:
    """Sum over the tp group the gradients of whole parameters each rank saw a part of.

    ``tp-sum-if-sequence-parallel``: LayerNorms, row-parallel biases and positions are whole on
    every tp rank, but under sequence parallelism each rank sees only its part of the
    sequence, so each holds a partial gradient (Megatron sums them the same way).
    ``tp-sum``: whole parameters each rank applies to its own heads (Qwen3's q and k norms).
    One all-reduce of the flattened gradients of both completes them.
    """
    if group_size(group) == 1:
        return
    kinds = set(WHOLE_OVER_TP)
    grads = [p.grad for p in params if kinds & set(role(p).sums) and p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, reduced in zip(
        grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
    ):
        grad.copy_(reduced)


def sum_tied_grads(params: Iterable[nn.Parameter], group: Any) -> None:
    """Sum over ``group`` (the first and last stage) the gradient of each parameter whose
    role takes the tied sum: the tied embedding's two copies. Nothing when ``group`` is None."""
    if group is None:
        return
    for p in params:
        if "tied" in role(p).sums:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)


def sum_kv_replica_grads(params: Iterable[nn.Parameter], group: Any) -> None:
    """Sum the gradient of each key/value head over the tp ranks that hold it (their role's
    ``replicas``: rank r holds head r // replicas): one all-reduce over the tp group of every
    head's slot, this rank's gradient in its own head's slot."""
    t = group_size(group)
    replicated = [p for p in params if "kv-replicas" in role(p).sums]
    if t == 1 or not replicated:
        return
    rank = dist.get_rank(group)
    grads = []
    for p in replicated:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        heads = t // role(p).replicas
        slots = p.grad.new_zeros(heads, *p.grad.shape)
        slots[rank // role(p).replicas] = p.grad
        grads.append(slots)
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for p, summed in zip(
        replicated, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
    ):
        p.grad.copy_(summed[rank // role(p).replicas])


# The gradient kinds of whole tensors summed over tp, which one all-reduce completes.
WHOLE_OVER_TP = ("tp-sum-if-sequence-parallel", "tp-sum")

# The sums of the gradient kinds (GRADIENT_KINDS names each kind's group; kinds summed
# together share one), in the order they run; a new kind is one more entry.
SUMS: dict[tuple[str, ...], Callable[[Sequence[nn.Parameter], Any], None]] = {
    WHOLE_OVER_TP: reduce_whole_grads_over_tp,
    ("tied",): sum_tied_grads,
    ("kv-replicas",): sum_kv_replica_grads,
}


def finalize_model_grads(params: Sequence[nn.Parameter], groups: ProcessGroups) -> None:
    """Run every gradient kind's sum on ``params`` (a rank's parameters, in chunk order), each
    over its group: whole tensors over tp, tied over the embedding group, kv over tp."""
    for kinds, run in SUMS.items():
        run(params, getattr(groups, GRADIENT_KINDS[kinds[0]].group))


def global_grad_norm(
    parameters: Sequence[torch.Tensor],
    tp_group: Any = None,
    pp_group: Any = None,
    ep_group: Any = None,
) -> torch.Tensor:
    """Return the L2 norm of the whole model's gradient, across tp slices, pp stages and the
    experts split over the ep ranks (their squares summed over ``ep_group``).

    Sliced parameters contribute their squares from every tp rank (an all-reduce); whole
    ones (LayerNorm, row-parallel biases, positions) hold the same gradient on every tp rank
    and are counted once. Each pipeline stage holds different parameters, so the stages' sums
    are added. A tensor held twice is counted where its role says (``TensorRole.counted``):
    the tied embedding on the first stage, a key/value head on the first rank holding it.
    """
    counted = [p for p in parameters if p.grad is not None and role(p).counted]
    ep = group_size(ep_group) > 1
    if not counted and group_size(tp_group) == 1 and group_size(pp_group) == 1 and not ep:
        return torch.zeros(())
    device = counted[0].grad.device if counted else parameters[0].device
    # With one tp rank every parameter is whole; otherwise split and whole ones sum apart.
    tp = group_size(tp_group) > 1
    experts = [p for p in counted if role(p).experts > 1]
    counted = [p for p in counted if role(p).experts == 1]
    split = _squared_norm([p.grad for p in counted if tp and role(p).split], device)
    whole = _squared_norm([p.grad for p in counted if not (tp and role(p).split)], device)
    if ep:
        # Each ep rank holds other experts (every one of them split over t, or whole at t = 1).
        held = _squared_norm([p.grad for p in experts], device)
        dist.all_reduce(held, group=ep_group)
        if tp:
            split = split + held
        else:
            whole = whole + held
    if tp:
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


def clip_to_norm(parameters: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of ``parameters`` so that their norm ``norm`` is at most
    ``max_norm`` (0: no clipping); on the device, nothing read back."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if max_norm > 0 and grads:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)


def clip_grad_norm(
    parameters: Sequence[torch.Tensor],
    max_norm: float,
    tp_group: Any = None,
    pp_group: Any = None,
    ep_group: Any = None,
) -> torch.Tensor:
    """Clip gradients to ``max_norm`` (0: no clipping) by the global norm; return that norm."""
    norm = global_grad_norm(parameters, tp_group, pp_group, ep_group)
    clip_to_norm(parameters, max_norm, norm)
    return norm
