"""GPT-2: learned positions, pre-LayerNorm blocks, tanh GeLU, tied input/output embeddings.

Built from the tensor-parallel layers (:mod:`hpcllm.parallel.tensor.layers`) and the fused-op
dispatch points (:mod:`hpcllm.kernels`); with a tensor-parallel group of one rank they are
plain layers.
The model knows no schedule and no data-parallel engine (its linear layers only offer their
weight gradients for deferral, which zb-h1 uses): a stage is a GPT that
holds some of the blocks, the embedding if it comes first and the output layer if it comes
last (:mod:`hpcllm.model.stages` cuts them); the whole model is the one stage holding all.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpcllm import kernels
from hpcllm.config import ModelConfig, padded_vocab
from hpcllm.parallel.pipeline.zero_bubble import linear
from hpcllm.parallel.random import recompute_context, tp_rng
from hpcllm.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from hpcllm.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark_sequence_parallel,
    normal_init,
    sequence_parallel_linear,
)
from hpcllm.parallel.tensor.mappings import copy_to_tp, gather_from_tp


def tp_size(group: Any) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


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


class KVCache:
    """Every block's :class:`LayerCache`: what :meth:`GPT.decode` keeps between tokens, room
    for ``capacity`` tokens (``model.seq_len``)."""

    def __init__(self, layers: int, capacity: int) -> None:
        self.layers = [LayerCache(capacity) for _ in range(layers)]

    @property
    def length(self) -> int:
        """Return how many tokens are cached."""
        return self.layers[0].length if self.layers else 0


def dropout_rng(group: Any, p: float, training: bool) -> Any:
    """The tensor-parallel stream for a dropout over split activations, when it drops."""
    return tp_rng(group if p > 0 and training else None)


def _eager_checkpoint(function: Any, *args: torch.Tensor) -> torch.Tensor:
    """``checkpoint`` with the tensor-parallel stream's replay (:func:`recompute_context`)."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=recompute_context)


class LayerNorm(nn.Module):
    """LayerNorm through the fused-op dispatch point."""

    def __init__(self, dim: int, eps: float, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        if sequence_parallel:
            mark_sequence_parallel(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(x, self.weight, self.bias, self.eps)


class Attention(nn.Module):
    """Causal self-attention, heads split over the tp group; returns output without bias."""

    def __init__(
        self, cfg: ModelConfig, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        h, t = cfg.d_model, tp_size(group)
        self.group = group
        self.local_heads = cfg.n_head // t
        self.head_dim = h // cfg.n_head
        self.dropout = cfg.dropout
        self.selective = cfg.recompute == "selective"
        self.qkv = ColumnParallelLinear(
            h,
            3 * h,
            group=group,
            gen=gen,
            init=normal_init(cfg.init_std),
            stride=3,
            sequence_parallel=sequence_parallel,
        )
        self.proj = RowParallelLinear(
            h,
            h,
            group=group,
            gen=gen,
            init=normal_init(cfg.init_std / math.sqrt(2 * cfg.n_layer)),
            sequence_parallel=sequence_parallel,
        )

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Heads are split over the tp group: each rank draws its own attention dropout.
        with dropout_rng(self.group, self.dropout, self.training):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )

    def _recomputed_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Return the attention core under ``checkpoint``: its activations rebuilt in backward.

        Compiled (``model.compile``), the compiler replays the region's random draws itself;
        only a tensor-parallel dropout stream needs :func:`recompute_context`, which a
        compiled graph cannot take, so that case runs eagerly.
        """
        if not torch.compiler.is_compiling():
            return _eager_checkpoint(self._core, q, k, v)
        if self.dropout > 0 and self.group is not None:  # a graph break, then eager
            return torch.compiler.disable(_eager_checkpoint)(self._core, q, k, v)
        return checkpoint(self._core, q, k, v, use_reentrant=False)

    def forward(
        self, x: torch.Tensor, add_bias: bool = False, cache: LayerCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (output, bias): the output projection's bias added to it (then None) or not.

        With ``cache`` (generation) x holds the new tokens, which attend to the cached ones.
        """
        qkv = self.qkv(x)  # (b, s, 3h/t): the whole sequence, even under sequence parallelism
        b, s, _ = qkv.shape
        q, k, v = (
            part.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
            for part in qkv.chunk(3, dim=-1)
        )
        if cache is not None:
            y = cached_attention(q, k, v, cache)
        elif self.selective and self.training:
            # Korthikanti et al.: the attention core holds the s² activations and is cheap to
            # recompute; keeping everything else stored costs little memory.
            y = self._recomputed_core(q, k, v)
        else:
            y = self._core(q, k, v)
        y = y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj(y, add_bias=add_bias), None if add_bias else self.proj.bias


class MLP(nn.Module):
    """h → 4h (column-parallel) → GeLU → h (row-parallel); returns output without bias."""

    def __init__(
        self, cfg: ModelConfig, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        h = cfg.d_model
        self.fc = ColumnParallelLinear(
            h,
            4 * h,
            group=group,
            gen=gen,
            init=normal_init(cfg.init_std),
            sequence_parallel=sequence_parallel,
        )
        self.proj = RowParallelLinear(
            4 * h,
            h,
            group=group,
            gen=gen,
            init=normal_init(cfg.init_std / math.sqrt(2 * cfg.n_layer)),
            sequence_parallel=sequence_parallel,
        )

    def forward(
        self, x: torch.Tensor, add_bias: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (output, bias) as :meth:`Attention.forward` does.

        With ``add_bias`` each matmul adds its bias itself (``addmm``), as plain PyTorch does
        where no fused kernel takes the bias.
        """
        if add_bias:
            y = kernels.bias_gelu(self.fc(x), None)
        else:
            y = kernels.bias_gelu(self.fc(x, add_bias=False), self.fc.bias)
        return self.proj(y, add_bias=add_bias), None if add_bias else self.proj.bias


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then + mlp(ln(x)).

    With sequence parallelism x is this rank's part of the sequence, and so are the
    LayerNorms and the dropout-residual adds; their dropout then comes from the tensor-parallel
    stream, since each rank holds different positions.
    """

    # A family built on GPT-2 swaps its MLP here: the class is called as MLP is, and returns
    # (output, bias or None) with its output projection's bias as ``proj.bias``.
    mlp_class: type[nn.Module] = MLP

    def __init__(
        self, cfg: ModelConfig, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        sp = sequence_parallel and tp_size(group) > 1
        self.ln1 = LayerNorm(cfg.d_model, cfg.layer_norm_eps, sp)
        self.attn = Attention(cfg, group, gen, sp)
        self.ln2 = LayerNorm(cfg.d_model, cfg.layer_norm_eps, sp)
        self.mlp = self.mlp_class(cfg, group, gen, sp)
        self.dropout = cfg.dropout
        self.rng_group = group if sp else None
        if sp:
            mark_sequence_parallel(self.attn.proj.bias, self.mlp.proj.bias)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        # Fused kernels take the biases; the torch path adds them in the matmuls.
        add_bias = not kernels.fused(x)
        out, bias = self.attn(self.ln1(x), add_bias, cache)
        with dropout_rng(self.rng_group, self.dropout, self.training):
            x = kernels.bias_dropout_add(out, bias, x, self.dropout, self.training)
        out, bias = self.mlp(self.ln2(x), add_bias)
        with dropout_rng(self.rng_group, self.dropout, self.training):
            return kernels.bias_dropout_add(out, bias, x, self.dropout, self.training)


class GPT(nn.Module):
    """The whole GPT (or, with ``tp_group``, this rank's tensor-parallel shard of it).

    ``vocab_size`` is the tokenizer's; the embedding is padded to a multiple of 128·t and the
    padded rows never reach the loss or the returned logits. ``sequence_parallel`` (with a tp
    group of more than one rank) splits the activations between tensor-parallel layers along
    the sequence, which must then divide by t.

    A pipeline stage is a GPT with ``layers`` (global block indices), the embedding if
    ``pre`` and the final LayerNorm and output layer if ``post``. Blocks it does not hold are
    still drawn from the generator, and dropped, so every weight it holds equals the whole
    model's; its state-dict keys are the whole model's too (``blocks.7.…``).
    """

    block_class: type[Block] = Block  # a family built on GPT-2 swaps its block here

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
    ) -> None:
        super().__init__()
        layers, gen = self.setup(cfg, vocab_size, tp_group, seed, sequence_parallel, layers)
        self.pre, self.post = pre, post
        # The output layer is tied to the token embedding: a last stage keeps its own copy.
        wte = VocabParallelEmbedding(
            self.padded_vocab,
            cfg.d_model,
            group=tp_group,
            gen=gen,
            init=normal_init(cfg.init_std),
            real_rows=vocab_size,
            sequence_parallel=self.sequence_parallel,
        )
        wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        normal_init(cfg.init_std)(wpe.weight, gen)
        if pre or post:
            self.wte = wte
        if pre:
            self.wpe = wpe
            if self.sequence_parallel:
                mark_sequence_parallel(self.wpe.weight)
        blocks = {}
        for index in range(cfg.n_layer):
            block = self.block_class(cfg, tp_group, gen, self.sequence_parallel)
            if index in layers:
                blocks[str(index)] = block
        self.blocks = nn.ModuleDict(blocks)
        if post:
            self.ln_f = LayerNorm(cfg.d_model, cfg.layer_norm_eps, self.sequence_parallel)

    def setup(
        self,
        cfg: ModelConfig,
        vocab_size: int,
        tp_group: Any,
        seed: int,
        sequence_parallel: bool,
        layers: range | None,
    ) -> tuple[range, torch.Generator]:
        """Set what every family's stage keeps (config, vocabulary and its padding, the tp
        group, sequence parallelism); return the blocks it holds and the weights' generator."""
        self.cfg = cfg
        self.vocab_size = vocab_size
        t = tp_size(tp_group)
        self.padded_vocab = padded_vocab(vocab_size, t)
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel and t > 1
        return (
            range(cfg.n_layer) if layers is None else layers,
            torch.Generator().manual_seed(seed),
        )

    def check_length(self, s: int) -> None:
        """Raise a ValueError for a sequence of ``s`` tokens this stage cannot take."""
        if s > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {s} tokens is longer than model.seq_len {self.cfg.seq_len}"
            )
        t = tp_size(self.tp_group)
        if self.sequence_parallel and s % t:
            raise ValueError(
                f"sequence parallelism splits the {s} tokens of a sequence over {t} "
                f"tensor-parallel ranks; use a length divisible by {t}"
            )

    def dropout_embedding(self, x: torch.Tensor) -> torch.Tensor:
        """Return the embedding ``x`` after dropout (the tp stream's under SP)."""
        with dropout_rng(
            self.tp_group if self.sequence_parallel else None, self.cfg.dropout, self.training
        ):
            return F.dropout(x, self.cfg.dropout, self.training)

    def embed(self, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Return token + position embeddings (after dropout) for ``ids`` of shape (b, s), at
        positions from ``offset`` (the tokens cached before them).

        Under sequence parallelism, those of this rank's part of the sequence.
        """
        s = ids.shape[1]
        self.check_length(offset + s)
        pos = torch.arange(offset, offset + s, device=ids.device)
        if self.sequence_parallel:
            t = tp_size(self.tp_group)
            pos = pos.chunk(t)[torch.distributed.get_rank(self.tp_group)]
        return self.dropout_embedding(self.wte(ids) + self.wpe(pos))

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Return x after every block, recomputing each in backward under ``recompute: full``."""
        full = self.cfg.recompute == "full" and self.training and torch.is_grad_enabled()
        for block in self.blocks.values():
            x = (
                checkpoint(block, x, use_reentrant=False, context_fn=recompute_context)
                if full
                else block(x)
            )
        return x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """Return the last stage's norm of ``x`` (GPT-2's final LayerNorm)."""
        return self.ln_f(x)

    def output_layer(self) -> VocabParallelEmbedding:
        """Return the vocabulary-parallel weight the logits come from: the embedding (tied)."""
        return self.wte

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
        if tp_size(self.tp_group) > 1:
            if labels is not None:
                return vocab_parallel_cross_entropy(
                    logits, labels, self.tp_group, out.vocab_start, self.vocab_size
                )
            logits = gather_from_tp(logits, self.tp_group)
        if labels is not None:  # padding columns are masked, not sliced off (no copy)
            return kernels.cross_entropy(logits, labels, vocab_size=self.vocab_size)
        return logits[..., : self.vocab_size]

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Return the mean cross-entropy against ``labels``, or the logits when none.

        A stage without the embedding (not ``pre``) takes the previous stage's activation as
        ``inputs``; one without the output layer (not ``post``) returns its activation.
        """
        hidden = self.embed(inputs) if self.pre else inputs
        hidden = self.run_blocks(hidden)
        return self.head(hidden, labels) if self.post else hidden

    def boundary_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """Return the shape of the activation this stage passes on (b, s, h), per tp rank.

        Under sequence parallelism each tp rank holds its 1/t of the sequence.
        """
        t = tp_size(self.tp_group)
        seq = self.cfg.seq_len // t if self.sequence_parallel else self.cfg.seq_len
        return (micro_batch_size, seq, self.cfg.d_model)

    def decode(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Return the logits (b, 1, vocabulary) of the last of ``ids`` (b, s), read after the
        tokens ``cache`` holds, and add theirs to it: a prompt into an empty cache, or one
        token at a time. The whole model only (one stage, t = 1), in eval mode."""
        hidden = self.embed(ids, offset=cache.length)
        for block, layer in zip(self.blocks.values(), cache.layers, strict=True):
            hidden = block(hidden, layer)
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


def count_parameters(model: nn.Module) -> int:
    """Return the number of parameters this rank holds."""
    return sum(p.numel() for p in model.parameters())
