"""The Llama family's spec (torch-free); its torch half is ``hpcllm.model.llama.Llama``.

Pre-RMSNorm blocks without biases, rotary position embeddings (with Llama 3.1's frequency
scaling), grouped-query attention (``model.n_kv_heads`` key/value heads shared by
``n_head / n_kv_heads`` query heads each), a SwiGLU MLP (SiLU(x·G) ⊙ (x·U) → D) and an
output layer tied to the token embedding or not (``model.tie_embeddings``). Shapes from Meta's
model cards and configuration files: Llama 3 (8B, 70B), Llama 3.1 (405B), Llama 3.2 (1B);
with experts, Mixtral 8x7B and Qwen3-30B-A3B. Qwen's attention variants are keys of the
family: heads ``model.head_dim`` wide whatever d_model is, biases on q, k and v
(``model.qkv_bias``, Qwen2's) and an RMSNorm over each head's queries and keys before the
rotation (``model.qk_norm``, Qwen3's), so that Qwen2's and Qwen3's checkpoints, dense and MoE,
come in and go out as this family's (:func:`hf_kind`).

Tensor parallelism (Megatron's): q column-parallel by head; k and v split by head when t
divides ``n_kv_heads``, and when ``n_kv_heads`` divides t each key/value head lives on the
``t / n_kv_heads`` ranks whose query heads use it (its gradient summed over them, counted once
in the gradient norm and the parameter count); the SwiGLU's gate and up column-parallel, its
down projection row-parallel. The q, k and v biases split with their matrices; the q and k
norms' weights are whole on every rank, each applying them to its own heads, so their
gradients sum over t (the ``tp-sum`` kind).

FLOPs are Megatron's count (Narayanan et al., SC21) with the family's own matrices: per token
and layer forward 2·(2h² + 2·h·k) for q, o, k and v (k = n_kv_heads·head_dim), 6·h·f for the
three MLP matrices (f the MLP width), 4·s·h for the attention scores and their weighting;
2·h·V for the logits; backward twice the forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpcllm.families import Family, HFSize, HFTensor, Shape, TensorRule, hf_layer_count, register
from hpcllm.keys import ABOVE_ZERO, POSITIVE, key
from hpcllm.user_error import UserError


@dataclass
class LlamaKeys:
    """Llama's own model keys: grouped-query attention, the SwiGLU's width, rotary positions
    (with Llama 3.1's frequency scaling) and whether the output layer is the embedding."""

    n_kv_heads: int | None = key(
        None, "key/value heads, grouped-query attention (llama); null: n_head", POSITIVE
    )
    ffn_size: int | None = key(
        None, "MLP width (llama); null: Meta's rule, ffn_multiplier and ffn_multiple_of", POSITIVE
    )
    ffn_multiplier: float | None = key(
        None, "Meta's MLP width multiplier of 2/3 of 4 x d_model (llama); null: 1", ABOVE_ZERO
    )
    ffn_multiple_of: int = key(
        256, "the MLP width rounds up to a multiple of this (llama)", POSITIVE
    )
    rope_theta: float = key(10000.0, "the rotary embeddings' base (llama)", ABOVE_ZERO)
    rope_scaling: float | None = key(
        None, "Llama 3.1's rotary frequency scaling factor (llama); null: no scaling", ABOVE_ZERO
    )
    rope_low_freq_factor: float = key(1.0, "Llama 3.1 scaling's low frequency factor", ABOVE_ZERO)
    rope_high_freq_factor: float = key(4.0, "Llama 3.1 scaling's high frequency factor", ABOVE_ZERO)
    rope_original_seq_len: int = key(
        8192, "the context the scaled rotary frequencies were trained at (llama)", POSITIVE
    )
    # Null rather than false, so that a preset's true fills it as a preset fills any unset key.
    tie_embeddings: bool | None = key(
        None, "the output layer is the token embedding (llama); null: untied"
    )
    # Qwen's attention variants (null and false rather than a preset's choice, as above).
    head_dim: int | None = key(
        None, "each attention head's width (llama; Qwen3, Mistral-Nemo); null: d_model / n_head",
        POSITIVE,
    )  # fmt: skip
    qkv_bias: bool | None = key(None, "biases on q, k and v (llama; Qwen2); null: none")
    qk_norm: bool | None = key(
        None, "an RMSNorm over each head's queries and keys before the rotation (llama; Qwen3)"
    )


_LLAMA3 = {
    "vocab_size": 128256,
    "seq_len": 8192,  # Llama 3's pre-training context
    "n_kv_heads": 8,
    "rope_theta": 500000.0,
    "layer_norm_eps": 1e-5,
}
# Llama 3.1's rope scaling (its 128K context): factor, low/high frequency factors, context.
_SCALED = {
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_seq_len": 8192,
}
PRESETS: dict[str, dict[str, Any]] = {
    # A CPU-sized model with every feature: GQA (2 query heads per kv head), scaled rope.
    "llama-tiny": {
        "n_layer": 4,
        "n_head": 4,
        "n_kv_heads": 2,
        "d_model": 128,
        "seq_len": 128,
        "ffn_size": 352,
        "rope_theta": 10000.0,
        "rope_scaling": 4.0,
        "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0,
        "rope_original_seq_len": 32,
        "tie_embeddings": False,
    },
    "llama3.2-1b": {
        **_LLAMA3,
        **_SCALED,
        "n_layer": 16,
        "n_head": 32,
        "d_model": 2048,
        "ffn_size": 8192,
        "rope_scaling": 32.0,
        "tie_embeddings": True,
    },
    "llama3-8b": {
        **_LLAMA3,
        "n_layer": 32,
        "n_head": 32,
        "d_model": 4096,
        "ffn_size": 14336,
        "tie_embeddings": False,
    },
    "llama3-70b": {
        **_LLAMA3,
        "n_layer": 80,
        "n_head": 64,
        "d_model": 8192,
        "ffn_size": 28672,
        "tie_embeddings": False,
    },
    "llama3.1-405b": {
        **_LLAMA3,
        **_SCALED,
        "n_layer": 126,
        "n_head": 128,
        "d_model": 16384,
        "ffn_size": 53248,
        "rope_scaling": 8.0,
        "tie_embeddings": False,
    },
    # Mixtral 8x7B (Jiang et al., "Mixtral of Experts", 2024, and its config.json): Mistral
    # 7B's shape with each MLP 8 experts of the same width, 2 per token (softmax over the
    # top 2), 46.7B parameters, 12.9B active per token.
    "mixtral-8x7b": {
        "n_layer": 32,
        "n_head": 32,
        "n_kv_heads": 8,
        "d_model": 4096,
        "ffn_size": 14336,
        "seq_len": 32768,
        "vocab_size": 32000,
        "rope_theta": 1000000.0,
        "layer_norm_eps": 1e-5,
        "tie_embeddings": False,
        "moe_experts": 8,
        "moe_top_k": 2,
        "moe_ffn_size": 14336,
        "moe_router": "topk-softmax",
        "moe_aux_loss": 0.02,
    },
    # A CPU-sized Mixtral: llama-tiny's attention, 4 experts of 96, 2 per token.
    "mixtral-tiny": {
        "n_layer": 2,
        "n_head": 4,
        "n_kv_heads": 2,
        "d_model": 64,
        "seq_len": 128,
        "ffn_size": 96,
        "rope_theta": 10000.0,
        "tie_embeddings": False,
        "moe_experts": 4,
        "moe_top_k": 2,
        "moe_ffn_size": 96,
        "moe_router": "topk-softmax",
    },
    # Qwen3-30B-A3B (Qwen3 Technical Report, 2025, and its config.json): 48 blocks of 128
    # experts of width 768, 8 per token (softmax over all, the 8 renormalised), q and k
    # normed per head, 32 query heads of 128 over a hidden size of 2048 (head_dim is free),
    # 4 key/value heads; 30.5B parameters, 3.3B active per token. seq_len: the 4,096 tokens of
    # its general pre-training stages (the report's S1 and S2).
    "qwen3-30b-a3b": {
        "n_layer": 48,
        "n_head": 32,
        "n_kv_heads": 4,
        "head_dim": 128,
        "qk_norm": True,
        "d_model": 2048,
        "ffn_size": 6144,
        "seq_len": 4096,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "layer_norm_eps": 1e-6,
        "tie_embeddings": False,
        "moe_experts": 128,
        "moe_top_k": 8,
        "moe_ffn_size": 768,
        "moe_router": "softmax-topk",
        "moe_renormalize": True,
        "moe_aux_loss": 0.001,
    },
    # A CPU-sized Qwen3-MoE: heads of 24 over a hidden size of 64 (4 × 24 = 96), q/k norms,
    # 4 experts of 48, 2 per token.
    "qwen3-moe-tiny": {
        "n_layer": 2,
        "n_head": 4,
        "n_kv_heads": 2,
        "head_dim": 24,
        "qk_norm": True,
        "d_model": 64,
        "seq_len": 128,
        "ffn_size": 96,
        "rope_theta": 10000.0,
        "tie_embeddings": False,
        "moe_experts": 4,
        "moe_top_k": 2,
        "moe_ffn_size": 48,
        "moe_router": "softmax-topk",
        "moe_renormalize": True,
    },
}


def ffn_size(model: Any) -> int:
    """Return the MLP width: ``model.ffn_size``, or Meta's rule (2/3 of 4h, times
    ``ffn_multiplier``, rounded up to a multiple of ``ffn_multiple_of``)."""
    if model.ffn_size is not None:
        return int(model.ffn_size)
    hidden = int(2 * 4 * model.d_model / 3)
    if model.ffn_multiplier is not None:
        hidden = int(model.ffn_multiplier * hidden)
    return model.ffn_multiple_of * math.ceil(hidden / model.ffn_multiple_of)


def kv_heads(model: Any) -> int:
    """Return the key/value heads (``n_kv_heads``; null: one per query head)."""
    return int(model.n_kv_heads or model.n_head)


def head_dim(model: Any) -> int:
    """Return each attention head's width (``head_dim``; null: d_model / n_head)."""
    return int(model.head_dim or model.d_model // model.n_head)


def _kv(shape: Shape) -> int:
    """Return the key (or value) projection's width: kv heads × head size."""
    return (shape.kv_heads or shape.heads) * shape.head_size


def _layer_forward(batch: int, shape: Shape) -> float:
    h, s, a = shape.hidden, shape.seq, shape.attention_width
    per_token = 4 * h * a + 4 * h * _kv(shape) + 6 * h * (shape.ffn or 4 * h) + 4 * s * a
    return float(batch * s * per_token)


def step_flops(batch: int, shape: Shape, recompute: str) -> float:
    """Return the FLOPs of one training step on ``batch`` sequences (see the docstring; with
    a free head_dim, q, o and the attention core take the heads' width a = heads × head_dim
    where the docstring says h).

    Forward + backward is 3 forwards; full recomputation runs every layer's forward once
    more (not the output layer's), selective the attention core's 4·B·s²·a per layer.
    """
    layers = shape.layers * _layer_forward(batch, shape)
    logits = 2.0 * batch * shape.seq * shape.hidden * shape.vocab
    flops = 3 * (layers + logits)
    if recompute == "full":
        flops += layers
    elif recompute == "selective":
        flops += 4.0 * batch * shape.seq * shape.seq * shape.attention_width * shape.layers
    return flops


def _attention_extras(shape: Shape) -> tuple[int, int]:
    """Return the attention's parameters besides its matrices: (the q, k and v biases, split
    with their matrices; the q and k norms' weights, whole on every tp rank)."""
    biases = shape.attention_width + 2 * _kv(shape) if shape.qkv_bias else 0
    return biases, 2 * shape.head_size if shape.qk_norm else 0


def parameters(shape: Shape) -> int:
    """Return the parameter count: per layer 2·h·a (q, o; a = heads × head size) + 2·h·k
    (k, v) + 3·h·f + 2h (the norms), and the q, k and v biases (a + 2k) and the q and k norms
    (2 × head size) where the model has them; the embedding, the output layer when untied,
    the final norm."""
    h = shape.hidden
    split, whole = layer_parameters(shape)
    head = 0 if shape.tied else shape.vocab * h
    return shape.layers * (split + whole) + shape.vocab * h + head + h


def layer_parameters(shape: Shape) -> tuple[int, int]:
    """Return one layer's parameters (split over t, whole on every rank): every matrix and
    the q, k and v biases are split (replicated key/value heads count as split); the two
    norms and the q and k norms are whole."""
    h, a = shape.hidden, shape.attention_width
    biases, norms = _attention_extras(shape)
    matrices = 2 * h * a + 2 * h * _kv(shape) + 3 * h * (shape.ffn or 4 * h)
    return matrices + biases, 2 * h + norms


def first_parameters(shape: Shape, t: int) -> float:
    """Return the first stage's parameters outside its layers on one tp rank: the token
    embedding, padded to a multiple of 128·t rows and split."""
    rows = -(-shape.vocab // (128 * t)) * 128 * t
    return rows * shape.hidden / t


def last_parameters(shape: Shape, t: int) -> float:
    """Return the last stage's parameters after its layers on one tp rank: the final norm,
    and the output layer when it is not tied to the embedding (padded to 128·t rows, split)."""
    if shape.tied:
        return shape.hidden
    rows = -(-shape.vocab // (128 * t)) * 128 * t
    return shape.hidden + rows * shape.hidden / t


def activation_factor(shape: Shape, t: int, sequence_parallel: bool, flash: bool) -> float:
    """Return one layer's stored activations in units of s·b·h (16-bit values), counted as
    Korthikanti et al. count GPT's: whole on every tp rank, the two norms' inputs (2 + 2) and
    outputs, the inputs of the attention and MLP projections (2 + 2); split over t, q (2), k
    and v (2·k/h each), the attention output (2), the MLP's gate and up outputs and their
    SiLU product (3 · 2·f/h); with a free head_dim, q and the attention output are 2·a/h
    each (a = heads × head size), and q/k norms keep their inputs too (2·a/h + 2·k/h). No
    dropout masks. Sequence parallelism splits the whole ones too; unfused attention adds its
    scores and softmax, 2.5·heads·s/(h·t)."""
    h = shape.hidden
    kv, f, a = _kv(shape) / h, (shape.ffn or 4 * h) / h, shape.attention_width / h
    split = 2 * a + 4 * kv + 2 * a + 6 * f
    if shape.qk_norm:  # the norms' inputs: q and k before them
        split += 2 * a + 2 * kv
    whole = 8
    stored = (split + whole) / t if sequence_parallel and t > 1 else whole + split / t
    scores = 0.0 if flash else 2.5 * shape.heads * shape.seq / (shape.hidden * t)
    return stored + scores


def layer_gemms(rows: int, shape: Shape, t: int) -> list[tuple[int, int, int]]:
    """Return one layer's forward GEMMs (M, N, K) on ``rows`` tokens at tensor-parallel t."""
    h, f, a = shape.hidden, shape.ffn or 4 * shape.hidden, shape.attention_width
    kv = max(shape.head_size, _kv(shape) // t)  # replicated heads: one per rank
    return [
        (rows, a // t, h),  # q
        (rows, kv, h),  # k
        (rows, kv, h),  # v
        (rows, h, a // t),  # attention output
        (rows, f // t, h),  # gate
        (rows, f // t, h),  # up
        (rows, h, f // t),  # down
    ]


def split_pointwise_values(shape: Shape, t: int) -> float:
    """Return the values per token the SwiGLU activation (gate and up read, product written:
    3f) and the rotation of q and k (each read and written; normed first, twice that) move
    on one tp rank."""
    f = shape.ffn or 4 * shape.hidden
    passes = 4 if shape.qk_norm else 2
    return (3 * f + passes * (shape.attention_width + _kv(shape))) / t


def check(model: Any, tp: int) -> None:
    """Raise a UserError for a Llama shape or tensor-parallel size that cannot work."""
    heads, kv = model.n_head, kv_heads(model)
    if heads % kv:
        raise UserError(f"model.n_head {heads} is not a multiple of model.n_kv_heads {kv}")
    if head_dim(model) % 2:
        size = "model.head_dim" if model.head_dim else "the head size d_model / n_head ="
        raise UserError(f"rotary embeddings rotate pairs: {size} {head_dim(model)} must be even")
    if kv % tp and tp % kv:
        raise UserError(
            f"model.n_kv_heads {kv} and parallel.tp {tp}: one must divide the other (kv heads "
            "split over the ranks, or each kv head on tp / n_kv_heads ranks)"
        )
    if ffn_size(model) % tp:
        raise UserError(f"the MLP width {ffn_size(model)} is not divisible by parallel.tp {tp}")
    if model.rope_scaling is not None and model.rope_high_freq_factor <= model.rope_low_freq_factor:
        raise UserError(
            f"model.rope_high_freq_factor {model.rope_high_freq_factor} must be above "
            f"model.rope_low_freq_factor {model.rope_low_freq_factor}"
        )


_BLOCK = r"blocks\.\d+\."
TENSORS = (
    # The token embedding, padded to 128·t rows and split by rows; tied: the output layer too.
    TensorRule(r"wte\.weight", (0, 1), "local", "first+last", padded=True),
    TensorRule(r"lm_head\.weight", (0, 1), "local", "last", padded=True),
    TensorRule(_BLOCK + r"norm[12]\.weight", None, "tp-sum-if-sequence-parallel", "block"),
    TensorRule(_BLOCK + r"attn\.q\.(weight|bias)", (0, 1), "local", "block"),
    # Split by head, or (n_kv_heads < t) a head replicated on the ranks that use it.
    TensorRule(_BLOCK + r"attn\.[kv]\.(weight|bias)", (0, 1), "kv-replicas", "block"),
    # Qwen3's per-head norms: one weight for every head, each tp rank applying it to its own.
    TensorRule(_BLOCK + r"attn\.[qk]_norm\.weight", None, "tp-sum", "block"),
    TensorRule(_BLOCK + r"attn\.proj\.weight", (1, 1), "local", "block"),
    TensorRule(_BLOCK + r"mlp\.(gate|up)\.weight", (0, 1), "local", "block"),
    TensorRule(_BLOCK + r"mlp\.proj\.weight", (1, 1), "local", "block"),
    TensorRule(r"norm_f\.weight", None, "tp-sum-if-sequence-parallel", "last"),
)

# The Hugging Face kinds this family reads and writes (config.json's model_type): Llama,
# Mixtral (Llama with experts), Qwen2 (q, k and v biases), Qwen3 (per-head q and k norms,
# a free head_dim) and their mixtures of experts.
QWEN_MOE = ("qwen2_moe", "qwen3_moe")
KINDS = ("llama", "mixtral", "qwen2", "qwen3", *QWEN_MOE)

# Hugging Face's LlamaForCausalLM: the same matrices, the same rotary convention (each head's
# halves pair up), so no tensor is permuted or transposed. A tied model has no lm_head.
# Qwen's models name the same parts alike.
HF_TENSORS = (
    HFTensor("wte.weight", "model.embed_tokens.weight"),
    HFTensor("lm_head.weight", "lm_head.weight"),
    HFTensor("norm_f.weight", "model.norm.weight"),
    HFTensor("blocks.{i}.norm1.weight", "model.layers.{i}.input_layernorm.weight"),
    HFTensor("blocks.{i}.attn.q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    HFTensor("blocks.{i}.attn.k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    HFTensor("blocks.{i}.attn.v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    HFTensor("blocks.{i}.attn.proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    HFTensor("blocks.{i}.attn.q.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    HFTensor("blocks.{i}.attn.k.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    HFTensor("blocks.{i}.attn.v.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    HFTensor("blocks.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    HFTensor("blocks.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    HFTensor("blocks.{i}.norm2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    HFTensor("blocks.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    HFTensor("blocks.{i}.mlp.up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    HFTensor("blocks.{i}.mlp.proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    # MixtralForCausalLM's MoE blocks: the hub's files hold each expert's w1 (gate), w3 (up)
    # and w2 (down) apart and the router as block_sparse_moe.gate; transformers 5's modules
    # stack them (gate and up fused in gate_up_proj, gate first), which a file saved from its
    # state dict holds. Both read; the hub's form written (transformers 5 reads it too).
    # Qwen-MoE's hub files name each expert's gate_proj, up_proj and down_proj under
    # mlp.experts and the router mlp.gate; its shared expert is one more MLP, gated by
    # shared_expert_gate (a sigmoid of one output).
    HFTensor(
        "blocks.{i}.mlp.router.weight",
        "model.layers.{i}.block_sparse_moe.gate.weight",
        kinds=("mixtral",),
    ),
    HFTensor(
        "blocks.{i}.mlp.router.weight",
        "model.layers.{i}.mlp.gate.weight",
        alternative=True,
        kinds=("mixtral",),
    ),
    HFTensor("blocks.{i}.mlp.router.weight", "model.layers.{i}.mlp.gate.weight", kinds=QWEN_MOE),
    HFTensor(
        "blocks.{i}.mlp.experts.gate",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
        kinds=("mixtral",),
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.gate",
        "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
        kinds=QWEN_MOE,
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.up",
        "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
        kinds=QWEN_MOE,
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.proj",
        "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
        kinds=QWEN_MOE,
    ),
    HFTensor(
        "blocks.{i}.mlp.shared.gate",
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        one_expert=True,
        kinds=QWEN_MOE,
    ),
    HFTensor(
        "blocks.{i}.mlp.shared.up",
        "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        one_expert=True,
        kinds=QWEN_MOE,
    ),
    HFTensor(
        "blocks.{i}.mlp.shared.proj",
        "model.layers.{i}.mlp.shared_expert.down_proj.weight",
        one_expert=True,
        kinds=QWEN_MOE,
    ),
    HFTensor(
        "blocks.{i}.mlp.shared_gate.weight",
        "model.layers.{i}.mlp.shared_expert_gate.weight",
        kinds=QWEN_MOE,
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.gate",
        "model.layers.{i}.mlp.experts.gate_up_proj",
        part=(1, 0, 2),
        alternative=True,
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.up",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
        kinds=("mixtral",),
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.up",
        "model.layers.{i}.mlp.experts.gate_up_proj",
        part=(1, 1, 2),
        alternative=True,
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.proj",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
        kinds=("mixtral",),
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.proj", "model.layers.{i}.mlp.experts.down_proj", alternative=True
    ),
)

# transformers' defaults where a config.json is silent (its Config classes), by kind: the
# experts' count, the tokens' experts, the balancing loss, and Qwen's widths and routing.
MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
    "qwen2_moe": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "router_aux_loss_coef": 0.001,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "qkv_bias": True,
    },
    "qwen3_moe": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "router_aux_loss_coef": 0.001,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
    },
}
# The key that counts the routed experts, by kind, and the other name transformers reads
# (and transformers 5 writes Qwen3-MoE's under; the hub's files name num_experts).
EXPERTS_KEY = {
    "mixtral": "num_local_experts",
    "qwen2_moe": "num_experts",
    "qwen3_moe": "num_experts",
}
EXPERTS_ALSO = {"mixtral": "num_experts", "qwen3_moe": "num_local_experts"}


def _experts_given(hf: dict, kind: str) -> tuple[int, bool]:
    """Return (the routed experts a ``kind`` config.json gives, or transformers' default;
    whether it gives them)."""
    for name in (EXPERTS_KEY[kind], EXPERTS_ALSO.get(kind)):
        if name in hf:
            return hf[name], True
    return MOE_DEFAULTS[kind][EXPERTS_KEY[kind]], False


# The architectures entry of each kind's config.json.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def hf_kind(model: Any) -> str:
    """Return the Hugging Face model_type a Llama-family model config is written as: Qwen3
    with q/k norms, Qwen2 with q/k/v biases (with a shared expert too: Qwen2-MoE), Mixtral
    with experts alone, else Llama."""
    if model.moe_experts:
        if model.qk_norm:
            return "qwen3_moe"
        return "qwen2_moe" if model.qkv_bias or model.moe_shared_ffn_size else "mixtral"
    return "qwen3" if model.qk_norm else "qwen2" if model.qkv_bias else "llama"


def _refusal(model: Any, kind: str) -> str | None:
    """Return why ``model`` has no form of Hugging Face's ``kind``, None where it has one."""
    from hpcllm.config import moe_layers  # the config layer, torch-free

    if model.qk_norm and model.qkv_bias:
        return (
            "Qwen3's attention_bias puts a bias on o_proj too, so q/k/v biases with q/k norms "
            "(model.qkv_bias with model.qk_norm) have no Hugging Face model"
        )
    if not model.moe_experts:
        return None
    if model.moe_router == "sigmoid":
        return f"{ARCHITECTURES[kind]}'s router is a softmax (model.moe_router: sigmoid)"
    if kind == "mixtral":
        dense = sorted(set(range(model.n_layer)) - set(moe_layers(model)))
        if dense:
            return f"every block of a Mixtral is MoE, and this model keeps blocks {dense} dense"
        if model.moe_router == "softmax-topk" and not model.moe_renormalize:
            return (
                "Mixtral's router weighs the top k by a softmax over them (model.moe_router: "
                "topk-softmax, or softmax-topk with model.moe_renormalize: true)"
            )
    if kind == "qwen3_moe" and model.moe_shared_ffn_size:
        return "Qwen3-MoE has no shared expert (model.moe_shared_ffn_size)"
    if kind == "qwen2_moe" and not (model.moe_shared_ffn_size and model.moe_shared_gate):
        return (
            "Qwen2-MoE's blocks have a shared expert with a sigmoid gate "
            "(model.moe_shared_ffn_size and model.moe_shared_gate: true)"
        )
    return None


def _moe_config(model: Any, kind: str) -> dict[str, Any]:
    """Return the experts' part of a ``kind`` config.json (Mixtral or Qwen-MoE)."""
    from hpcllm.config import moe_layers  # the config layer, torch-free

    width = model.moe_ffn_size or ffn_size(model)
    routing = {
        EXPERTS_KEY[kind]: model.moe_experts,
        "num_experts_per_tok": model.moe_top_k,
        "router_aux_loss_coef": model.moe_aux_loss,
        "output_router_logits": False,
    }
    if kind == "mixtral":
        return {**routing, "intermediate_size": width, "router_jitter_noise": 0.0}
    sparse = set(moe_layers(model))
    own = {
        **routing,
        "moe_intermediate_size": width,
        "norm_topk_prob": model.moe_router == "topk-softmax" or bool(model.moe_renormalize),
        "decoder_sparse_step": model.moe_every,
        # The blocks the step rule makes MoE that this model keeps dense.
        "mlp_only_layers": [
            i for i in range(model.n_layer) if (i + 1) % model.moe_every == 0 and i not in sparse
        ],
    }
    if kind == "qwen2_moe":
        own["shared_expert_intermediate_size"] = model.moe_shared_ffn_size
    return own


def hf_config(model: Any, vocab_size: int, special: dict[str, Any]) -> dict:
    """Return the config.json of the Hugging Face model ``model`` is (:func:`hf_kind`:
    LlamaForCausalLM, MixtralForCausalLM, Qwen2's or Qwen3's, dense or MoE); a UserError
    where it is none of them.

    Rotary settings as ``rope_theta`` + ``rope_scaling`` (transformers 4 writes them so, and
    transformers 5 reads them too); ``special``: its ``bos_token_id`` and ``eos_token_id``.
    """
    kind = hf_kind(model)
    refusal = _refusal(model, kind)
    if refusal is not None:
        raise UserError(f"this model has no Hugging Face form: {refusal}")
    scaling = None
    if model.rope_scaling is not None:
        scaling = {
            "rope_type": "llama3",
            "factor": float(model.rope_scaling),
            "low_freq_factor": float(model.rope_low_freq_factor),
            "high_freq_factor": float(model.rope_high_freq_factor),
            "original_max_position_embeddings": int(model.rope_original_seq_len),
        }
    config = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": ffn_size(model),
        "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head,
        "num_key_value_heads": kv_heads(model),
        "head_dim": head_dim(model),
        "hidden_act": "silu",
        "max_position_embeddings": model.seq_len,
        "rms_norm_eps": model.layer_norm_eps,
        "initializer_range": model.init_std,
        "tie_word_embeddings": bool(model.tie_embeddings),
        "rope_theta": float(model.rope_theta),
        "rope_scaling": scaling,
        "attention_dropout": model.dropout,
        "use_cache": True,
        "bos_token_id": special.get("bos_token_id"),
        "eos_token_id": special.get("eos_token_id"),
    }
    if kind == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif kind == "mixtral":
        config["sliding_window"] = None
    else:  # Qwen's
        config.update(
            use_sliding_window=False, sliding_window=None, max_window_layers=model.n_layer
        )
        if kind in ("qwen3", "qwen3_moe"):
            config["attention_bias"] = False
        if kind == "qwen2_moe":
            config["qkv_bias"] = bool(model.qkv_bias)
    if model.moe_experts:
        config.update(_moe_config(model, kind))
    return config


def _rope_of_hf(hf: dict, where: str, default_theta: float = 10000.0) -> dict[str, Any]:
    """Return the model.rope_* keys of a config.json in either form: ``rope_theta`` +
    ``rope_scaling`` (transformers 4, the hub's Llama 3.1 files) or ``rope_parameters``
    (transformers 5); a UserError for a rotary scaling other than Llama 3's."""
    if isinstance(hf.get("rope_parameters"), dict):
        params = hf["rope_parameters"]
        theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    else:
        params = hf.get("rope_scaling") or {}
        theta = hf.get("rope_theta", default_theta)
    if not isinstance(params, dict):
        raise UserError(f"{where}: rope_scaling {params!r} is not a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    keys: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": None}
    if kind == "default":
        return keys
    if kind != "llama3":
        raise UserError(
            f"{where}: rope_type {kind!r} is not read; default and llama3 (Llama 3.1's "
            "frequency scaling) are"
        )
    try:
        return {
            **keys,
            "rope_scaling": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_seq_len": int(params["original_max_position_embeddings"]),
        }
    except KeyError as err:
        raise UserError(f"{where}: llama3 rope scaling lacks {err.args[0]}") from None


def _hf_head_dim(hf: dict) -> int | None:
    """Return the head size a config.json gives, as transformers reads it: head_dim (Qwen3's
    default 128 where it is silent), else hidden_size / num_attention_heads; None where the
    sizes are not numbers."""
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    given = hf.get("head_dim", 128 if hf.get("model_type") == "qwen3" else None)
    if isinstance(given, int) and given > 0:
        return given
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        return hidden // heads
    return None


def _attention_keys(hf: dict, kind: str, where: str) -> dict[str, Any]:
    """Return the model.* keys of a config.json's attention variant: the head size where it
    is not hidden / heads, q/k/v biases (Qwen2's), q/k norms (Qwen3's); a UserError for an
    attention this family cannot hold (a bias on o_proj, sliding windows)."""
    qwen3, qwen2 = kind in ("qwen3", "qwen3_moe"), kind in ("qwen2", "qwen2_moe")
    if kind == "llama" or qwen3:
        biased = [key for key in ("attention_bias", "mlp_bias") if hf.get(key)]
        if biased:
            what = "q, k, v and o" if "attention_bias" in biased else "the MLP"
            raise UserError(
                f"{where}: {' and '.join(biased)} true (biases on {what}); this family's "
                "attention has biases on q, k and v only (Qwen2's)"
            )
    if kind != "llama" and hf.get("use_sliding_window"):
        raise UserError(
            f"{where}: use_sliding_window true (sliding-window attention) is not supported; "
            "set it to false"
        )
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    size = _hf_head_dim(hf)
    if size is None or size % 2:
        raise UserError(f"{where}: head_dim {size} is not an even number (rotary pairs)")
    keys: dict[str, Any] = {"head_dim": None if size * heads == hidden else size}
    if qwen3:
        keys["qk_norm"] = True
    if kind == "qwen2" or (qwen2 and hf.get("qkv_bias", MOE_DEFAULTS["qwen2_moe"]["qkv_bias"])):
        keys["qkv_bias"] = True
    return keys


def _moe_keys(hf: dict, kind: str, where: str) -> dict[str, Any]:
    """Return the model.moe_* keys of a Mixtral or Qwen-MoE config.json; a UserError for what
    the family cannot hold."""
    for name, what in (("sliding_window", "sliding-window attention"),
                       ("router_jitter_noise", "router noise")):  # fmt: skip
        if kind == "mixtral" and hf.get(name):
            raise UserError(f"{where}: {name} {hf[name]} ({what}) is not supported; set it to null")
    get = {**MOE_DEFAULTS[kind], **{k: hf[k] for k in MOE_DEFAULTS[kind] if k in hf}}
    keys = {
        "moe_experts": _experts_given(hf, kind)[0],
        "moe_top_k": get["num_experts_per_tok"],
        "moe_aux_loss": float(get["router_aux_loss_coef"]),
    }
    if kind == "mixtral":
        return {**keys, "moe_ffn_size": hf["intermediate_size"], "moe_router": "topk-softmax"}
    keys.update(
        moe_ffn_size=get["moe_intermediate_size"],
        moe_router="softmax-topk",
        moe_renormalize=bool(get["norm_topk_prob"]),
        moe_every=get["decoder_sparse_step"],
        moe_dense_layers=list(hf.get("mlp_only_layers") or []) or None,
    )
    if kind == "qwen2_moe":
        keys.update(
            moe_shared_ffn_size=get["shared_expert_intermediate_size"], moe_shared_gate=True
        )
    return keys


def model_keys_of_hf(hf: dict, where: str) -> dict[str, Any]:
    """Return the model.* keys of a Hugging Face LlamaForCausalLM, MixtralForCausalLM or
    Qwen2's or Qwen3's (dense or MoE) config.json; a UserError for one this family cannot
    hold (another activation, biases other than Qwen2's, another rotary scaling, sliding
    windows)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act {hf['hidden_act']!r} is not silu (SwiGLU)")
    kind = hf.get("model_type", "llama")
    # transformers' MixtralConfig defaults differ from its LlamaConfig's where a file is silent.
    mixtral = kind == "mixtral"
    return {
        "n_layer": hf["num_hidden_layers"],
        "n_head": hf["num_attention_heads"],
        "n_kv_heads": _hf_kv_heads(hf)[0],
        "d_model": hf["hidden_size"],
        "ffn_size": hf["intermediate_size"],
        "seq_len": hf["max_position_embeddings"],
        "vocab_size": hf["vocab_size"],
        "layer_norm_eps": hf.get("rms_norm_eps", 1e-5 if mixtral else 1e-6),
        "init_std": hf.get("initializer_range", 0.02),
        "dropout": float(hf.get("attention_dropout", 0.0)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **_rope_of_hf(hf, where, 1e6 if mixtral else 10000.0),
        **_attention_keys(hf, kind, where),
        **(_moe_keys(hf, kind, where) if kind in MOE_DEFAULTS else {}),
    }


def hf_sizes(hf: dict, shapes: Mapping[str, tuple[int, ...]]) -> list[HFSize]:
    """Return the config.json sizes a checkpoint's tensors give: the hidden size and the
    vocabulary (the embedding's columns and rows), the layers (the blocks named), the MLP
    width (the gate's rows), the head size (q's rows over the heads), the key/value heads
    (k's rows over the head size) and the experts' sizes."""
    sizes = []
    embed = "model.embed_tokens.weight"
    if len(shapes.get(embed, ())) == 2:
        rows, columns = shapes[embed]
        sizes += [
            HFSize("hidden_size", hf.get("hidden_size"), columns, f"{embed} has {columns} columns"),
            HFSize("vocab_size", hf.get("vocab_size"), rows, f"{embed} has {rows} rows"),
        ]
    layers = hf_layer_count(shapes, "model.layers.")
    if layers is not None:
        held = f"the weights hold {layers} layers (model.layers.0 to {layers - 1})"
        sizes.append(HFSize("num_hidden_layers", hf.get("num_hidden_layers"), layers, held))
    gate = "model.layers.0.mlp.gate_proj.weight"
    if gate in shapes:
        width = shapes[gate][0]
        sizes.append(
            HFSize(
                "intermediate_size", hf.get("intermediate_size"), width, f"{gate} has {width} rows"
            )
        )
    sizes += _expert_sizes(hf, shapes)
    heads, size = hf.get("num_attention_heads"), _hf_head_dim(hf)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    if q in shapes and isinstance(heads, int) and heads > 0 and size:
        rows = shapes[q][0]
        if rows % heads == 0 and rows // heads != size:
            said = f"{q} has {rows} rows, {heads} heads of {rows // heads}"
            sizes.append(HFSize("head_dim", size, rows // heads, said, absent="head_dim" not in hf))
    if k in shapes and isinstance(heads, int) and heads > 0 and size:
        rows = shapes[k][0]
        if rows % size == 0:
            given, stated = _hf_kv_heads(hf)
            sizes.append(
                HFSize(
                    "num_key_value_heads",
                    given,
                    rows // size,
                    f"{k} has {rows} rows, {rows // size} heads of {size}",
                    absent=not stated,
                )
            )
    return sizes


# transformers' key/value heads where a config.json is silent, by kind (Llama's: one per
# query head).
KV_DEFAULTS = {"mixtral": 8, "qwen2": 32, "qwen3": 32, "qwen2_moe": 16, "qwen3_moe": 4}


def _hf_kv_heads(hf: dict) -> tuple[Any, bool]:
    """Return (the key/value heads a config.json gives, as transformers reads it: null is one
    per query head, silence the kind's default; whether it gives them)."""
    heads = hf.get("num_attention_heads")
    if "num_key_value_heads" in hf:
        return hf["num_key_value_heads"] or heads, True
    return KV_DEFAULTS.get(hf.get("model_type", "llama"), heads), False


def _expert_sizes(hf: dict, shapes: Mapping[str, tuple[int, ...]]) -> list[HFSize]:
    """Return the experts' sizes a Mixtral's or Qwen-MoE's tensors give, in any form: their
    number (the router's rows) and width (the first expert's gate rows, or half of
    gate_up_proj's) and the shared expert's width."""
    kind = hf.get("model_type")
    if kind not in MOE_DEFAULTS:
        return []
    count, width = (
        EXPERTS_KEY[kind],
        "intermediate_size" if kind == "mixtral" else ("moe_intermediate_size"),
    )
    sizes = []
    layers = hf_layer_count(shapes, "model.layers.") or 0
    for i in range(layers):  # the first MoE block (Qwen's may keep some dense)
        layer = f"model.layers.{i}."
        routers = (layer + "block_sparse_moe.gate.weight", layer + "mlp.gate.weight")
        router = next((r for r in routers if len(shapes.get(r, ())) == 2), None)
        if router is None:
            continue
        rows = shapes[router][0]
        given, stated = _experts_given(hf, kind)
        said = f"{router} has {rows} rows"
        sizes.append(HFSize(count, given, rows, said, absent=not stated))
        singles = (layer + "block_sparse_moe.experts.0.w1.weight",
                   layer + "mlp.experts.0.gate_proj.weight")  # fmt: skip
        single = next((w for w in singles if len(shapes.get(w, ())) == 2), None)
        fused = layer + "mlp.experts.gate_up_proj"
        rows_of = None
        if single is not None:
            rows_of, said = shapes[single][0], f"{single} has {shapes[single][0]} rows"
        elif len(shapes.get(fused, ())) == 3:
            rows_of = shapes[fused][1] // 2
            said = f"{fused} has {shapes[fused][1]} rows (gate and up)"
        if rows_of is not None:
            given = hf.get(width, MOE_DEFAULTS[kind].get(width))
            sizes.append(HFSize(width, given, rows_of, said, absent=width not in hf))
        shared = layer + "mlp.shared_expert.gate_proj.weight"
        if kind == "qwen2_moe" and len(shapes.get(shared, ())) == 2:
            key_ = "shared_expert_intermediate_size"
            given = hf.get(key_, MOE_DEFAULTS[kind][key_])
            said = f"{shared} has {shapes[shared][0]} rows"
            sizes.append(HFSize(key_, given, shapes[shared][0], said, absent=key_ not in hf))
        break
    return sizes


def keys_of_shape(shape: Shape) -> dict[str, Any]:
    """Return the model.* keys that give a Shape's extra sizes: key/value heads, MLP width,
    tying, and the attention's variants where it has them. A size the Shape leaves at its
    default is written out (as many key/value heads as heads, an MLP of 4·hidden), since this
    family's default MLP width is Meta's rule."""
    keys: dict[str, Any] = {
        "n_kv_heads": shape.kv_heads or shape.heads,
        "ffn_size": shape.ffn or 4 * shape.hidden,
        "tie_embeddings": shape.tied,
    }
    if shape.head_dim:
        keys["head_dim"] = shape.head_dim
    if shape.qkv_bias:
        keys["qkv_bias"] = True
    if shape.qk_norm:
        keys["qk_norm"] = True
    return keys


LLAMA = register(
    Family(
        name="llama",
        module="hpcllm.model.llama:Llama",
        reference="hpcllm.model.plain_llama:PlainLlama",
        # The smoke size's Llama has grouped-query attention: 2 query heads per key/value head.
        bench_keys=("model.n_kv_heads=2",),
        keys=LlamaKeys,
        presets=PRESETS,
        step_flops=step_flops,
        mlp_matrices=3,
        parameters=parameters,
        layer_parameters=layer_parameters,
        first_parameters=first_parameters,
        last_parameters=last_parameters,
        activation_factor=activation_factor,
        layer_gemms=layer_gemms,
        tensors=TENSORS,
        hf_tensors=HF_TENSORS,
        hf_model_type="llama",
        hf_model_types_also=KINDS[1:],
        hf_model_type_of=hf_kind,
        hf_config=hf_config,
        model_keys_of_hf=model_keys_of_hf,
        hf_sizes=hf_sizes,
        seq_in_weights=False,
        split_pointwise_values=split_pointwise_values,
        biases=False,
        ties=lambda model: bool(model.tie_embeddings),
        check=check,
        shape_extra=lambda model: {
            "kv_heads": kv_heads(model),
            "ffn": ffn_size(model),
            "tied": bool(model.tie_embeddings),
            # Null where it is d_model / n_head, whether the config says so or is silent.
            "head_dim": head_dim(model)
            if head_dim(model) * model.n_head != model.d_model
            else None,
            "qkv_bias": bool(model.qkv_bias),
            "qk_norm": bool(model.qk_norm),
        },
        keys_of_shape=keys_of_shape,
        head_dim=lambda model: model.head_dim,
    )
)
