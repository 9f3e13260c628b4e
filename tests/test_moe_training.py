"""Mixture-of-experts models train alike under every layout and engine.

Each family's tiny model (tests/family_runs.py) with 4 experts, top-2, dropless, a z-loss and
a shared expert on Llama trains four steps on one process, then under the layouts below, and
must log the same losses, gradient norms and balancing losses: the router's and experts'
gradients reach the norm whole, and the auxiliary losses count every token of a micro-batch
whatever t, p or d split. One launch per rank count (tests/mpi_scripts/train_in_one_launch.py).
"""

from __future__ import annotations

import pytest
import torch
from family_runs import MOE, SMALLEST, cli, registered, rotate, tiny, train_together

import hpcllm
from hpcllm.evaluate import evaluate

# Every family at these layouts (the acceptance's), against its one-process run.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "t2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "p2-interleaved": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"]),
    "d2-ddp": (2, ["parallel.dp_engine=ddp"]),
    "d2-horovod": (2, ["parallel.dp_engine=horovod"]),
    "d2-ddp-zero1": (2, ["parallel.dp_engine=ddp", "parallel.distributed_optimizer=true"]),
    "t2p2": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
    "d2-ps": (2, ["parallel.dp_engine=ps"]),
    "d2-ps-async-k0": (2, ["parallel.dp_engine=ps-async", "parallel.max_staleness=0"]),
    # Local SGD averages weights, not gradients: only its first step's loss is compared.
    "d2-local-sgd": (2, ["parallel.dp_engine=local-sgd", "parallel.local_sgd_steps=1"]),
}
# These once, each by one family in turn (rotate): the MoE part is the same in both.
ROTATED: dict[str, tuple[int, list[str]]] = {
    "recompute-full": (1, ["model.recompute=full"]),
    "recompute-selective": (1, ["model.recompute=selective"]),
    # Compiled blocks (the routing's data-dependent shapes break the graph around dispatch).
    "compile-blocks": (1, ["model.compile=blocks"]),
    # Mixed precision: the router in fp32, the experts in bf16 or fp16 (with the loss scale
    # on the auxiliary losses' gradient too).
    "bf16": (1, ["train.precision=bf16"]),
    "fp16": (1, ["train.precision=fp16"]),
}
# The compiler fuses and reorders fp32 arithmetic (tests/test_compile.py's bound); half
# precision rounds every matmul.
TOLERANCE = {"compile-blocks": 1e-4, "bf16": 3e-2, "fp16": 1e-2}
FIRST_STEP_ONLY = {"d2-local-sgd"}
COMPARED = ("loss", "grad_norm", "moe_balance_loss", "moe_z_loss")


@pytest.mark.mpi
@pytest.mark.parametrize("arch", registered())
def test_an_moe_model_trains_alike_under_every_layout_and_engine(arch, stdlib, tmp_path):
    mine = {name: case for (name, case), family in rotate(ROTATED.items()) if family == arch}
    runs = {"t1": (1, []), **LAYOUTS, **mine}
    logged = {}
    for ranks in (1, 2, 4):
        group = {
            name: [*tiny(arch), *MOE[arch], *sets] for name, (n, sets) in runs.items() if n == ranks
        }
        logged |= train_together(ranks, stdlib, tmp_path, group)
    want = {key: [r[key] for r in logged["t1"]["records"]] for key in COMPARED}
    assert len(want["loss"]) == 4 and all(b > 0 for b in want["moe_balance_loss"])
    wrong = {}
    for name in runs:
        for key in COMPARED:
            got = [r.get(key) for r in logged[name]["records"]]
            if name in FIRST_STEP_ONLY:
                if key != "loss":
                    continue
                got, expected = got[:1], want[key][:1]
            elif key != "loss" and name == "d2-ps-async-k0":
                # The server's norm of the summed update is the engine's own test's, and a
                # segment logs no MoE figures (its workers meet at no step).
                continue
            else:
                expected = want[key]
            if got != pytest.approx(expected, rel=TOLERANCE.get(name, 1e-5)):
                wrong[f"{name} {key}"] = (got, expected)
    assert not wrong, wrong
    # Each MoE block's figures and experts' loads, whichever stage and replica held it.
    for name in ("t2p2", "p2-interleaved", "d2-ddp"):
        for got, expected in zip(logged[name]["records"], logged["t1"]["records"], strict=True):
            assert got["moe_blocks"].keys() == expected["moe_blocks"].keys()
            for block, figures in expected["moe_blocks"].items():
                assert got["moe_blocks"][block] == pytest.approx(figures, rel=1e-5), name
                load = expected["moe_expert_load"][block]
                assert got["moe_expert_load"][block] == pytest.approx(load, rel=1e-5), name
    # One model at every layout: t = 2 × p = 2 merged whole is the one process's to the
    # trained weights' rounding (a token whose router scores nearly tie may pick another
    # expert, so the bound is looser than a dense model's).
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = hpcllm.load_model(tmp_path / "t1")(ids)
    torch.testing.assert_close(hpcllm.load_model(tmp_path / "t2p2")(ids), logits, rtol=0, atol=5e-3)
    # Re-cut into t = 2 × p = 2 and merged again, the same model to the last bit: every MoE
    # tensor is cut and merged by its rule; evaluate reads the re-cut checkpoint.
    recut = tmp_path / "t1-recut"
    cli("convert", "--checkpoint", str(tmp_path / "t1"), "--out", str(recut), "--tp", "2",
        "--pp", "2", check=True)  # fmt: skip
    torch.testing.assert_close(hpcllm.load_model(recut)(ids), logits, rtol=0, atol=0)
    assert evaluate(recut, stdlib, split="train", iters=1).loss > 0
    # Generation with the KV cache is generation without it.
    model = hpcllm.load_model(tmp_path / "t1").eval()
    cached = model.generate(ids[:1, :5], 8, temperature=0, kv_cache=True)
    assert torch.equal(cached, model.generate(ids[:1, :5], 8, temperature=0, kv_cache=False))


SIGMOID = [
    *tiny("gpt2"),
    "model.moe_experts=4",
    "model.moe_top_k=2",
    "model.moe_router=sigmoid",
    "model.moe_renormalize=true",
    "model.moe_bias_rate=0.01",
    "train.steps=3",
    "train.global_batch_size=8",
]


def _biases(run) -> dict[str, torch.Tensor]:
    state = hpcllm.load_model(run).state_dict()
    return {name: t for name, t in state.items() if name.endswith("mlp.bias")}


@pytest.mark.mpi
def test_the_sigmoid_routers_bias_follows_every_ranks_loads_and_resumes(stdlib, tmp_path):
    # d = 2 with gradient accumulation 2 against one process accumulating 4.
    logged = train_together(1, stdlib, tmp_path, {"t1": SIGMOID})
    logged |= train_together(2, stdlib, tmp_path, {"d2": SIGMOID})
    one, two = _biases(tmp_path / "t1"), _biases(tmp_path / "d2")
    assert len(one) == 4 and any(b.abs().sum() > 0 for b in one.values())
    for name in one:
        # 3 steps of ±0.01: equal, or a sign flipped by one token's tie (never here).
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-6)
    losses = [r["loss"] for r in logged["t1"]["records"]]
    assert [r["loss"] for r in logged["d2"]["records"]] == pytest.approx(losses, rel=1e-5)
    # Stopped after step 2 and resumed: the uninterrupted losses and bias.
    resumed = tmp_path / "resumed"
    args = ["--set", f"data.path={stdlib}", "--set", f"run.dir={resumed}"]
    for steps in (2, 3):
        sets = [*SIGMOID, f"train.steps={steps}", "train.save_interval=1"]
        cli("train", *args, *[a for s in sets for a in ("--set", s)], check=True)
    again = _biases(resumed)
    for name in one:
        torch.testing.assert_close(again[name], one[name], rtol=0, atol=0)
    # Re-cut to t = 2 × p = 2, the biases (whole on every rank) come back as they were.
    recut = tmp_path / "recut"
    cli("convert", "--checkpoint", str(tmp_path / "t1"), "--out", str(recut), "--tp", "2",
        "--pp", "2", check=True)  # fmt: skip
    for name, bias in _biases(recut).items():
        torch.testing.assert_close(bias, one[name], rtol=0, atol=0)


@pytest.mark.slow
def test_a_dense_run_resumed_as_moe_and_the_reverse_are_refused_in_one_line(tmp_path):
    dense = [*SMALLEST, "data.synthetic=true", "model.vocab_size=512", "train.steps=1"]
    moe = [*dense, "model.moe_experts=4"]
    for first, then, says in ((dense, moe, "dense (model.moe_experts 0) vs MoE"),
                              (moe, dense, "MoE (model.moe_experts 4) vs dense")):  # fmt: skip
        run = tmp_path / says.split()[0]
        sets = [f"run.dir={run}"]
        cli("train", *[a for s in [*first, *sets] for a in ("--set", s)], check=True)
        again = [*then, *sets, "train.steps=2"]
        done = cli("train", *[a for s in again for a in ("--set", s)])
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if "error" in line]
        assert len(lines) == 1 and "holds another model" in lines[0] and says in lines[0], lines
