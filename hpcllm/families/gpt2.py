"""The GPT-2 family's spec (torch-free); its torch half is ``hpcllm.model.gpt.GPT``.

Learned positions, pre-LayerNorm blocks with biases, a fused q|k|v projection, a 4h tanh-GeLU
MLP, the output layer tied to the token embedding. FLOPs follow Narayanan et al. (SC21),
eq. 3; activation memory Korthikanti et al. (2022), section 4.1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcllm.families import Family, HFSize, HFTensor, Shape, TensorRule, hf_layer_count, register
from hpcllm.user_error import UserError

# gpt2-124m/350m are GPT-2 small/medium (Radford et al., 2019); 760m and 1.3b are the GPT-3
# paper's sizes with Megatron-LM's head counts (head dim 96 and 128).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024},
    "gpt2-350m": {"n_layer": 24, "n_head": 16, "d_model": 1024, "seq_len": 1024},
    "gpt2-760m": {"n_layer": 24, "n_head": 16, "d_model": 1536, "seq_len": 1024},
    "gpt2-1.3b": {"n_layer": 24, "n_head": 16, "d_model": 2048, "seq_len": 2048},
}


def step_flops(batch: int, shape: Shape, recompute: str) -> float:
    """Return the FLOPs of one training step on ``batch`` sequences (Megatron's count).

    72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) without recomputation; 96·B·s·l·h²·(1 + s/(6h) +
    V/(16·l·h)) with full recomputation (one more forward of every layer, not of the output
    layer); selective recomputation adds the attention core again, 4·B·s²·h per layer.
    """
    b, s, layers, h, v = batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    if recompute == "full":
        return 96.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    flops = 72.0 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    if recompute == "selective":
        flops += 4.0 * b * s * s * h * layers
    return flops


def parameters(shape: Shape) -> int:
    """Return the parameter count: 12·h² + 13·h per layer, embeddings, final LayerNorm."""
    h = shape.hidden
    return shape.layers * (12 * h * h + 13 * h) + (shape.vocab + shape.seq) * h + 2 * h


def layer_parameters(shape: Shape) -> tuple[int, int]:
    """Return one layer's parameters (split over t, whole on every rank): the column- and
    row-parallel weights and the column-parallel biases are split (12·h² + 7·h), the
    row-parallel biases and the LayerNorms whole (6·h)."""
    h = shape.hidden
    return 12 * h * h + 7 * h, 6 * h


def first_parameters(shape: Shape, t: int) -> float:
    """Return the first stage's parameters outside its layers on one tp rank: the token
    embedding, padded to a multiple of 128·t rows and split, and the position embedding."""
    rows = -(-shape.vocab // (128 * t)) * 128 * t
    return rows * shape.hidden / t + shape.seq * shape.hidden


def last_parameters(shape: Shape, t: int) -> float:
    """Return the last stage's parameters after its layers on one tp rank: the final
    LayerNorm (the output layer is the embedding)."""
    return 2 * shape.hidden


def activation_factor(shape: Shape, t: int, sequence_parallel: bool, flash: bool) -> float:
    """Return one layer's stored activations in units of s·b·h (16-bit values).

    34/t with sequence parallelism, 10 + 24/t without; unfused attention adds its scores and
    their dropout mask, 5·a·s/(h·t).
    """
    stored = 34 / t if sequence_parallel and t > 1 else 10 + 24 / t
    scores = 0.0 if flash else 5 * shape.heads * shape.seq / (shape.hidden * t)
    return stored + scores


def layer_gemms(rows: int, shape: Shape, t: int) -> list[tuple[int, int, int]]:
    """Return one layer's forward GEMMs (M, N, K) on ``rows`` tokens at tensor-parallel t."""
    h = shape.hidden
    return [
        (rows, 3 * h // t, h),  # q|k|v
        (rows, h, h // t),  # attention output
        (rows, 4 * h // t, h),  # MLP up
        (rows, h, 4 * h // t),  # MLP down
    ]


_BLOCK = r"blocks\.\d+\."
TENSORS = (
    # The token embedding, padded to 128·t rows and split by rows; the output layer is tied to it.
    TensorRule(r"wte\.weight", (0, 1), "local", "first+last", padded=True),
    TensorRule(r"wpe\.weight", None, "tp-sum-if-sequence-parallel", "first"),
    TensorRule(_BLOCK + r"ln[12]\.(weight|bias)", None, "tp-sum-if-sequence-parallel", "block"),
    TensorRule(_BLOCK + r"attn\.qkv\.(weight|bias)", (0, 3), "local", "block"),
    TensorRule(_BLOCK + r"attn\.proj\.weight", (1, 1), "local", "block"),
    TensorRule(_BLOCK + r"attn\.proj\.bias", None, "tp-sum-if-sequence-parallel", "block"),
    TensorRule(_BLOCK + r"mlp\.fc\.(weight|bias)", (0, 1), "local", "block"),
    TensorRule(_BLOCK + r"mlp\.proj\.weight", (1, 1), "local", "block"),
    TensorRule(_BLOCK + r"mlp\.proj\.bias", None, "tp-sum-if-sequence-parallel", "block"),
    TensorRule(r"ln_f\.(weight|bias)", None, "tp-sum-if-sequence-parallel", "last"),
)

# Hugging Face's GPT2LMHeadModel: Conv1D weights are the transpose of nn.Linear's, q|k|v
# fused in c_attn in our order, lm_head tied to wte.
HF_TENSORS = (
    HFTensor("wte.weight", "transformer.wte.weight"),
    HFTensor("wpe.weight", "transformer.wpe.weight"),
    HFTensor("ln_f.weight", "transformer.ln_f.weight"),
    HFTensor("ln_f.bias", "transformer.ln_f.bias"),
    HFTensor("blocks.{i}.ln1.weight", "transformer.h.{i}.ln_1.weight"),
    HFTensor("blocks.{i}.ln1.bias", "transformer.h.{i}.ln_1.bias"),
    HFTensor("blocks.{i}.attn.qkv.weight", "transformer.h.{i}.attn.c_attn.weight", True),
    HFTensor("blocks.{i}.attn.qkv.bias", "transformer.h.{i}.attn.c_attn.bias"),
    HFTensor("blocks.{i}.attn.proj.weight", "transformer.h.{i}.attn.c_proj.weight", True),
    HFTensor("blocks.{i}.attn.proj.bias", "transformer.h.{i}.attn.c_proj.bias"),
    HFTensor("blocks.{i}.ln2.weight", "transformer.h.{i}.ln_2.weight"),
    HFTensor("blocks.{i}.ln2.bias", "transformer.h.{i}.ln_2.bias"),
    HFTensor("blocks.{i}.mlp.fc.weight", "transformer.h.{i}.mlp.c_fc.weight", True),
    HFTensor("blocks.{i}.mlp.fc.bias", "transformer.h.{i}.mlp.c_fc.bias"),
    HFTensor("blocks.{i}.mlp.proj.weight", "transformer.h.{i}.mlp.c_proj.weight", True),
    HFTensor("blocks.{i}.mlp.proj.bias", "transformer.h.{i}.mlp.c_proj.bias"),
)


def hf_config(model: Any, vocab_size: int, special: dict[str, Any]) -> dict:
    """Return the config.json of a Hugging Face GPT2LMHeadModel with ``model``'s shape;
    ``special``: its ``bos_token_id`` and ``eos_token_id`` (BOS: EOS where unset, as GPT-2's
    own files have it)."""
    if model.moe_experts:
        raise UserError(
            "this MoE model has no Hugging Face form: GPT2LMHeadModel has no mixture of experts "
            "(model.moe_experts); a Llama-family model with experts goes out as a Mixtral"
        )
    eos_id = special.get("eos_token_id")
    bos_id = special.get("bos_token_id")
    bos_id = eos_id if bos_id is None else bos_id
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": model.seq_len,
        "n_ctx": model.seq_len,
        "n_embd": model.d_model,
        "n_layer": model.n_layer,
        "n_head": model.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": model.dropout,
        "embd_pdrop": model.dropout,
        "attn_pdrop": model.dropout,
        "layer_norm_epsilon": model.layer_norm_eps,
        "initializer_range": model.init_std,
        "tie_word_embeddings": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def model_keys_of_hf(hf: dict, where: str) -> dict[str, Any]:
    """Return the model.* keys of a Hugging Face GPT-2 config.json; a UserError for one this
    family cannot hold (another activation, another MLP width)."""
    if hf.get("activation_function", "gelu_new") != "gelu_new" or hf.get("n_inner"):
        raise UserError(f"{where}: only gelu_new and n_inner = 4*n_embd are supported")
    return {
        "n_layer": hf["n_layer"],
        "n_head": hf["n_head"],
        "d_model": hf["n_embd"],
        "seq_len": hf["n_positions"],
        "vocab_size": hf["vocab_size"],
        "layer_norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "init_std": hf.get("initializer_range", 0.02),
    }


def hf_sizes(hf: dict, shapes: Mapping[str, tuple[int, ...]]) -> list[HFSize]:
    """Return the config.json sizes a GPT2LMHeadModel's tensors give: the width and the
    vocabulary (the token embedding's columns and rows), the positions (the position
    embedding's rows) and the layers (the blocks named)."""
    sizes = []
    wte, wpe = "transformer.wte.weight", "transformer.wpe.weight"
    if len(shapes.get(wte, ())) == 2:
        rows, columns = shapes[wte]
        sizes += [
            HFSize("n_embd", hf.get("n_embd"), columns, f"{wte} has {columns} columns"),
            HFSize("vocab_size", hf.get("vocab_size"), rows, f"{wte} has {rows} rows"),
        ]
    if len(shapes.get(wpe, ())) == 2:
        rows = shapes[wpe][0]
        sizes.append(HFSize("n_positions", hf.get("n_positions"), rows, f"{wpe} has {rows} rows"))
    layers = hf_layer_count(shapes, "transformer.h.")
    if layers is not None:
        held = f"the weights hold {layers} layers (transformer.h.0 to {layers - 1})"
        sizes.append(HFSize("n_layer", hf.get("n_layer"), layers, held))
    return sizes


GPT2 = register(
    Family(
        name="gpt2",
        module="hpcllm.model.gpt:GPT",
        reference="hpcllm.model.plain_gpt2:PlainGPT2",
        presets=PRESETS,
        step_flops=step_flops,
        parameters=parameters,
        layer_parameters=layer_parameters,
        first_parameters=first_parameters,
        last_parameters=last_parameters,
        activation_factor=activation_factor,
        layer_gemms=layer_gemms,
        tensors=TENSORS,
        hf_tensors=HF_TENSORS,
        hf_model_type="gpt2",
        hf_config=hf_config,
        model_keys_of_hf=model_keys_of_hf,
        hf_sizes=hf_sizes,
    )
)
