"""What every registered family must satisfy, checked on its tiny preset: its rules describe
its modules, its spec counts its modules' parameters, the planner and the FLOPs reach it.

Imported by tests/test_families.py for the built-in families; run as
``python tests/family_checks.py ARCH PRESET`` in a subprocess for a family that only a
subprocess registers (the test family, through ``HPCLLM_FAMILIES``). Prints ``ok ARCH``.
"""

from __future__ import annotations

import sys

import torch

from hpcllm import families
from hpcllm.config import load_config, padded_vocab
from hpcllm.flops import model_step_flops
from hpcllm.model import build
from hpcllm.model.stages import build_chunks
from hpcllm.parallel.roles import role
from hpcllm.plan.costs import Model

VOCAB = 300


def check_rules(arch: str, preset: str) -> None:
    """Assert every tensor of ``arch``'s model has one rule, whose split is its layer's, and
    that the last of p=2 × v=2 stages holds just the tensors the rules give the last stage."""
    family = families.get(arch)
    cfg = load_config(None, [f"model.arch={arch}", f"model.preset={preset}"]).model
    with torch.device("meta"):
        whole = build(cfg, VOCAB)
        stages = build_chunks(
            cfg, VOCAB, p=2, rank=1, v=2, tp_group=None, seed=0, sequence_parallel=False
        )
    for name, param in whole.named_parameters():
        rules = [rule for rule in family.tensors if rule.matches(name)]
        assert len(rules) == 1, f"{name}: {rules}"
        assert rules[0].split == getattr(param, "partition", None), name
        assert role(param).split == rules[0].split and role(param).padded == rules[0].padded
    # Rank 1 of p=2, v=2 holds stages 1 and 3 (the last): outside its blocks, the tensors the
    # rules place last, and the tied copy of the embedding when the family ties it.
    tied = family.ties(cfg)
    outside = {n for n, _ in stages[1].named_parameters() if not n.startswith("blocks.")}
    expected = {
        n
        for n, _ in whole.named_parameters()
        if family.rule(n).stage == "last" or (tied and family.rule(n).stage == "first+last")
    }
    assert outside == expected, (outside, expected)
    for name, param in stages[1].named_parameters():
        if family.rule(name).stage == "first+last":
            assert "tied" in role(param).sums and role(param).stage_copy, name


def check_spec(arch: str, preset: str) -> None:
    """Assert the spec counts the module's parameters (the vocabulary as given; the module
    pads it) and that the planner and the step's FLOPs reach the family through the registry."""
    cfg = load_config(None, [f"model.arch={arch}", f"model.preset={preset}"]).model
    shape = families.shape(cfg, VOCAB)
    with torch.device("meta"):
        built = build(cfg, VOCAB)
    padded = families.shape(cfg, padded_vocab(VOCAB, 1))
    family = families.get(arch)
    assert sum(p.numel() for p in built.parameters()) == family.parameters(padded)
    assert Model(arch, shape).parameters() == family.parameters(shape)
    flops = model_step_flops(cfg, 8, VOCAB, "none")
    assert flops == family.step_flops(8, shape, "none") > 0
    assert family.step_flops(8, shape, "full") > flops


if __name__ == "__main__":
    check_rules(sys.argv[1], sys.argv[2])
    check_spec(sys.argv[1], sys.argv[2])
    print(f"ok {sys.argv[1]}")
