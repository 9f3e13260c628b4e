"""A mixture-of-experts MLP: a router, top-k experts, an optional capacity, balancing losses.

The layer replaces a block's dense MLP (Shazeer et al., 2017; Switch Transformers, Fedus,
Zoph and Shazeer, JMLR 2022). For each token the router scores every expert (a linear layer
without bias, in fp32) and the token goes to the ``top_k`` best; the layer's output is their
outputs weighted by the router. Three routers:

- ``softmax-topk``: softmax over all experts, then the k largest probabilities, divided by
  their sum only when ``renormalize`` (Qwen-MoE's ``norm_topk_prob``);
- ``topk-softmax``: the softmax of the k largest logits (Mixtral), equal to renormalising;
- ``sigmoid``: each expert's sigmoid score (DeepSeek-V3); a balancing ``bias``, a buffer
  updated between optimizer steps (:func:`bias_update`), shifts which experts are chosen but
  not their weights.

A capacity factor c gives each expert ⌈c·k·T/E⌉ slots for the T tokens of a micro-batch;
the assignments over it are dropped (``probs``: the lowest-weighted first; ``position``: the
latest tokens first) and those tokens keep only the residual. Without one (None) no token is
dropped.

The balancing loss of one layer is transformers' ``load_balancing_loss_func`` for one
layer's logits: E · Σₑ fₑ · Pₑ with fₑ the share of the T tokens' k choices that went to e
(summing to k) and Pₑ the mean router probability of e. The router z-loss (ST-MoE, Zoph et
al., 2022) is the mean over tokens of logsumexp(logits)². Both count every token of the
micro-batch, across the tensor- and sequence-parallel ranks.

Tensor parallelism splits each expert's MLP over t as the dense MLP is split (Megatron's
expert tensor parallelism): the first matrices by output rows, the last by input columns,
the partial outputs combined by the router weights and summed once. The router is whole on
every rank; under sequence parallelism it scores this rank's tokens and its gradient is
summed over t, as the norms' are.

Expert parallelism (:class:`ExpertParallel`, ep ranks carved out of d) gives each rank E/ep of
the experts, a contiguous block. Each rank routes and drops its own tokens as before (so a
capacity counts a micro-batch of one rank, whatever ep), then one all-to-all sends each kept
assignment to the rank holding its expert (the counts exchanged first), the experts run on
what they received, and a second all-to-all brings the outputs back in their order. The
all-to-all is the data-parallel engine's (torch.distributed or Horovod), handed to the layer
as a plain function of (tensor, rows sent to each rank, rows received from each rank); its
backward is the reverse all-to-all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpcllm import kernels
from hpcllm.parallel.tensor.layers import mark_split, shard_of
from hpcllm.parallel.tensor.mappings import (
    copy_to_tp,
    gather_from_sequence,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_to_sequence,
)

ROUTERS = ("softmax-topk", "topk-softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
ACTIVATIONS = ("swiglu", "gelu")


@dataclass
class Routing:
    """Where T tokens go: ``experts`` (T, k) chosen, ``weights`` (T, k) fp32 that scale their
    outputs, ``probs`` (T, E) fp32 the probabilities the balancing loss averages, ``logits``
    (T, E) fp32."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


def route(
    logits: torch.Tensor,
    router: str,
    top_k: int,
    renormalize: bool,
    bias: torch.Tensor | None = None,
) -> Routing:
    """Return the routing of ``logits`` (T, E) by ``router`` (one of :data:`ROUTERS`).

    ``bias`` (E,), for the sigmoid router only, is added to the scores to choose the experts;
    the weights are the scores themselves (renormalised over the k chosen when asked).
    """
    logits = logits.float()
    if router == "softmax-topk":
        probs = logits.softmax(dim=-1)
        weights, experts = probs.topk(top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif router == "topk-softmax":
        probs = logits.softmax(dim=-1)
        top, experts = logits.topk(top_k, dim=-1)
        weights = top.softmax(dim=-1)
    elif router == "sigmoid":
        scores = logits.sigmoid()
        choice = scores.detach() if bias is None else scores.detach() + bias
        experts = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # DeepSeek-V3's balance term averages the scores normalised per token.
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"unknown router {router!r}; one of {', '.join(ROUTERS)}")
    return Routing(experts, weights, probs, logits)


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Return how many of the (T, k) choices went to each expert, (E,) int64."""
    return torch.bincount(experts.flatten(), minlength=n_experts)


def balance_loss(
    probs_sum: torch.Tensor, counts: torch.Tensor, tokens: int, n_experts: int
) -> torch.Tensor:
    """Return E · Σₑ (countsₑ / T) · (probs_sumₑ / T): the balancing loss of T tokens whose
    choices per expert are ``counts`` and whose probabilities per expert sum to ``probs_sum``
    (a part of the tokens' sum gives that part of the loss, which a sum over ranks completes)."""
    return n_experts * (counts.float() / tokens * (probs_sum / tokens)).sum()


def capacity_of(factor: float | None, top_k: int, tokens: int, n_experts: int) -> int | None:
    """Return each expert's slots for ``tokens`` tokens, ⌈c·k·T/E⌉, or None (dropless)."""
    if factor is None:
        return None
    return math.ceil(factor * top_k * tokens / n_experts)


def kept(
    experts: torch.Tensor,
    weights: torch.Tensor,
    n_experts: int,
    capacity: int | None,
    policy: str,
) -> torch.Tensor:
    """Return which of the (T, k) assignments fit their expert's ``capacity``, a bool (T, k).

    Each expert keeps its first ``capacity`` assignments in the ``policy``'s order: ``probs``,
    the highest weights first (ties: the earlier token); ``position``, the earlier tokens first.
    """
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    if policy not in DROP_POLICIES:
        raise ValueError(f"unknown drop policy {policy!r}; one of {', '.join(DROP_POLICIES)}")
    flat = experts.flatten()
    order = torch.arange(flat.numel(), device=flat.device)  # token-major: earlier first
    if policy == "probs":
        order = torch.sort(-weights.detach().flatten(), stable=True).indices
    # Within each expert, the policy's order (a stable sort by expert keeps it).
    by_expert = order[torch.sort(flat[order], stable=True).indices]
    counts = torch.bincount(flat, minlength=n_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(flat)
    rank[by_expert] = torch.arange(flat.numel(), device=flat.device) - starts[flat[by_expert]]
    return (rank < capacity).view_as(experts)


# The engine's all-to-all over the ep group: (x, rows to each rank, rows from each rank) -> the
# rows received, by source rank. Not differentiated: :func:`exchange` wraps it.
AllToAll = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


@dataclass
class ExpertParallel:
    """This rank's share of the experts: ``size`` ep ranks, this one ``rank``, and the engine's
    all-to-all over them (``all_to_all``, set once the engine has started; None at size 1)."""

    size: int = 1
    rank: int = 0
    all_to_all: AllToAll | None = None

    def mine(self, n_experts: int) -> range:
        """Return the (global) indices of the experts this rank holds."""
        per = n_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


class _Exchange(torch.autograd.Function):
    """An all-to-all whose backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], all_to_all: AllToAll
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.all_to_all = send, recv, all_to_all
        return all_to_all(x.contiguous(), send, recv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        return ctx.all_to_all(grad.contiguous(), ctx.recv, ctx.send), None, None, None


def exchange(
    x: torch.Tensor, send: list[int], recv: list[int], all_to_all: AllToAll
) -> torch.Tensor:
    """Return the rows of ``x`` (``send[j]`` of them for rank j, in order) as the ep ranks
    received them (``recv[j]`` from rank j, by source); differentiable."""
    return _Exchange.apply(x, send, recv, all_to_all)


@dataclass
class Dispatch:
    """The kept assignments sorted by expert: ``tokens`` (N,) their token, ``slots`` (N,)
    their index in the flattened (T, k) routing, ``counts`` (E,) how many each expert got."""

    tokens: torch.Tensor
    slots: torch.Tensor
    counts: torch.Tensor


def dispatch(experts: torch.Tensor, keep: torch.Tensor, n_experts: int) -> Dispatch:
    """Return the kept assignments of ``experts`` (T, k) grouped by expert, tokens in order."""
    k = experts.shape[1]
    flat, keep = experts.flatten(), keep.flatten()
    slots = keep.nonzero().flatten()
    slots = slots[torch.sort(flat[slots], stable=True).indices]
    counts = torch.bincount(flat[slots], minlength=n_experts)
    return Dispatch(slots // k, slots, counts)


# Whether torch's grouped GEMM runs here, by (device type, dtype): asked once each.
_GROUPED: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Return whether ``torch._grouped_mm`` (forward and backward) runs on ``device`` in
    ``dtype`` in this build: CPU builds since torch 2.9 or so, CUDA in bf16 on Hopper."""
    key = (device.type, dtype)
    if key not in _GROUPED:
        works = hasattr(torch, "_grouped_mm")
        if works:
            # Asked inside a recomputed block's first forward, the probe's own saved tensors
            # must not reach the checkpoint's count (the recomputation asks nothing): identity
            # hooks of its own keep them.
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                works = _probe_grouped_mm(device, dtype)
        _GROUPED[key] = works
    return _GROUPED[key]


def _probe_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Return whether a small grouped GEMM runs forward and backward."""
    try:
        x = torch.ones(4, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([1, 4], device=device, dtype=torch.int32)
        y = torch._grouped_mm(x, w, offs=offs)
        torch.autograd.grad(y, (x, w), torch.ones_like(y))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class Experts(nn.Module):
    """E expert MLPs with stacked weights, each split over the tp group like the dense MLP.

    ``swiglu``: ``gate`` and ``up`` (E, f/t, h), SiLU(x·G) ⊙ (x·U), then ``proj`` (E, h, f/t);
    ``gelu``: ``fc`` (E, f/t, h) with ``fc_bias`` (E, f/t), GeLU, then ``proj`` (E, h, f/t)
    with ``proj_bias`` (E, h), which :meth:`forward` leaves to the caller (added once, after
    the sum over t). Each weight is drawn whole, expert by expert, and this rank keeps its slice:
    of the experts ``ep`` gives it (all of them by default), its tp part of each. ``proj_bias``
    stays whole (the token's own rank adds it).
    """

    def __init__(
        self,
        n_experts: int,
        hidden: int,
        ffn: int,
        activation: str,
        *,
        group: Any,
        gen: torch.Generator,
        init_std: float,
        out_std: float,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        t = group_size(group)
        ep = ep or ExpertParallel()
        if n_experts % ep.size:
            raise ValueError(f"{n_experts} experts do not split over ep {ep.size}")
        held = ep.mine(n_experts)
        if ffn % t:
            raise ValueError(f"the experts' width {ffn} does not split over tp {t}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {activation!r}")
        self.activation, self.n_experts = activation, len(held)
        rank = group_rank(group)

        def drawn(shape: tuple[int, ...], std: float, dim: int) -> nn.Parameter:
            full = torch.empty(shape, dtype=torch.float32)
            if std:
                full.normal_(0.0, std, generator=gen)
            else:
                full.zero_()
            part = shard_of(full, dim, 1, rank, t)[held.start : held.stop]
            param = nn.Parameter(part.contiguous())
            mark_split(param, dim=dim)
            return param

        if activation == "swiglu":
            self.gate = drawn((n_experts, ffn, hidden), init_std, 1)
            self.up = drawn((n_experts, ffn, hidden), init_std, 1)
            self.fc = self.fc_bias = self.proj_bias = None
        else:
            self.fc = drawn((n_experts, ffn, hidden), init_std, 1)
            self.fc_bias = drawn((n_experts, ffn), 0.0, 1)
            self.gate = self.up = None
        self.proj = drawn((n_experts, hidden, ffn), out_std, 2)
        if activation == "gelu":
            self.proj_bias = nn.Parameter(torch.zeros(n_experts, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool = True) -> torch.Tensor:
        """Return the experts' outputs (this rank's partial sums over t, no ``proj_bias``) for
        ``x`` (N, h), whose first ``counts[0]`` rows go to expert 0, the next to expert 1, …

        One grouped GEMM per matrix where torch's runs here (:func:`grouped_mm_works`; no
        host sync), else (or without ``grouped``) a loop over the experts, one GEMM pair each.
        """
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else x.dtype
        )
        # Traced, the op's fake kernel takes bf16 only (CUDA's case), whatever eager runs.
        traced_ok = not torch.compiler.is_compiling() or dtype == torch.bfloat16
        if grouped and traced_ok and grouped_mm_works(x.device, dtype):
            return self._grouped(x.to(dtype), counts, dtype)
        outputs = []
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            rows = x[start : start + n]
            start += n
            if self.activation == "swiglu":
                assert self.gate is not None and self.up is not None
                h = kernels.swiglu(rows @ self.gate[e].t(), rows @ self.up[e].t())
            else:
                assert self.fc is not None and self.fc_bias is not None
                h = kernels.bias_gelu(rows @ self.fc[e].t(), self.fc_bias[e])
            outputs.append(h @ self.proj[e].t())
        if not outputs:
            return x.new_zeros(0, self.proj.shape[1])
        return torch.cat(outputs)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        offs = torch.cumsum(counts, 0).to(torch.int32)

        def mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # w: (E, out, in)
            return torch._grouped_mm(a, w.to(dtype).transpose(-2, -1), offs=offs)

        if self.activation == "swiglu":
            assert self.gate is not None and self.up is not None
            h = kernels.swiglu(mm(x, self.gate), mm(x, self.up))
        else:
            assert self.fc is not None and self.fc_bias is not None
            rows = torch.repeat_interleave(
                torch.arange(self.n_experts, device=x.device), counts, output_size=x.shape[0]
            )
            h = kernels.bias_gelu(mm(x, self.fc) + self.fc_bias[rows].to(dtype), None)
        return mm(h.to(dtype), self.proj)


def take_aux_losses(layers: list[MoE]) -> torch.Tensor | None:
    """Return the sum of the auxiliary losses ``layers`` left by their last training forward
    (None where none did), and forget them.

    The caller backpropagates it beside the forward's output, with the gradient the main loss
    gets (1/m micro-batches, times fp16's loss scale): each stage's routers train as the main
    loss trains them. A forward recomputed inside a backward leaves losses that the next
    forward replaces, never taken.
    """
    losses = [layer.aux for layer in layers if layer.aux is not None]
    for layer in layers:
        layer.aux = None
    if not losses:
        return None
    return torch.stack([loss.float() for loss in losses]).sum()


@dataclass
class LayerStats:
    """One MoE layer's figures of its last micro-batch (whole over t; detached)."""

    counts: torch.Tensor  # (E,) kept assignments per expert
    dropped: torch.Tensor  # share of the T·k assignments dropped
    balance: torch.Tensor  # the balancing loss (without its coefficient)
    z: torch.Tensor  # the z-loss (without its coefficient)


class MoE(nn.Module):
    """The MoE MLP part of a block: ``forward(x, add_bias)`` returns (output, None).

    ``x`` is (b, s, h), or this rank's part of the sequence under sequence parallelism.
    """

    def __init__(
        self,
        hidden: int,
        n_experts: int,
        top_k: int,
        ffn: int,
        *,
        activation: str,
        group: Any,
        gen: torch.Generator,
        init_std: float,
        out_std: float,
        router: str = "softmax-topk",
        renormalize: bool = False,
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        aux_loss: float = 0.0,
        z_loss: float = 0.0,
        shared_ffn: int = 0,
        shared_gate: bool = False,
        sequence_parallel: bool = False,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.ep = ep or ExpertParallel()
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; one of {', '.join(ROUTERS)}")
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k {top_k} must be from 1 to the {n_experts} experts")
        if top_k == 1 and renormalize:
            raise ValueError("a renormalised top-1 weighs every token 1: the router learns nothing")
        self.group = group
        self.sequence_parallel = sequence_parallel and group_size(group) > 1
        self.n_experts, self.top_k = n_experts, top_k
        self.router_kind, self.renormalize = router, renormalize
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.aux_loss, self.z_loss = aux_loss, z_loss
        self.router = nn.Linear(hidden, n_experts, bias=False)
        with torch.no_grad():
            self.router.weight.normal_(0.0, init_std, generator=gen)
        self.experts = Experts(
            n_experts,
            hidden,
            ffn,
            activation,
            group=group,
            gen=gen,
            init_std=init_std,
            out_std=out_std,
            ep=self.ep,
        )
        # A shared expert every token goes through (Qwen-MoE, DeepSeek), drawn after the
        # routed ones, optionally scaled by a sigmoid gate of the token.
        self.shared = (
            Experts(
                1,
                hidden,
                shared_ffn,
                activation,
                group=group,
                gen=gen,
                init_std=init_std,
                out_std=out_std,
            )
            if shared_ffn
            else None
        )
        self.shared_gate = None
        if shared_gate:
            if not shared_ffn:
                raise ValueError("a shared gate needs a shared expert")
            self.shared_gate = nn.Linear(hidden, 1, bias=False)
            with torch.no_grad():
                self.shared_gate.weight.normal_(0.0, init_std, generator=gen)
        if router == "sigmoid":
            # Chooses experts, never weighs them; moved between steps by bias_update.
            self.register_buffer("bias", torch.zeros(n_experts))
        else:
            self.bias = None
        if self.ep.size > 1:
            # Wrapped here, when the model is built (never while tracing), and only at ep > 1:
            # torch.compiler.disable imports the compiler, which a dense model never needs.
            self._sent_eagerly = torch.compiler.disable(self._sent)
        self.block: int | None = None  # the model's block index (the Block sets it)
        self.grouped = True  # the experts' grouped GEMM where it runs (False: the loop)
        self.aux: torch.Tensor | None = None  # the last training forward's auxiliary loss
        self.stats: LayerStats | None = None
        # Summed over a training step's micro-batches (and their recomputed forwards, which
        # repeat each exactly): the choices per expert (E,), which the sigmoid router's bias
        # follows, and the figures the step logs (balance, z, dropped, max/mean load, count).
        self.step_counts: torch.Tensor | None = None
        self.step_sums: torch.Tensor | None = None

    def _tokens_whole(self, count: int) -> int:
        return count * group_size(self.group) if self.sequence_parallel else count

    def _whole(self, per_token: torch.Tensor | None, b: int, s: int) -> torch.Tensor | None:
        """Return this rank's per-token (T, n) router output for every token of the
        micro-batch: gathered from the sequence-parallel ranks (its gradient reduced and
        split back), else the same tensor, whose gradient is summed over t (each rank's
        partial outputs give a part of it)."""
        if per_token is None:
            return None
        if self.sequence_parallel:
            n = per_token.shape[-1]
            return gather_from_sequence(per_token.view(b, s, n), self.group).view(-1, n)
        return copy_to_tp(per_token, self.group)

    def _sum_over_tp(self, x: torch.Tensor) -> torch.Tensor:
        """Return x summed over the sequence-parallel ranks (a detached statistic)."""
        if self.sequence_parallel:
            x = x.clone()
            dist.all_reduce(x, group=self.group)
        return x

    def _run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Return the experts' outputs for ``rows``, grouped by expert as ``counts`` (E,) says,
        in the same order: here, or at ep > 1 on the ranks holding them (:meth:`_sent`)."""
        if self.ep.size == 1:
            return self.experts(rows, counts, self.grouped)
        return self._sent_eagerly(rows, counts)

    def _sent(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each row to the ep rank holding its expert, run the experts there, send the
        outputs back: two all-to-alls, the counts exchanged first (split sizes are host
        values, so this part runs eagerly under ``torch.compile``)."""
        ep, all_to_all = self.ep.size, self.ep.all_to_all
        if all_to_all is None:
            raise RuntimeError("expert parallelism needs the engine's all-to-all (none was set)")
        per = self.n_experts // ep
        # received[j, i]: how many rows rank j sends for this rank's local expert i.
        received = all_to_all(counts.contiguous(), [per] * ep, [per] * ep).view(ep, per)
        send = counts.view(ep, per).sum(1).tolist()
        recv = received.sum(1).tolist()
        got = exchange(rows, send, recv, all_to_all)  # by source rank, then local expert
        # Group the rows by local expert (then source), as the experts take them.
        blocks = torch.arange(ep * per, device=rows.device).view(ep, per)
        key = blocks.remainder(per) * ep + blocks.div(per, rounding_mode="floor")
        order = torch.repeat_interleave(key.flatten(), received.flatten(), output_size=got.shape[0])
        perm = torch.sort(order, stable=True).indices
        out = self.experts(got[perm], received.sum(0), self.grouped)
        if got.requires_grad and not out.requires_grad:
            # No row came here (the experts' loop made a fresh empty tensor): tie it to what
            # arrived, so this rank's backward runs both all-to-alls as its peers' do.
            out = out + got.sum().to(out.dtype) * 0
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel(), device=perm.device)
        return exchange(out[back], recv, send, all_to_all)

    def forward(self, x: torch.Tensor, add_bias: bool = False) -> tuple[torch.Tensor, None]:
        """Return (output, None): the bias, if any, is added here."""
        b, s, h = x.shape
        local = x.reshape(b * s, h)
        with torch.autocast(x.device.type, enabled=False):  # the router in fp32, always
            logits = F.linear(local.float(), self.router.weight.float())
        routing = route(logits, self.router_kind, self.top_k, self.renormalize, self.bias)
        tokens = self._tokens_whole(b * s)

        # The whole micro-batch's routing, on every tp rank: under sequence parallelism each
        # rank routed its own tokens; the experts see them all.
        experts = routing.experts
        gate = None
        if self.shared_gate is not None:
            gate = F.linear(local, self.shared_gate.weight).sigmoid()  # (T, 1)
        weights, all_gate = self._whole(routing.weights, b, s), self._whole(gate, b, s)
        if self.sequence_parallel:
            experts = _gather_ids(experts.view(b, s, -1), self.group).view(-1, self.top_k)
            inputs = gather_from_sequence(x, self.group).reshape(-1, h)
        else:
            inputs = copy_to_tp(local, self.group)
        capacity = capacity_of(self.capacity_factor, self.top_k, tokens, self.n_experts)
        keep = kept(experts, weights, self.n_experts, capacity, self.drop_policy)
        plan = dispatch(experts, keep, self.n_experts)
        out = self._run_experts(inputs[plan.tokens], plan.counts)
        scale = weights.flatten()[plan.slots].unsqueeze(1)
        y = inputs.new_zeros(inputs.shape[0], h, dtype=out.dtype)
        y = y.index_add(0, plan.tokens, out * scale.to(out.dtype))
        if self.shared is not None:
            every = plan.counts.new_full((1,), inputs.shape[0])
            shared = self.shared(inputs, every, self.grouped)
            y = y + (shared if all_gate is None else shared * all_gate.to(shared.dtype))
        y = y.view(b, -1, h)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.group)
        else:
            y = reduce_from_tp(y, self.group)
        if self.experts.proj_bias is not None:
            # Added once, after the sum over t: this rank's tokens' kept biases, weighed.
            mine = keep if not self.sequence_parallel else _mine(keep, b, s, self.group)
            local_weights = routing.weights * mine
            biases = self.experts.proj_bias[routing.experts]  # (T, k, h)
            y = y + (local_weights.to(y.dtype).unsqueeze(-1) * biases).sum(1).view(b, s, h)
            if self.shared is not None:
                assert self.shared.proj_bias is not None
                bias = self.shared.proj_bias[0]
                if gate is None:
                    y = y + bias
                else:  # this rank's tokens' gates
                    y = y + (gate.to(y.dtype) * bias).view(b, s, h)

        counts = expert_counts(experts[keep], self.n_experts)
        probs_sum = routing.probs.sum(dim=0)
        # Every rank's share of the whole micro-batch's losses (summed over t they are whole).
        balance = balance_loss(probs_sum, counts, tokens, self.n_experts)
        z = routing.logits.logsumexp(dim=-1).square().sum() / tokens
        dropped = 1.0 - keep.sum().float() / keep.numel()
        self.stats = LayerStats(
            counts=counts.detach(),
            dropped=dropped.detach(),
            balance=self._sum_over_tp(balance.detach()),
            z=self._sum_over_tp(z.detach()),
        )
        if self.training:
            self.step_counts = counts if self.step_counts is None else self.step_counts + counts
            load = counts.max().float() / counts.float().mean().clamp_min(1e-9)
            figures = torch.stack(
                [self.stats.balance, self.stats.z, self.stats.dropped.float(), load]
            )
            figures = torch.cat([figures.float(), figures.new_ones(1)])
            self.step_sums = figures if self.step_sums is None else self.step_sums + figures
        aux = self.aux_loss * balance + self.z_loss * z
        # Left for the step's backward (take_aux_losses), beside the output's.
        self.aux = aux if self.training and aux.requires_grad else None
        return y.to(x.dtype), None


def _gather_ids(ids: torch.Tensor, group: Any) -> torch.Tensor:
    """Return the whole sequence's integer ids (b, s, k) gathered from the tp ranks."""
    parts = [torch.empty_like(ids) for _ in range(group_size(group))]
    dist.all_gather(parts, ids.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _mine(keep: torch.Tensor, b: int, s: int, group: Any) -> torch.Tensor:
    """Return this rank's tokens' rows of the whole sequence's ``keep`` (b·s·t, k)."""
    t, rank = group_size(group), group_rank(group)
    return keep.view(b, s * t, -1)[:, rank * s : (rank + 1) * s].reshape(b * s, -1)


# The figures a step logs of its MoE layers (means over the layers and micro-batches).
FIGURES = ("moe_balance_loss", "moe_z_loss", "moe_dropped", "moe_max_load")


def layers_of(modules: Any) -> list[MoE]:
    """Return the MoE layers inside ``modules`` (a module or a list of them), in order."""
    found: list[MoE] = []
    for module in modules if isinstance(modules, list | tuple | nn.ModuleList) else [modules]:
        found += [m for m in module.modules() if isinstance(m, MoE)]
    return found


def end_step(
    layers: list[MoE],
    bias_rate: float,
    groups: tuple[Any, ...],
    device: torch.device,
    blocks: list[int],
    n_experts: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Close a training step of ``layers`` (this rank's MoE layers).

    Returns the step's :data:`FIGURES` (means over the model's MoE blocks ``blocks`` and the
    step's micro-batches) and a table with a row per block of ``blocks``: the four figures,
    then each expert's share of the block's routed tokens, summed over each of ``groups``
    (the data-parallel then the pipeline group: a collective on every rank of them) and
    averaged over the data-parallel replicas. Then moves each sigmoid router's bias by the
    step's loads summed over ``groups[0]``.
    """
    width = len(FIGURES) + 1 + n_experts  # alike on every rank, MoE layers held or not
    table = torch.zeros(len(blocks), width, device=device)
    for layer in layers:
        if layer.step_sums is None or layer.step_counts is None:
            continue
        row = table[blocks.index(layer.block)]
        sums = layer.step_sums.to(device)
        row[: len(FIGURES)] = sums[:-1] / sums[-1]
        row[len(FIGURES)] = 1  # this replica's: the sums below count the replicas
        counts = layer.step_counts.to(device).float()
        row[len(FIGURES) + 1 :] = counts / counts.sum().clamp_min(1)
    if dist.is_initialized():
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(table, group=group)
    replicas = table[:, len(FIGURES)].clamp_min(1).unsqueeze(1)
    table = torch.cat([table[:, : len(FIGURES)], table[:, len(FIGURES) + 1 :]], dim=1) / replicas
    means = table[:, : len(FIGURES)].mean(dim=0) if len(blocks) else table.new_zeros(4)
    for layer in layers:
        bias_update(layer, bias_rate, groups[0])
        layer.step_sums = None
        layer.aux = None  # a recomputed forward's, never taken
    return dict(zip(FIGURES, means, strict=True)), table


def per_block(table: torch.Tensor, blocks: list[int]) -> dict[str, Any]:
    """Return :func:`end_step`'s table as metrics.jsonl fields: per MoE block its figures
    (``moe_blocks``) and its experts' shares of the routed tokens (``moe_expert_load``)."""
    rows = table.tolist()
    n = len(FIGURES)
    return {
        "moe_blocks": {
            str(b): {name.removeprefix("moe_"): row[i] for i, name in enumerate(FIGURES)}
            for b, row in zip(blocks, rows, strict=True)
        },
        "moe_expert_load": {str(b): row[n:] for b, row in zip(blocks, rows, strict=True)},
    }


def bias_update(layer: MoE, rate: float, group: Any = None) -> None:
    """Move a sigmoid router's ``bias`` by ``rate`` · sign(mean load − load), from the token
    counts of the step's micro-batches (summed over ``group``, the ranks that saw other
    tokens), then forget them. Called after each optimizer step."""
    if layer.bias is None or layer.step_counts is None:
        layer.step_counts = None
        return
    load = layer.step_counts.float()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(load, group=group)
    with torch.no_grad():
        layer.bias += rate * torch.sign(load.mean() - load)
    layer.step_counts = None
