"""A model family defined only in the tests, sharing nothing with GPT-2 or Llama but the decoder.

Importing this module registers ``probe``: its spec and its torch half in one file, as a plugin
may. It subclasses neither built-in family: its blocks are its own parts (a ScaleNorm,
attention with separate biased q, k and v projections and no positions at all, a squared-ReLU
MLP with a persistent buffer split over t), it declares its own config key
(``model.mlp_ratio``), its own preset (``probe-tiny``), tensor rules, FLOPs, parameter count
and plain PyTorch baseline. Ranks started by mpirun import it through
``HPCLLM_FAMILIES=probe_family`` with this folder on ``PYTHONPATH`` (:data:`ENV`); nothing
outside tests/ names it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpcllm import families
from hpcllm.families import Family, Shape, TensorRule
from hpcllm.keys import POSITIVE, key
from hpcllm.model.decoder import Decoder, DecoderParts, SelfAttention
from hpcllm.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_split,
    normal_init,
)
from hpcllm.user_error import UserError

HERE = Path(__file__).resolve().parent
ENV = {
    "HPCLLM_FAMILIES": "probe_family",
    "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
}


@dataclass
class ProbeKeys:
    """The probe family's own model key."""

    mlp_ratio: int = key(2, "the squared-ReLU MLP's width in units of d_model (probe)", POSITIVE)


PRESETS: dict[str, dict[str, Any]] = {
    "probe-tiny": {"n_layer": 4, "n_head": 4, "d_model": 64, "seq_len": 32, "mlp_ratio": 3},
}


# ---- the torch half ----


class ScaleNorm(nn.Module):
    """g · x / ‖x‖ with one learned scale g (Nguyen & Salazar, 2019)."""

    def __init__(self, dim: int, eps: float, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.full((1,), math.sqrt(dim)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x.float().norm(dim=-1, keepdim=True).clamp(min=self.eps)
        return (self.g * x.float() / norm).to(x.dtype)


class SeparateAttention(SelfAttention):
    """Attention with q, k and v as three biased column-parallel projections, no positions."""

    def __init__(
        self, cfg: Any, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__(cfg, group, kv_heads=cfg.n_head)
        h = cfg.d_model
        common = {"group": group, "gen": gen, "sequence_parallel": sequence_parallel}
        self.q = ColumnParallelLinear(h, h, init=normal_init(cfg.init_std), **common)
        self.k = ColumnParallelLinear(h, h, init=normal_init(cfg.init_std), **common)
        self.v = ColumnParallelLinear(h, h, init=normal_init(cfg.init_std), **common)
        std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.proj = RowParallelLinear(h, h, init=normal_init(std), **common)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Return q, k and v (b, heads, s, d); no positions."""
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, s, _ = q.shape
        return tuple(  # type: ignore[return-value]
            part.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for part in (q, k, v)
        )


class SquaredReLU(nn.Module):
    """h → r·h (column-parallel) → ReLU² → h (row-parallel) (So et al., 2021, Primer)."""

    def __init__(
        self, cfg: Any, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        h, width = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        common = {"group": group, "gen": gen, "sequence_parallel": sequence_parallel}
        self.fc = ColumnParallelLinear(h, width, init=normal_init(cfg.init_std), **common)
        std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.proj = RowParallelLinear(width, h, init=normal_init(std), **common)
        # A persistent buffer, split over t as fc's rows are (a router's statistics would be
        # one): the squared norm of each of this rank's fc rows at the last training forward.
        # The checkpoint saves it and the re-cut cuts it by its rule; it changes no output.
        self.register_buffer("usage", torch.zeros(self.fc.weight.shape[0]))
        mark_split(self.usage, dim=0)

    def forward(
        self, x: torch.Tensor, add_bias: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.training:
            with torch.no_grad():
                self.usage.copy_(self.fc.weight.detach().float().square().sum(dim=1))
        y = F.relu(self.fc(x)).square()
        return self.proj(y, add_bias=add_bias), None if add_bias else self.proj.bias


class Probe(Decoder):
    """The probe family's model: the shared decoder with the parts above."""

    parts = DecoderParts(
        norm=ScaleNorm,
        attention=SeparateAttention,
        mlp=SquaredReLU,
        norm_names=("norm1", "norm2", "norm_f"),
    )


class PlainProbe(nn.Module):
    """The same model in plain PyTorch, the baseline ``hpcllm bench step`` times it against."""

    def __init__(self, model: Any, vocab_size: int, *, seed: int = 1234) -> None:
        super().__init__()
        torch.manual_seed(seed)
        h, width = model.d_model, model.mlp_ratio * model.d_model
        self.heads, self.eps = model.n_head, model.layer_norm_eps
        self.wte = nn.Embedding(vocab_size, h)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "g1": nn.ParameterList([nn.Parameter(torch.full((1,), math.sqrt(h)))]),
                    "qkv": nn.Linear(h, 3 * h),
                    "proj": nn.Linear(h, h),
                    "g2": nn.ParameterList([nn.Parameter(torch.full((1,), math.sqrt(h)))]),
                    "fc": nn.Linear(h, width),
                    "down": nn.Linear(width, h),
                }
            )
            for _ in range(model.n_layer)
        )
        self.g_f = nn.Parameter(torch.full((1,), math.sqrt(h)))

    def _norm(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return g * x / x.norm(dim=-1, keepdim=True).clamp(min=self.eps)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        b, s, h = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](self._norm(block["g1"][0], x)).split(h, dim=-1)
            q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["proj"](y.transpose(1, 2).reshape(b, s, h))
            x = x + block["down"](F.relu(block["fc"](self._norm(block["g2"][0], x))).square())
        logits = F.linear(self._norm(self.g_f, x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


# ---- the spec ----


def _width(shape: Shape) -> int:
    return shape.ffn or 2 * shape.hidden


def step_flops(batch: int, shape: Shape, recompute: str) -> float:
    """Forward per token and layer: 2·4h² (q, k, v, o), 2·2·h·w (the MLP), 4·s·h (attention);
    2·h·V for the logits; backward twice the forward; full recomputation one more layer pass."""
    h, s = shape.hidden, shape.seq
    layer = batch * s * (8 * h * h + 4 * h * _width(shape) + 4 * s * h) * shape.layers
    logits = 2.0 * batch * s * h * shape.vocab
    flops = 3 * (layer + logits)
    if recompute == "full":
        flops += layer
    elif recompute == "selective":
        flops += 4.0 * batch * s * s * h * shape.layers
    return float(flops)


def layer_parameters(shape: Shape) -> tuple[int, int]:
    """Split over t: the q, k, v weights and biases, o's weight, the MLP's but its output
    bias; whole: the two row-parallel biases and the two scales."""
    h, w = shape.hidden, _width(shape)
    return 4 * h * h + 3 * h + 2 * h * w + w, 2 * h + 2


def parameters(shape: Shape) -> int:
    """Return the parameter count: the layers, the tied embedding, the final scale."""
    return shape.layers * sum(layer_parameters(shape)) + shape.vocab * shape.hidden + 1


def first_parameters(shape: Shape, t: int) -> float:
    """Return the embedding's rows on one tp rank (padded to 128·t) times the width."""
    rows = -(-shape.vocab // (128 * t)) * 128 * t
    return rows * shape.hidden / t


def last_parameters(shape: Shape, t: int) -> float:
    """Return the last stage's parameters after its layers."""
    return 1.0  # the final scale; the output layer is the embedding


def activation_factor(shape: Shape, t: int, sequence_parallel: bool, flash: bool) -> float:
    """Whole: the two norms' inputs and outputs and the projections' inputs (8); split: q, k,
    v and the attention output (8), the MLP's pre- and post-activation (4·w/h)."""
    split, whole = 8 + 4 * _width(shape) / shape.hidden, 8
    stored = (split + whole) / t if sequence_parallel and t > 1 else whole + split / t
    return stored + (0.0 if flash else 2.5 * shape.heads * shape.seq / (shape.hidden * t))


def layer_gemms(rows: int, shape: Shape, t: int) -> list[tuple[int, int, int]]:
    """Return one layer's forward GEMMs (M, N, K) on ``rows`` tokens at tensor-parallel t."""
    h, w = shape.hidden, _width(shape)
    return [
        *[(rows, h // t, h)] * 3,  # q, k, v
        (rows, h, h // t),  # o
        (rows, w // t, h),  # up
        (rows, h, w // t),  # down
    ]


def check(model: Any, tp: int) -> None:
    """Raise a UserError where the MLP's width does not divide over t."""
    if model.mlp_ratio * model.d_model % tp:
        raise UserError(
            f"model.mlp_ratio x model.d_model = {model.mlp_ratio * model.d_model} is not "
            f"divisible by parallel.tp {tp}"
        )


_BLOCK = r"blocks\.\d+\."
TENSORS = (
    TensorRule(r"wte\.weight", (0, 1), "local", "first+last", padded=True),
    TensorRule(_BLOCK + r"norm[12]\.g", None, "tp-sum-if-sequence-parallel", "block"),
    TensorRule(_BLOCK + r"attn\.[qkv]\.(weight|bias)", (0, 1), "local", "block"),
    TensorRule(_BLOCK + r"attn\.proj\.weight", (1, 1), "local", "block"),
    TensorRule(_BLOCK + r"(attn|mlp)\.proj\.bias", None, "tp-sum-if-sequence-parallel", "block"),
    TensorRule(_BLOCK + r"mlp\.fc\.(weight|bias)", (0, 1), "local", "block"),
    TensorRule(_BLOCK + r"mlp\.usage", (0, 1), "local", "block"),  # a persistent buffer
    TensorRule(_BLOCK + r"mlp\.proj\.weight", (1, 1), "local", "block"),
    TensorRule(r"norm_f\.g", None, "tp-sum-if-sequence-parallel", "last"),
)

PROBE = families.register(
    Family(
        name="probe",
        module="probe_family:Probe",
        presets=PRESETS,
        step_flops=step_flops,
        parameters=parameters,
        layer_parameters=layer_parameters,
        first_parameters=first_parameters,
        last_parameters=last_parameters,
        activation_factor=activation_factor,
        layer_gemms=layer_gemms,
        tensors=TENSORS,
        check=check,
        keys=ProbeKeys,
        shape_extra=lambda model: {"ffn": model.mlp_ratio * model.d_model},
        keys_of_shape=lambda shape: {"mlp_ratio": _width(shape) // shape.hidden},
        reference="probe_family:PlainProbe",
    )
)
