"""The model-family seam: the registry, the specs against the modules they describe, a family
defined only in the tests trained at t=2 and p=2 against t=p=1, re-cut and loaded, and
``hpcllm.load_model``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import toy_family
from mpirun import REPO, python, run_mpi

import hpcllm
from hpcllm import families
from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.model import build
from hpcllm.model.stages import build_chunks
from hpcllm.observe import read_metrics
from hpcllm.parallel.roles import role
from hpcllm.plan.costs import Model

TINY = [
    "model.preset=null",
    "model.n_layer=4",
    "model.n_head=4",
    "model.d_model=64",
    "model.seq_len=32",
    "model.dropout=0",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.lr_decay_steps=6",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.precision=fp32",
    "run.tensorboard=false",
]


@pytest.mark.parametrize("arch", ["gpt2", "gpt2-gated"])
def test_every_tensor_has_one_rule_that_says_how_it_is_split_and_where_it_lives(arch):
    family = families.get(arch)
    cfg = load_config(None, [f"model.arch={arch}", *TINY[:5]]).model
    with torch.device("meta"):
        whole = build(cfg, 300)
        stages = build_chunks(
            cfg, 300, p=2, rank=1, v=2, tp_group=None, seed=0, sequence_parallel=False
        )
    for name, param in whole.named_parameters():
        rules = [rule for rule in family.tensors if rule.matches(name)]
        assert len(rules) == 1, f"{name}: {rules}"
        assert rules[0].split == getattr(param, "partition", None), name
    # Rank 1 of p=2, v=2 holds stages 1 and 3 (the last): blocks 1 and 3, the tied copy of
    # the embedding and the final LayerNorm, as the rules' stages say.
    last = {name for name, _ in stages[1].named_parameters()}
    assert {n for n in last if family.rule(n).stage in ("last", "first+last")} == {
        "wte.weight",
        "ln_f.weight",
        "ln_f.bias",
    }
    assert not any(family.rule(n).stage == "first" for n in last)
    assert "tied" in role(stages[1].wte.weight).sums and role(stages[1].wte.weight).stage_copy


def test_the_planner_and_flops_reach_the_family_through_the_registry():
    plain, gated = Model.of("gpt2", 4, 64, 4, 32, 300), Model.of("gpt2-gated", 4, 64, 4, 32, 300)
    assert gated.parameters() - plain.parameters() == 4 * (4 * 64 * 64 + 4 * 64)
    with torch.device("meta"):
        built = build(load_config(None, ["model.arch=gpt2-gated", *TINY[:5]]).model, 300)
    # The spec counts the vocabulary as given; the module pads it (300 -> 384 rows).
    padding = (384 - 300) * 64
    assert sum(p.numel() for p in built.parameters()) == gated.parameters() + padding
    from hpcllm.flops import step_flops

    assert step_flops(8, 32, 4, 64, 300, arch="gpt2-gated") > step_flops(8, 32, 4, 64, 300)


def test_an_unknown_family_is_one_line_naming_the_known_ones():
    with pytest.raises(UserError, match="must be a model family"):
        load_config(None, ["model.arch=mamba"])
    with pytest.raises(UserError, match="known: gpt2, gpt2-gated"):
        families.get("mamba")


def test_import_hpcllm_imports_no_torch_and_load_model_resolves_on_first_use():
    code = (
        "import sys, hpcllm\n"
        "assert 'torch' not in sys.modules and 'hpcllm.generate' not in sys.modules\n"
        "f = hpcllm.load_model\n"
        "from hpcllm.generate import load_model\n"
        "assert f is load_model and 'torch' in sys.modules\n"
        "import hpcllm.plan.search, hpcllm.families\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    plan_only = "import sys, hpcllm.plan.search; assert 'torch' not in sys.modules"
    run = subprocess.run([sys.executable, "-c", plan_only], cwd=REPO, capture_output=True)
    assert run.returncode == 0, run.stderr
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = hpcllm.nothing


def _train(np: int, data, run, *layout: str) -> list[float]:
    args = ["-m", "hpcllm", "train", "--no-progress"]
    items = ["model.arch=gpt2-gated", *TINY, f"data.path={data}", f"run.dir={run}"]
    for item in [*items, "train.steps=4", *layout]:
        args += ["--set", item]
    run_mpi(np, python(*args), timeout=300, env=toy_family.ENV).check()
    return [r["loss"] for r in read_metrics(run)]


def test_a_family_from_the_tests_trains_alike_at_t2_and_p2_recuts_and_loads(stdlib, tmp_path):
    whole = _train(1, stdlib, tmp_path / "t1")
    for name, np, layout in [
        ("t2", 2, ["parallel.tp=2"]),
        ("p2", 2, ["parallel.pp=2"]),
        ("t2p2", 4, ["parallel.tp=2", "parallel.pp=2"]),
    ]:
        got = _train(np, stdlib, tmp_path / name, *layout)
        assert got == pytest.approx(whole, rel=1e-5), name
    # Re-cut t=2 x p=2 to one process; the run, the re-cut and the t=1 run give one model.
    recut = subprocess.run(
        [sys.executable, "-m", "hpcllm", "convert", "--checkpoint", str(tmp_path / "t2p2")]
        + ["--out", str(tmp_path / "one"), "--tp", "1", "--pp", "1"],
        capture_output=True,
        text=True,
        env={**os.environ, **toy_family.ENV},
        cwd=REPO,
        timeout=300,
    )
    assert recut.returncode == 0, recut.stderr
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = {name: hpcllm.load_model(tmp_path / name)(ids) for name in ("t1", "t2p2", "one")}
    assert isinstance(hpcllm.load_model(tmp_path / "one"), toy_family.GatedGPT)
    assert logits["t1"].shape == (2, 32, 257)
    torch.testing.assert_close(logits["t2p2"], logits["one"], rtol=0, atol=0)
    torch.testing.assert_close(logits["t2p2"], logits["t1"], rtol=1e-4, atol=1e-4)
