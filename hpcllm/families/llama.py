"""The Llama family's spec (torch-free); its torch half is ``hpcllm.model.llama.Llama``.

Pre-RMSNorm blocks without biases, rotary position embeddings (with Llama 3.1's frequency
scaling), grouped-query attention (``model.n_kv_heads`` key/value heads shared by
``n_head / n_kv_heads`` query heads each), a SwiGLU MLP (SiLU(x·G) ⊙ (x·U) → D) and an
output layer tied to the token embedding or not (``model.tie_embeddings``). Shapes from Meta's
model cards and configuration files: Llama 3 (8B, 70B), Llama 3.1 (405B), Llama 3.2 (1B).

Tensor parallelism (Megatron's): q column-parallel by head; k and v split by head when t
divides ``n_kv_heads``, and when ``n_kv_heads`` divides t each key/value head lives on the
``t / n_kv_heads`` ranks whose query heads use it (its gradient summed over them, counted once
in the gradient norm and the parameter count); the SwiGLU's gate and up column-parallel, its
down projection row-parallel.

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


def _kv(shape: Shape) -> int:
    """Return the key (or value) projection's width: kv heads × head size."""
    return (shape.kv_heads or shape.heads) * (shape.hidden // shape.heads)


def _layer_forward(batch: int, shape: Shape) -> float:
    h, s = shape.hidden, shape.seq
    per_token = 4 * h * h + 4 * h * _kv(shape) + 6 * h * (shape.ffn or 4 * h) + 4 * s * h
    return float(batch * s * per_token)


def step_flops(batch: int, shape: Shape, recompute: str) -> float:
    """Return the FLOPs of one training step on ``batch`` sequences (see the docstring).

    Forward + backward is 3 forwards; full recomputation runs every layer's forward once
    more (not the output layer's), selective the attention core's 4·B·s²·h per layer.
    """
    layers = shape.layers * _layer_forward(batch, shape)
    logits = 2.0 * batch * shape.seq * shape.hidden * shape.vocab
    flops = 3 * (layers + logits)
    if recompute == "full":
        flops += layers
    elif recompute == "selective":
        flops += 4.0 * batch * shape.seq * shape.seq * shape.hidden * shape.layers
    return flops


def parameters(shape: Shape) -> int:
    """Return the parameter count: per layer 2h² (q, o) + 2·h·k (k, v) + 3·h·f + 2h (the
    norms); the embedding, the output layer when untied, the final norm."""
    h = shape.hidden
    layer = 2 * h * h + 2 * h * _kv(shape) + 3 * h * (shape.ffn or 4 * h) + 2 * h
    head = 0 if shape.tied else shape.vocab * h
    return shape.layers * layer + shape.vocab * h + head + h


def layer_parameters(shape: Shape) -> tuple[int, int]:
    """Return one layer's parameters (split over t, whole on every rank): every matrix is
    split (replicated key/value heads count as split), the two norms are whole."""
    h = shape.hidden
    return 2 * h * h + 2 * h * _kv(shape) + 3 * h * (shape.ffn or 4 * h), 2 * h


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
    SiLU product (3 · 2·f/h). No dropout masks. Sequence parallelism splits the whole ones
    too; unfused attention adds its scores and softmax, 2.5·a·s/(h·t)."""
    h = shape.hidden
    kv, f = _kv(shape) / h, (shape.ffn or 4 * h) / h
    split = 2 + 4 * kv + 2 + 6 * f
    whole = 8
    stored = (split + whole) / t if sequence_parallel and t > 1 else whole + split / t
    scores = 0.0 if flash else 2.5 * shape.heads * shape.seq / (shape.hidden * t)
    return stored + scores


def layer_gemms(rows: int, shape: Shape, t: int) -> list[tuple[int, int, int]]:
    """Return one layer's forward GEMMs (M, N, K) on ``rows`` tokens at tensor-parallel t."""
    h, f = shape.hidden, shape.ffn or 4 * shape.hidden
    kv = max(1, _kv(shape) // t)  # replicated heads: one per rank
    return [
        (rows, h // t, h),  # q
        (rows, kv, h),  # k
        (rows, kv, h),  # v
        (rows, h, h // t),  # attention output
        (rows, f // t, h),  # gate
        (rows, f // t, h),  # up
        (rows, h, f // t),  # down
    ]


def split_pointwise_values(shape: Shape, t: int) -> float:
    """Return the values per token the SwiGLU activation (gate and up read, product written:
    3f) and the rotation of q and k (each read and written) move on one tp rank."""
    f = shape.ffn or 4 * shape.hidden
    return (3 * f + 2 * (shape.hidden + _kv(shape))) / t


def check(model: Any, tp: int) -> None:
    """Raise a UserError for a Llama shape or tensor-parallel size that cannot work."""
    heads, kv = model.n_head, kv_heads(model)
    if heads % kv:
        raise UserError(f"model.n_head {heads} is not a multiple of model.n_kv_heads {kv}")
    if (model.d_model // heads) % 2:
        raise UserError(
            f"rotary embeddings rotate pairs: the head size d_model / n_head = "
            f"{model.d_model // heads} must be even"
        )
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
    TensorRule(_BLOCK + r"attn\.q\.weight", (0, 1), "local", "block"),
    # Split by head, or (n_kv_heads < t) a head replicated on the ranks that use it.
    TensorRule(_BLOCK + r"attn\.[kv]\.weight", (0, 1), "kv-replicas", "block"),
    TensorRule(_BLOCK + r"attn\.proj\.weight", (1, 1), "local", "block"),
    TensorRule(_BLOCK + r"mlp\.(gate|up)\.weight", (0, 1), "local", "block"),
    TensorRule(_BLOCK + r"mlp\.proj\.weight", (1, 1), "local", "block"),
    TensorRule(r"norm_f\.weight", None, "tp-sum-if-sequence-parallel", "last"),
)

# Hugging Face's LlamaForCausalLM: the same matrices, the same rotary convention (each head's
# halves pair up), so no tensor is permuted or transposed. A tied model has no lm_head.
HF_TENSORS = (
    HFTensor("wte.weight", "model.embed_tokens.weight"),
    HFTensor("lm_head.weight", "lm_head.weight"),
    HFTensor("norm_f.weight", "model.norm.weight"),
    HFTensor("blocks.{i}.norm1.weight", "model.layers.{i}.input_layernorm.weight"),
    HFTensor("blocks.{i}.attn.q.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    HFTensor("blocks.{i}.attn.k.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    HFTensor("blocks.{i}.attn.v.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    HFTensor("blocks.{i}.attn.proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    HFTensor("blocks.{i}.norm2.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    HFTensor("blocks.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    HFTensor("blocks.{i}.mlp.up.weight", "model.layers.{i}.mlp.up_proj.weight"),
    HFTensor("blocks.{i}.mlp.proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    # MixtralForCausalLM's MoE blocks: the hub's files hold each expert's w1 (gate), w3 (up)
    # and w2 (down) apart and the router as block_sparse_moe.gate; transformers 5's modules
    # stack them (gate and up fused in gate_up_proj, gate first), which a file saved from its
    # state dict holds. Both read; the hub's form written (transformers 5 reads it too).
    HFTensor("blocks.{i}.mlp.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight"),
    HFTensor("blocks.{i}.mlp.router.weight", "model.layers.{i}.mlp.gate.weight", alternative=True),
    HFTensor(
        "blocks.{i}.mlp.experts.gate", "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.gate",
        "model.layers.{i}.mlp.experts.gate_up_proj",
        part=(1, 0, 2),
        alternative=True,
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.up", "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight"
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.up",
        "model.layers.{i}.mlp.experts.gate_up_proj",
        part=(1, 1, 2),
        alternative=True,
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.proj", "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"
    ),
    HFTensor(
        "blocks.{i}.mlp.experts.proj", "model.layers.{i}.mlp.experts.down_proj", alternative=True
    ),
)

# What MixtralForCausalLM's config.json says that a Llama's does not, and Mixtral's defaults
# (transformers' MixtralConfig) where a file leaves them out.
MIXTRAL_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}


def _mixtral_refusal(model: Any) -> str | None:
    """Return why a Llama with experts is no MixtralForCausalLM, None where it is one."""
    from hpcllm.config import moe_layers  # the config layer, torch-free

    dense = sorted(set(range(model.n_layer)) - set(moe_layers(model)))
    if dense:
        return f"every block of a Mixtral is MoE, and this model keeps blocks {dense} dense"
    if model.moe_shared_ffn_size:
        return "Mixtral has no shared expert (model.moe_shared_ffn_size)"
    if model.moe_router == "sigmoid":
        return "Mixtral's router is a softmax over the top k (model.moe_router: topk-softmax)"
    if model.moe_router == "softmax-topk" and not model.moe_renormalize:
        return (
            "Mixtral's router weighs the top k by a softmax over them (model.moe_router: "
            "topk-softmax, or softmax-topk with model.moe_renormalize: true)"
        )
    return None


def mixtral_config(model: Any, dense: dict[str, Any]) -> dict[str, Any]:
    """Return the config.json of a Hugging Face MixtralForCausalLM from a Llama's
    (``dense``); a UserError where the model is no Mixtral."""
    refusal = _mixtral_refusal(model)
    if refusal is not None:
        raise UserError(f"this MoE model has no Hugging Face form: {refusal}")
    config = {k: v for k, v in dense.items() if k not in ("mlp_bias", "pretraining_tp")}
    return {
        **config,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": model.moe_ffn_size or ffn_size(model),
        "num_local_experts": model.moe_experts,
        "num_experts_per_tok": model.moe_top_k,
        "router_aux_loss_coef": model.moe_aux_loss,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def _mixtral_keys(hf: dict, where: str) -> dict[str, Any]:
    """Return the model.moe_* keys of a MixtralForCausalLM config.json; a UserError for what
    the family cannot hold."""
    for name, what in (("sliding_window", "sliding-window attention"),
                       ("router_jitter_noise", "router noise")):  # fmt: skip
        if hf.get(name):
            raise UserError(f"{where}: {name} {hf[name]} ({what}) is not supported; set it to null")
    get = {k: hf.get(k, v) for k, v in MIXTRAL_DEFAULTS.items()}
    return {
        "moe_experts": get["num_local_experts"],
        "moe_top_k": get["num_experts_per_tok"],
        "moe_ffn_size": hf["intermediate_size"],
        "moe_router": "topk-softmax",
        "moe_aux_loss": float(get["router_aux_loss_coef"]),
    }


def hf_config(model: Any, vocab_size: int, special: dict[str, Any]) -> dict:
    """Return the config.json of a Hugging Face LlamaForCausalLM with ``model``'s shape (with
    experts, a MixtralForCausalLM's: :func:`mixtral_config`).

    Rotary settings as ``rope_theta`` + ``rope_scaling`` (transformers 4 writes them so, and
    transformers 5 reads them too); ``special``: its ``bos_token_id`` and ``eos_token_id``.
    """
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
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": model.d_model,
        "intermediate_size": ffn_size(model),
        "num_hidden_layers": model.n_layer,
        "num_attention_heads": model.n_head,
        "num_key_value_heads": kv_heads(model),
        "head_dim": model.d_model // model.n_head,
        "hidden_act": "silu",
        "max_position_embeddings": model.seq_len,
        "rms_norm_eps": model.layer_norm_eps,
        "initializer_range": model.init_std,
        "tie_word_embeddings": bool(model.tie_embeddings),
        "rope_theta": float(model.rope_theta),
        "rope_scaling": scaling,
        "attention_bias": False,
        "attention_dropout": model.dropout,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": special.get("bos_token_id"),
        "eos_token_id": special.get("eos_token_id"),
    }
    return mixtral_config(model, config) if model.moe_experts else config


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


def model_keys_of_hf(hf: dict, where: str) -> dict[str, Any]:
    """Return the model.* keys of a Hugging Face LlamaForCausalLM or MixtralForCausalLM
    config.json; a UserError for one this family cannot hold (biases, another activation, a
    head size that is not hidden / heads, another rotary scaling, sliding windows)."""
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act {hf['hidden_act']!r} is not silu (SwiGLU)")
    biased = [key for key in ("attention_bias", "mlp_bias") if hf.get(key)]
    if biased:
        raise UserError(f"{where}: {' and '.join(biased)} true; Llama here has no biases")
    # transformers' MixtralConfig defaults differ from its LlamaConfig's where a file is silent.
    mixtral = hf.get("model_type") == "mixtral"
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") not in (None, hidden // heads) or hidden % heads:
        raise UserError(
            f"{where}: head_dim {hf.get('head_dim')} is not hidden_size / num_attention_heads "
            f"({hidden} / {heads})"
        )
    return {
        "n_layer": hf["num_hidden_layers"],
        "n_head": heads,
        "n_kv_heads": hf.get("num_key_value_heads") or heads,
        "d_model": hidden,
        "ffn_size": hf["intermediate_size"],
        "seq_len": hf["max_position_embeddings"],
        "vocab_size": hf["vocab_size"],
        "layer_norm_eps": hf.get("rms_norm_eps", 1e-5 if mixtral else 1e-6),
        "init_std": hf.get("initializer_range", 0.02),
        "dropout": float(hf.get("attention_dropout", 0.0)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **_rope_of_hf(hf, where, 1e6 if mixtral else 10000.0),
        **(_mixtral_keys(hf, where) if mixtral else {}),
    }


def hf_sizes(hf: dict, shapes: Mapping[str, tuple[int, ...]]) -> list[HFSize]:
    """Return the config.json sizes a LlamaForCausalLM's tensors give: the hidden size and the
    vocabulary (the embedding's columns and rows), the layers (the blocks named), the MLP
    width (the gate's rows) and the key/value heads (k's rows over the head size)."""
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
    sizes += _mixtral_sizes(hf, shapes)
    k = "model.layers.0.self_attn.k_proj.weight"
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    if k in shapes and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        head_dim, rows = hidden // heads, shapes[k][0]
        if head_dim > 0 and rows % head_dim == 0:
            given = hf.get("num_key_value_heads")
            sizes.append(
                HFSize(
                    "num_key_value_heads",
                    given or heads,
                    rows // head_dim,
                    f"{k} has {rows} rows, {rows // head_dim} heads of {head_dim}",
                    absent=given is None,
                )
            )
    return sizes


def _mixtral_sizes(hf: dict, shapes: Mapping[str, tuple[int, ...]]) -> list[HFSize]:
    """Return the experts' sizes a MixtralForCausalLM's tensors give, in either form: their
    number (the router's rows) and width (w1's rows, or half of gate_up_proj's)."""
    sizes = []
    for router in ("model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.mlp.gate.weight"):
        if len(shapes.get(router, ())) == 2:
            rows = shapes[router][0]
            given = hf.get("num_local_experts", MIXTRAL_DEFAULTS["num_local_experts"])
            absent = "num_local_experts" not in hf
            said = f"{router} has {rows} rows"
            sizes.append(HFSize("num_local_experts", given, rows, said, absent=absent))
            break
    w1 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    if len(shapes.get(w1, ())) == 2:
        width, said = shapes[w1][0], f"{w1} has {shapes[w1][0]} rows"
    elif len(shapes.get(fused, ())) == 3:
        width, said = shapes[fused][1] // 2, f"{fused} has {shapes[fused][1]} rows (gate and up)"
    else:
        return sizes
    sizes.append(HFSize("intermediate_size", hf.get("intermediate_size"), width, said))
    return sizes


def keys_of_shape(shape: Shape) -> dict[str, Any]:
    """Return the model.* keys that give a Shape's extra sizes: key/value heads, MLP width,
    tying. A size the Shape leaves at its default is written out (as many key/value heads as
    heads, an MLP of 4·hidden), since this family's default MLP width is Meta's rule."""
    return {
        "n_kv_heads": shape.kv_heads or shape.heads,
        "ffn_size": shape.ffn or 4 * shape.hidden,
        "tie_embeddings": shape.tied,
    }


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
        hf_model_types_also=("mixtral",),
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
        },
        keys_of_shape=keys_of_shape,
    )
)
