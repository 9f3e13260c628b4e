"""A model family defined only in the tests: GPT-2 whose MLP is gated, SiLU(x·G) ⊙ (x·U) → D.

Importing this module registers ``gpt2-gated`` (spec and torch half in one file, as a plugin
may). Ranks started by mpirun import it through ``HPCLLM_FAMILIES=toy_family`` with this
folder on ``PYTHONPATH`` (:data:`ENV`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpcllm import families
from hpcllm.families import Family, Shape, TensorRule, gpt2
from hpcllm.model.gpt import GPT, Block
from hpcllm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, normal_init

HERE = Path(__file__).resolve().parent
ENV = {
    "HPCLLM_FAMILIES": "toy_family",
    "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
}


class GatedMLP(nn.Module):
    """h → 4h twice (gate and up, column-parallel) → SiLU(gate) · up → h (row-parallel)."""

    def __init__(
        self, cfg: Any, group: Any, gen: torch.Generator, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        h = cfg.d_model
        column = {"group": group, "gen": gen, "sequence_parallel": sequence_parallel}
        self.gate = ColumnParallelLinear(h, 4 * h, init=normal_init(cfg.init_std), **column)
        self.fc = ColumnParallelLinear(h, 4 * h, init=normal_init(cfg.init_std), **column)
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
        y = F.silu(self.gate(x)) * self.fc(x)
        return self.proj(y, add_bias=add_bias), None if add_bias else self.proj.bias


class GatedBlock(Block):
    mlp_class = GatedMLP


class GatedGPT(GPT):
    block_class = GatedBlock


def _parameters(shape: Shape) -> int:
    h = shape.hidden
    return gpt2.parameters(shape) + shape.layers * (4 * h * h + 4 * h)  # the gate


def _layer_parameters(shape: Shape) -> tuple[int, int]:
    split, whole = gpt2.layer_parameters(shape)
    return split + 4 * shape.hidden * shape.hidden + 4 * shape.hidden, whole


def _step_flops(batch: int, shape: Shape, recompute: str) -> float:
    # The gate's GEMM: 2·B·s·h·4h forward, twice that backward, once more when recomputed.
    gate = 2.0 * batch * shape.seq * shape.hidden * 4 * shape.hidden * shape.layers
    return gpt2.step_flops(batch, shape, recompute) + gate * (4 if recompute == "full" else 3)


def _layer_gemms(rows: int, shape: Shape, t: int) -> list[tuple[int, int, int]]:
    return [*gpt2.layer_gemms(rows, shape, t), (rows, 4 * shape.hidden // t, shape.hidden)]


_GATE = TensorRule(r"blocks\.\d+\.mlp\.gate\.(weight|bias)", (0, 1), "local", "block")

GATED = families.register(
    Family(
        name="gpt2-gated",
        module="toy_family:GatedGPT",
        presets={},  # sizes given in full (gpt2's presets serve it too)
        step_flops=_step_flops,
        parameters=_parameters,
        layer_parameters=_layer_parameters,
        first_parameters=gpt2.first_parameters,
        last_parameters=gpt2.last_parameters,
        activation_factor=gpt2.activation_factor,
        layer_gemms=_layer_gemms,
        tensors=(*gpt2.TENSORS, _GATE),
    )
)
