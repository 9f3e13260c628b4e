"""Context parallelism: each sequence split over the cp ranks of a group, attention across them.

A sequence of s tokens is cut into 2·cp chunks of s/(2·cp); context-parallel rank r holds
chunks r and 2·cp−1−r, so that under a causal mask every rank has the same attention work
(an early chunk, which attends to few keys, paired with a late one, which attends to many).
Inputs, labels and positions are cut alike (:meth:`ContextParallel.cut`) once the batch is on
the device: the reader keeps serving d, and the cp ranks of a group read the same samples.
Everything but attention is per token, so only attention needs the other ranks' tokens.

Attention here is the all-gather variant Llama 3 trained its long-context stage with (The
Llama 3 Herd of Models, section 3.3.2): each rank all-gathers the keys and values of its
group and attends with its own queries; the backward reduce-scatters the key and value
gradients to the ranks that made them. Each of a rank's two chunks attends to the keys up to
its own end only, causally with the diagonal at the lower right, so no key after a chunk is
computed (as whole causal attention skips them). Under grouped-query attention the keys and
values are the small part of the activations. The cost, set against a ring of point-to-point
sends: the whole sequence's keys and values are held per layer during the forward and kept
for the backward, and the all-gather is not overlapped with compute
(docs/context-parallel.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpcllm import watchdog

# Where a rank waits for its context-parallel group, as the watchdog names it.
GATHER = "context-parallel key/value all-gather"
SCATTER = "context-parallel key/value gradient reduce-scatter"


def chunk_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Return the positions (2·s/(2·cp),) of rank ``cp_rank``'s tokens: chunks r and
    2·cp−1−r of a sequence of ``seq_len`` tokens, in that order."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2 x {cp} chunks")
    if not 0 <= cp_rank < cp:
        raise ValueError(f"context-parallel rank {cp_rank} outside a group of {cp}")
    c = seq_len // (2 * cp)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c)
    return torch.cat([first, second])


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """Return the boolean mask (queries, keys) that lets a query see the keys at or before
    its position (True: attend)."""
    return key_positions[None, :] <= query_positions[:, None]


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dimension 2 of (b, heads, s, d)) in cp-rank order; the
    backward sums the gradients over the group and keeps this rank's part."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        with watchdog.waiting(GATHER, axis="cp"):
            dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = dist.get_world_size(ctx.group)
        parts = [c.contiguous() for c in grad.chunk(size, dim=2)]
        out = torch.empty_like(parts[0])
        with watchdog.waiting(SCATTER, axis="cp"):
            dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Return ``x`` (b, heads, s_local, d) of every rank of ``group`` joined along the
    sequence in rank order; its gradient is reduce-scattered back."""
    return _GatherSequence.apply(x, group)


class ContextParallel:
    """A rank's place in its context-parallel group and what it cuts and masks by.

    ``group`` is the torch group of the cp ranks that split each sequence (None: cp = 1,
    nothing is cut), ``rank`` this rank's place in it, ``seq_len`` the whole sequence.
    """

    def __init__(self, group: Any = None, size: int = 1, rank: int = 0, seq_len: int = 0) -> None:
        if size > 1 and group is not None and dist.get_world_size(group) != size:
            raise ValueError(
                f"a context-parallel group of {size} ranks has {dist.get_world_size(group)}"
            )
        self.group, self.size, self.rank, self.seq_len = group, size, rank, seq_len
        # Outside any compiled graph: the collective runs eagerly between the compiled
        # regions. Made here, not at import, where torch.compiler would import Triton.
        self._gather = torch.compiler.disable(gather_sequence) if self.active else gather_sequence
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._bias: dict[Any, torch.Tensor] = {}

    @property
    def active(self) -> bool:
        """Return whether sequences are split (cp > 1)."""
        return self.size > 1

    def positions(self, device: torch.device) -> torch.Tensor:
        """Return this rank's token positions (s/cp,) on ``device``."""
        return self._tensors(device)[0]

    def mask(self, device: torch.device) -> torch.Tensor:
        """Return the causal mask (s/cp, s) of this rank's queries over the group's gathered
        keys (in cp-rank order), on ``device``: which keys each query sees."""
        mine, _, _ = self._tensors(device)
        return causal_mask(mine, self._tensors(device)[1])

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return this rank's positions, the gathered keys' (cp-rank order) and the order
        that puts the gathered keys in sequence order."""
        if device not in self._on:
            mine = chunk_positions(self.seq_len, self.size, self.rank)
            keys = torch.cat(
                [chunk_positions(self.seq_len, self.size, r) for r in range(self.size)]
            )
            self._on[device] = (mine.to(device), keys.to(device), keys.argsort().to(device))
        return self._on[device]

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """Return this rank's tokens of ``x`` (b, s): its two chunks, joined."""
        if not self.active:
            return x
        if x.shape[1] != self.seq_len:
            raise ValueError(
                f"context parallelism cuts sequences of {self.seq_len} tokens, got {x.shape[1]}"
            )
        return x.index_select(1, self.positions(x.device)).contiguous()

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float = 0.0,
        gqa: bool = False,
        masks: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Return causal attention of this rank's queries (b, heads, s/cp, d) over the keys
        and values of the whole sequence, gathered from the group; ``masks``: its chunks'
        masks within packed documents (:func:`hpcllm.model.documents.chunk_masks`)."""
        return self.attend(
            q, self._gather(k, self.group), self._gather(v, self.group), dropout_p, gqa, masks
        )

    def attend(
        self,
        q: torch.Tensor,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
        dropout_p: float = 0.0,
        gqa: bool = False,
        masks: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Return causal attention of this rank's queries over ``k_all`` and ``v_all``, the
        group's keys and values joined in cp-rank order (what :meth:`attention` gathers);
        with ``masks`` (:func:`hpcllm.model.documents.chunk_masks`: each chunk's boolean
        mask over the keys up to its end), within the packed documents they say.

        The keys are put in sequence order, and each of this rank's two chunks attends to the
        keys up to its own end only, causally with the diagonal at the lower right (its own
        chunk's block): the keys after a chunk are never computed, as whole causal attention
        skips them, and no (s/cp × s) mask is made."""
        order = self._tensors(q.device)[2]
        k_seq, v_seq = k_all.index_select(2, order), v_all.index_select(2, order)
        c = self.seq_len // (2 * self.size)
        outs = []
        for part, chunk in enumerate((self.rank, 2 * self.size - 1 - self.rank)):
            end = (chunk + 1) * c
            if masks is not None:
                outs.append(
                    masked_sdpa(
                        q[:, :, part * c : (part + 1) * c],
                        k_seq[:, :, :end],
                        v_seq[:, :, :end],
                        masks[part],
                        dropout_p,
                        gqa,
                    )
                )
                continue
            outs.append(
                lower_right_attention(
                    q[:, :, part * c : (part + 1) * c],
                    k_seq[:, :, :end],
                    v_seq[:, :, :end],
                    dropout_p,
                    gqa,
                    self._bias,
                )
            )
        return torch.cat(outs, dim=2)


def masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    dropout_p: float = 0.0,
    gqa: bool = False,
) -> torch.Tensor:
    """Return scaled_dot_product_attention of ``q`` over ``k`` and ``v`` under the boolean
    ``mask`` (True: attend). On CUDA grouped key/value heads are repeated to the query heads
    first: torch's grouped-query attention runs only the flash kernel, which takes no mask, or
    the math one, which keeps the fp32 scores; the memory-efficient kernel takes the mask."""
    if gqa and q.device.type == "cuda":
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=gqa
    )


# On CUDA the lower-right causal mask is torch's CausalBias, which runs the flash or the
# memory-efficient kernel without making the mask; elsewhere (and where this is False) it is
# an additive bias made once per shape, device and dtype.
CAUSAL_BIAS_ON_CUDA = True


def lower_right_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    gqa: bool,
    cache: dict[Any, torch.Tensor],
    causal_bias: bool | None = None,
) -> torch.Tensor:
    """Return causal attention of ``q`` (its tokens the last of ``k``'s) over ``k`` and
    ``v``: query i sees the keys up to len(k) − len(q) + i. ``cache`` keeps the additive
    masks made (one per shape, device and dtype, kept once for every layer's backward);
    ``causal_bias`` (None: on CUDA, as :data:`CAUSAL_BIAS_ON_CUDA` says) uses torch's
    lower-right CausalBias instead."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    lq, lk = q.shape[2], k.shape[2]
    if lq == lk:
        return sdpa(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa)
    if causal_bias is None:
        causal_bias = CAUSAL_BIAS_ON_CUDA and q.device.type == "cuda"
    if causal_bias:
        from torch.nn.attention.bias import causal_lower_right

        if gqa:  # the bias's kernels take as many key/value heads as query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return sdpa(q, k, v, attn_mask=causal_lower_right(lq, lk), dropout_p=dropout_p)
    key = (lq, lk, q.device, q.dtype)
    if key not in cache:
        rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        seen = torch.arange(lk, device=q.device)[None, :] <= rows
        bias = torch.zeros((lq, lk), dtype=q.dtype, device=q.device)
        cache[key] = bias.masked_fill_(~seen, float("-inf"))
    return sdpa(q, k, v, attn_mask=cache[key], dropout_p=dropout_p, enable_gqa=gqa)
