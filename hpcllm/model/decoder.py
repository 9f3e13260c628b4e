"""The decoder every family shares: embedding, blocks, final norm and output layer.

A family's torch half is a :class:`Decoder` subclass that names its parts
(:class:`DecoderParts`): the norm, the attention and the MLP of its blocks, and learned
positions if it has them. Everything else is here, once: the stage cut (a stage holds some
blocks, the embedding if it comes first, the final norm and output layer if it comes last),
the tied or untied output layer, activation recomputation, sequence parallelism's dropout
streams, the loss over vocabulary-parallel logits, the KV cache and sampling. A variant swaps
one part (an MoE layer for the MLP) and keeps the rest.

Parts are built from the tensor-parallel layers (:mod:`hpcllm.parallel.tensor.layers`) and
the fused-op dispatch points (:mod:`hpcllm.kernels`); with a tensor-parallel group of one rank
they are plain layers. The decoder knows no schedule and no data-parallel engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpcllm import families, kernels
from hpcllm.config import ModelConfig, moe_layers, padded_vocab
from hpcllm.model.documents import (
    attention_mask,
    chunk_masks,
    document_positions,
    flex_wanted,
    masked_attention,
)
from hpcllm.model.moe import ExpertParallel, MoE
from hpcllm.parallel.context import ContextParallel
from hpcllm.parallel.random import recompute_context, tp_rng
from hpcllm.parallel.roles import assign_roles, persistent_buffers
from hpcllm.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from hpcllm.parallel.tensor.deferred import linear
from hpcllm.parallel.tensor.layers import (
    VocabParallelEmbedding,
    normal_init,
    sequence_parallel_linear,
)
from hpcllm.parallel.tensor.mappings import copy_to_tp, gather_from_tp, group_rank, group_size

# A block part's constructor: (model config, tp group, weights' generator, sequence parallel).
PartFactory = Callable[[ModelConfig, Any, torch.Generator, bool], nn.Module]
# A norm's constructor: (width, epsilon, sequence parallel).
NormFactory = Callable[[int, float, bool], nn.Module]


@dataclass(frozen=True)
class DecoderParts:
    """What a family's decoder is made of, and the names its weights are kept under.

    ``attention`` and ``mlp`` are called as :data:`PartFactory`; each returns (output, bias)
    from ``forward(x, add_bias)`` (attention also takes ``cache``), the bias left for the
    fused bias-dropout-add unless ``add_bias`` (None when it has none). ``positions``: a
    module of learned absolute positions (``wpe``), drawn after the token embedding, or None
    (rotary positions live in the attention). ``norm_names``: the norms before the attention,
    before the MLP and after the last block, as the family's checkpoints name them.
    """

    norm: NormFactory
    attention: PartFactory
    mlp: PartFactory
    positions: Callable[[ModelConfig, torch.Generator, bool], nn.Module] | None = None
    norm_names: tuple[str, str, str] = ("norm1", "norm2", "norm_f")
    # Mixtures of experts (:mod:`hpcllm.model.moe`): the experts' activation, as the dense
    # MLP's (``swiglu`` or ``gelu``, the latter with biases), and the dense MLP's width,
    # which the experts take unless model.moe_ffn_size says otherwise.
    expert_activation: str = "swiglu"
    mlp_width: Callable[[ModelConfig], int] = lambda cfg: 4 * cfg.d_model


class LayerCache:
    """One block's keys and values of the tokens generated so far, (b, kv heads, tokens, d):
    under grouped-query attention the shared heads, once. Room for ``capacity`` tokens is
    taken at the first tokens, so each new token is written in place, not concatenated."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0  # tokens cached: the next one's position
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    @property
    def keys(self) -> torch.Tensor | None:
        """Return the cached keys (b, kv heads, length, d), or None before the first token."""
        return None if self._k is None else self._k[:, :, : self.length]

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' keys and values after the cached ones; return all of them."""
        new = k.shape[2]
        if self.length + new > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} tokens; {self.length + new} asked")
        if self._k is None:
            b, heads, _, d = k.shape
            self._k = k.new_empty(b, heads, self.capacity, d)
            self._v = v.new_empty(b, heads, self.capacity, d)
        assert self._v is not None
        self._k[:, :, self.length : self.length + new] = k
        self._v[:, :, self.length : self.length + new] = v
        self.length += new
        return self._k[:, :, : self.length], self._v[:, :, : self.length]


class KVCache:
    """Every block's :class:`LayerCache`: what :meth:`Decoder.decode` keeps between tokens,
    room for ``capacity`` tokens (``model.seq_len``)."""

    def __init__(self, layers: int, capacity: int) -> None:
        self.layers = [LayerCache(capacity) for _ in range(layers)]

    @property
    def length(self) -> int:
        """Return how many tokens are cached."""
        return self.layers[0].length if self.layers else 0


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, gqa: bool = False
) -> torch.Tensor:
    """Return causal attention of the new tokens' q over the cached keys and values and their
    own: a whole prompt at once (nothing cached yet), or one token after the cache."""
    past = cache.length
    if past and q.shape[2] != 1:
        raise ValueError("after the cached tokens, attention takes one new token at a time")
    k, v = cache.extend(k, v)
    # One query after the cache sees every key; a prompt is causal.
    return F.scaled_dot_product_attention(q, k, v, is_causal=past == 0, enable_gqa=gqa)


def dropout_rng(group: Any, p: float, training: bool) -> Any:
    """The tensor-parallel stream for a dropout over split activations, when it drops."""
    return tp_rng(group if p > 0 and training else None)


def _eager_checkpoint(function: Any, *args: torch.Tensor) -> torch.Tensor:
    """``checkpoint`` with the tensor-parallel stream's replay (:func:`recompute_context`)."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=recompute_context)


class SelfAttention(nn.Module):
    """Causal self-attention's shared half: heads split over the tp group, the attention core
    (dropout from the tensor-parallel stream, selective recomputation), the KV cache and the
    output projection ``proj`` (row-parallel). A family supplies :meth:`project`, which makes
    q, k and v, and builds ``proj``; ``kv_heads`` key/value heads are shared by the query
    heads (grouped-query attention) when fewer; each head is ``head_dim`` wide (None:
    d_model / n_head)."""

    def __init__(
        self, cfg: ModelConfig, group: Any, kv_heads: int, head_dim: int | None = None
    ) -> None:
        super().__init__()
        t = group_size(group)
        self.group = group
        self.local_heads = cfg.n_head // t
        self.head_dim = head_dim or cfg.d_model // cfg.n_head
        # With fewer key/value heads than tp ranks, each rank keeps the one its queries use.
        self.local_kv = kv_heads // t if kv_heads % t == 0 else 1
        self.gqa = self.local_kv != self.local_heads
        self.dropout = cfg.dropout
        self.selective = cfg.recompute == "selective"

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return q, k and v (b, heads, s, d) of ``x``, its tokens at ``positions`` (an integer
        tensor (s,) or (b, s) on x's device; None: 0 … s - 1)."""
        raise NotImplementedError

    # Context parallelism (Decoder.use_context): this rank's queries attend over the keys and
    # values of its whole group. None: the sequence is whole here.
    context: ContextParallel | None = None

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None
    ) -> torch.Tensor:
        # Heads are split over the tp group: each rank draws its own attention dropout.
        dropout_p = self.dropout if self.training else 0.0
        with dropout_rng(self.group, self.dropout, self.training):
            if self.context is not None:
                return self.context.attention(
                    q, k, v, dropout_p=dropout_p, gqa=self.gqa, masks=mask
                )
            if mask is not None:
                return masked_attention(q, k, v, mask, dropout_p, self.gqa)
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                dropout_p=self.dropout if self.training else 0.0,
                enable_gqa=self.gqa,
            )

    def _recomputed_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None
    ) -> torch.Tensor:
        """Return the attention core under ``checkpoint``: its activations rebuilt in backward.

        Compiled (``model.compile``), the compiler replays the region's random draws itself;
        only a tensor-parallel dropout stream needs :func:`recompute_context`, which a
        compiled graph cannot take, so that case runs eagerly.
        """
        if not torch.compiler.is_compiling():
            return _eager_checkpoint(self._core, q, k, v, mask)
        if self.dropout > 0 and self.group is not None:  # a graph break, then eager
            return torch.compiler.disable(_eager_checkpoint)(self._core, q, k, v, mask)
        return checkpoint(self._core, q, k, v, mask, use_reentrant=False)

    def forward(
        self,
        x: torch.Tensor,
        add_bias: bool = False,
        cache: LayerCache | None = None,
        positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (output, bias): the output projection's bias added to it (then None) or not.

        The tokens are at ``positions`` (see :meth:`project`). With ``cache`` (generation) x
        holds the new tokens, which attend to the cached ones, at the positions after them
        unless ``positions`` says otherwise. ``mask``: the packed documents' attention mask
        (:meth:`Decoder.document_mask`); None: causal over the whole sequence.
        """
        if positions is None and cache is not None:
            positions = torch.arange(cache.length, cache.length + x.shape[1], device=x.device)
        q, k, v = self.project(x, positions)
        b, _, s, _ = q.shape  # the whole sequence, even under sequence parallelism
        if cache is not None:
            y = cached_attention(q, k, v, cache, gqa=self.gqa)
        elif self.selective and self.training:
            # Korthikanti et al.: the attention core holds the s² activations and is cheap to
            # recompute; keeping everything else stored costs little memory.
            y = self._recomputed_core(q, k, v, mask)
        else:
            y = self._core(q, k, v, mask)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj(y, add_bias=add_bias), None if add_bias else self.proj.bias


def moe_mlp(
    parts: DecoderParts,
    cfg: ModelConfig,
    group: Any,
    gen: torch.Generator,
    sp: bool,
    ep: ExpertParallel | None = None,
) -> MoE:
    """Return an MoE MLP part as model.moe_* describes it, with the family's expert activation
    and width; the auxiliary losses' coefficients are averaged over the MoE blocks."""
    blocks = len(moe_layers(cfg))
    return MoE(
        cfg.d_model,
        cfg.moe_experts,
        cfg.moe_top_k,
        cfg.moe_ffn_size or parts.mlp_width(cfg),
        activation=parts.expert_activation,
        group=group,
        gen=gen,
        init_std=cfg.init_std,
        out_std=cfg.init_std / math.sqrt(2 * cfg.n_layer),
        router=cfg.moe_router,
        renormalize=cfg.moe_renormalize,
        capacity_factor=cfg.moe_capacity_factor,
        drop_policy=cfg.moe_drop_policy,
        aux_loss=cfg.moe_aux_loss / blocks,
        z_loss=cfg.moe_z_loss / blocks,
        shared_ffn=cfg.moe_shared_ffn_size,
        shared_gate=cfg.moe_shared_gate,
        sequence_parallel=sp,
        ep=ep,
    )


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x)).

    With sequence parallelism x is this rank's part of the sequence, and so are the norms and
    the dropout-residual adds; their dropout then comes from the tensor-parallel stream, since
    each rank holds different positions.
    """

    def __init__(
        self,
        parts: DecoderParts,
        cfg: ModelConfig,
        group: Any,
        gen: torch.Generator,
        sequence_parallel: bool = False,
        index: int | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        sp = sequence_parallel and group_size(group) > 1
        self.norm_names = parts.norm_names[:2]
        # Registered in this order (norm, attention, norm, MLP): the weights' draw order and
        # the state dict's.
        self.add_module(self.norm_names[0], parts.norm(cfg.d_model, cfg.layer_norm_eps, sp))
        self.attn = parts.attention(cfg, group, gen, sp)
        self.add_module(self.norm_names[1], parts.norm(cfg.d_model, cfg.layer_norm_eps, sp))
        # Block ``index`` of the model (None: a block alone, dense) is a mixture of experts
        # where model.moe_* says so.
        moe = index is not None and index in moe_layers(cfg)
        self.mlp = (
            moe_mlp(parts, cfg, group, gen, sp, ep) if moe else parts.mlp(cfg, group, gen, sp)
        )
        if moe:
            self.mlp.block = index
        self.dropout = cfg.dropout
        self.rng_group = group if sp else None

    def forward(
        self,
        x: torch.Tensor,
        cache: LayerCache | None = None,
        positions: torch.Tensor | None = None,
        mask: Any = None,
    ) -> torch.Tensor:
        # Fused kernels take the biases; the torch path adds them in the matmuls.
        add_bias = not kernels.fused(x)
        out, bias = self.attn(
            getattr(self, self.norm_names[0])(x), add_bias, cache, positions, mask
        )
        with dropout_rng(self.rng_group, self.dropout, self.training):
            x = kernels.bias_dropout_add(out, bias, x, self.dropout, self.training)
        out, bias = self.mlp(getattr(self, self.norm_names[1])(x), add_bias)
        with dropout_rng(self.rng_group, self.dropout, self.training):
            return kernels.bias_dropout_add(out, bias, x, self.dropout, self.training)


class Decoder(nn.Module):
    """The whole model of a family (or, with ``tp_group``, this rank's tensor-parallel shard).

    ``ep`` gives this rank its share of each MoE block's experts (expert parallelism); the
    experts it does not hold are drawn and dropped, as blocks are.

    ``vocab_size`` is the tokenizer's; the embedding is padded to a multiple of 128·t and the
    padded rows never reach the loss or the returned logits. ``sequence_parallel`` (with a tp
    group of more than one rank) splits the activations between tensor-parallel layers along
    the sequence, which must then divide by t. The output layer is the token embedding when
    the family ties them (:attr:`hpcllm.families.Family.ties`), else its own
    vocabulary-parallel weight ``lm_head``, drawn after the blocks.

    A pipeline stage is a decoder with ``layers`` (global block indices), the embedding if
    ``pre`` and the final norm and output layer if ``post``. Blocks it does not hold are
    still drawn from the generator, and dropped, so every weight it holds equals the whole
    model's; its state-dict keys are the whole model's too (``blocks.7.…``).
    """

    parts: ClassVar[DecoderParts]  # the family's: each subclass names its own

    def __init__(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        *,
        tp_group: Any = None,
        seed: int = 1234,
        sequence_parallel: bool = False,
        layers: range | None = None,
        pre: bool = True,
        post: bool = True,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.vocab_size, self.tp_group = cfg, vocab_size, tp_group
        self.ep = ep or ExpertParallel()
        t = group_size(tp_group)
        self.padded_vocab = padded_vocab(vocab_size, t)
        self.sequence_parallel = sequence_parallel and t > 1
        self.pre, self.post = pre, post
        self.tied = families.get(cfg.arch).ties(cfg)
        layers = range(cfg.n_layer) if layers is None else layers
        gen = torch.Generator().manual_seed(seed)
        vocab = {
            "group": tp_group,
            "gen": gen,
            "init": normal_init(cfg.init_std),
            "real_rows": vocab_size,
        }
        # Every part is drawn whether this stage keeps it or not, so a stage's weights are the
        # whole model's. A tied last stage keeps its own copy of the embedding.
        wte = VocabParallelEmbedding(
            self.padded_vocab, cfg.d_model, sequence_parallel=self.sequence_parallel, **vocab
        )
        if pre or (post and self.tied):
            self.wte = wte
        if self.parts.positions is not None:
            wpe = self.parts.positions(cfg, gen, self.sequence_parallel)
            if pre:
                self.wpe = wpe
        blocks = {}
        for index in range(cfg.n_layer):
            block = self.block(cfg, tp_group, gen, self.sequence_parallel, index, self.ep)
            if index in layers:
                blocks[str(index)] = block
        self.blocks = nn.ModuleDict(blocks)
        if post:
            norm = self.parts.norm(cfg.d_model, cfg.layer_norm_eps, self.sequence_parallel)
            self.add_module(self.parts.norm_names[2], norm)
            if not self.tied:
                self.lm_head = VocabParallelEmbedding(self.padded_vocab, cfg.d_model, **vocab)
        assign_roles(
            self.named_parameters(),
            families.get(cfg.arch),
            t=t,
            tp_rank=group_rank(tp_group),
            sequence_parallel=self.sequence_parallel,
            kv_heads=families.shape(cfg, vocab_size).kv_heads or cfg.n_head,
            buffers=persistent_buffers(self),
            ep=self.ep.size,
        )

    @classmethod
    def block(
        cls,
        cfg: ModelConfig,
        group: Any,
        gen: torch.Generator,
        sequence_parallel: bool = False,
        index: int | None = None,
        ep: ExpertParallel | None = None,
    ) -> Block:
        """Return one block of this family, drawn from ``gen`` (as the decoder draws each):
        block ``index`` of the model (its MLP an MoE where model.moe_* says, holding the
        experts ``ep`` gives this rank), or a dense one."""
        return Block(cls.parts, cfg, group, gen, sequence_parallel, index, ep=ep)

    # Context parallelism (use_context): this rank holds 1/cp of each sequence. None: all of it.
    context: ContextParallel | None = None

    def use_context(self, context: ContextParallel) -> None:
        """Split each sequence as ``context`` says: this stage takes its rank's tokens (cut by
        :meth:`ContextParallel.cut`), at their true positions, and its attention reaches the
        group's (nothing changes when cp = 1)."""
        if not context.active:
            return
        self.context = context
        for block in self.blocks.values():
            block.attn.context = context

    def check_length(self, s: int) -> None:
        """Raise a ValueError for a sequence of ``s`` tokens this stage cannot take."""
        if s > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {s} tokens is longer than model.seq_len {self.cfg.seq_len}"
            )
        t = group_size(self.tp_group)
        if self.sequence_parallel and s % t:
            raise ValueError(
                f"sequence parallelism splits the {s} tokens of a sequence over {t} "
                f"tensor-parallel ranks; use a length divisible by {t}"
            )

    def embed(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Return the token embeddings (plus learned positions, if the family has them) of
        ``ids`` (b, s) after dropout, the tokens at ``positions`` (an integer tensor (s,) or
        (b, s) on their device; None: 0 … s - 1). Under sequence parallelism, those of this
        rank's part of the sequence."""
        s = ids.shape[1]
        self.check_length(s)
        x = self.wte(ids)
        if self.parts.positions is not None:
            pos = torch.arange(s, device=ids.device) if positions is None else positions
            if self.sequence_parallel:
                pos = pos.chunk(group_size(self.tp_group), dim=-1)[group_rank(self.tp_group)]
            x = x + self.wpe(pos)
        with dropout_rng(
            self.tp_group if self.sequence_parallel else None, self.cfg.dropout, self.training
        ):
            return F.dropout(x, self.cfg.dropout, self.training)

    def run_blocks(
        self, x: torch.Tensor, positions: torch.Tensor | None = None, mask: Any = None
    ) -> torch.Tensor:
        """Return x after every block, its tokens at ``positions`` (see :meth:`embed`) and
        attending under ``mask`` (:meth:`document_mask`; None: causal), recomputing each
        block in backward under ``recompute: full``."""
        full = self.cfg.recompute == "full" and self.training and torch.is_grad_enabled()
        for block in self.blocks.values():
            x = (
                checkpoint(
                    block,
                    x,
                    positions=positions,
                    mask=mask,
                    use_reentrant=False,
                    context_fn=recompute_context,
                )
                if full
                else block(x, positions=positions, mask=mask)
            )
        return x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Return the last stage's norm of ``x``."""
        return getattr(self, self.parts.norm_names[2])(x)

    def output_layer(self) -> VocabParallelEmbedding:
        """Return the vocabulary-parallel weight the logits come from: the embedding when
        tied, else ``lm_head``."""
        return self.wte if self.tied else self.lm_head

    def head(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Return the loss against ``labels``, or the logits over the real vocabulary.

        The output layer (:meth:`output_layer`) takes the final norm's output
        (:meth:`final_norm`). With t > 1 each rank holds a vocabulary slice of the logits; the
        loss is computed on the slices and only logits asked for are gathered.
        """
        out = self.output_layer()
        if self.sequence_parallel:
            logits = sequence_parallel_linear(self.final_norm(x), out.weight, None, self.tp_group)
        else:
            logits = linear(copy_to_tp(self.final_norm(x), self.tp_group), out.weight)
        if group_size(self.tp_group) > 1:
            if labels is not None:
                return vocab_parallel_cross_entropy(
                    logits, labels, self.tp_group, out.vocab_start, self.vocab_size
                )
            logits = gather_from_tp(logits, self.tp_group)
        if labels is not None:  # padding columns are masked, not sliced off (no copy)
            return kernels.cross_entropy(logits, labels, vocab_size=self.vocab_size)
        return logits[..., : self.vocab_size]

    def forward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Return the mean cross-entropy against ``labels``, or the logits when none.

        A stage without the embedding (not ``pre``) takes the previous stage's activation as
        ``inputs``; one without the output layer (not ``post``) returns its activation. The
        tokens are at ``positions`` (an integer tensor (s,) or (b, s); None: 0 … s - 1), which
        every stage of a pipeline must be given alike. ``documents`` (b, s), each token's
        document in its sample (:func:`hpcllm.model.documents.document_ids`; under context
        parallelism the whole sample's, not this rank's cut), restarts attention and positions
        at each document (data.reset_attention_at_eos); labels under 0 take no loss.
        """
        mask = None
        if documents is not None:
            mask = self.document_mask(documents)
            if positions is None:
                positions = document_positions(documents)
                if self.context is not None:
                    positions = self.context.cut(positions)
        if positions is None and self.context is not None:
            positions = self.context.positions(inputs.device)
        hidden = self.embed(inputs, positions) if self.pre else inputs
        hidden = self.run_blocks(hidden, positions, mask)
        return self.head(hidden, labels) if self.post else hidden

    def document_mask(self, documents: torch.Tensor) -> Any:
        """Return the attention mask of the packed documents ``documents`` (b, s) for every
        block of this stage: causal within each document (under context parallelism, this
        rank's two chunks' masks over the whole sequence's keys)."""
        if self.context is not None:
            return chunk_masks(documents, self.context)
        dropout_p = self.cfg.dropout if self.training else 0.0
        return attention_mask(documents, flex_wanted(documents.device, dropout_p))

    def boundary_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """Return the shape of the activation this stage passes on (b, s, h), per tp rank.

        Under sequence parallelism each tp rank holds its 1/t of the sequence.
        """
        t = group_size(self.tp_group)
        seq = self.cfg.seq_len // (self.context.size if self.context is not None else 1)
        seq = seq // t if self.sequence_parallel else seq
        return (micro_batch_size, seq, self.cfg.d_model)

    def decode(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Return the logits (b, 1, vocabulary) of the last of ``ids`` (b, s), read after the
        tokens ``cache`` holds, and add theirs to it: a prompt into an empty cache, or one
        token at a time. The whole model only (one stage, t = 1), in eval mode."""
        s = ids.shape[1]
        self.check_length(cache.length + s)
        positions = torch.arange(cache.length, cache.length + s, device=ids.device)
        hidden = self.embed(ids, positions)
        for block, layer in zip(self.blocks.values(), cache.layers, strict=True):
            hidden = block(hidden, layer, positions)
        return self.head(hidden[:, -1:])

    @torch.no_grad()
    def generate(
        self,
        ids: torch.Tensor,
        new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = 50,
        gen: torch.Generator | None = None,
        kv_cache: bool = True,
    ) -> torch.Tensor:
        """Return ``ids`` extended by ``new_tokens`` sampled tokens.

        With ``kv_cache`` each block keeps the keys and values of the tokens so far, and each
        new token runs through the model alone. Past ``model.seq_len`` tokens the window of
        the last ``seq_len`` slides, as without the cache, and the cache is rebuilt from it;
        the tokens are the uncached path's (temperature 0: the same argmax).
        """
        window = self.cfg.seq_len
        cache = KVCache(len(self.blocks), window) if kv_cache else None
        pending = ids[:, -window:]
        for _ in range(new_tokens):
            if cache is None:
                logits = self(ids[:, -window:])
            else:
                if cache.length + pending.shape[1] > window:  # slide: rebuild from the window
                    cache, pending = KVCache(len(self.blocks), window), ids[:, -window:]
                logits = self.decode(pending, cache)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
            ids = torch.cat([ids, nxt], dim=1)
            pending = nxt
        return ids
