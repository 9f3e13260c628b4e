"""Expert parallelism (parallel.ep) trains as ep = 1 does, under every engine that takes it.

Each family's tiny MoE model (4 experts, top-2, dropless; tests/family_runs.py's MOE
settings) trains at ep = 2 inside d = 2 under DDP, Horovod and ZeRO-1 and must log the ep = 1,
d = 2 losses and gradient norms; after the first step every parameter's gradient (the
experts' gathered whole over the ep group) equals the ep = 1 gradient. The same at t = 2 (SP)
× ep = 2, p = 2 × ep = 2 and ep = 2 inside d = 4 (where the expert-dp groups have two ranks
and Horovod needs process sets), and under recomputation. The parts the families share are
checked by one each: GPT-2's capacity factor drops the same assignments at any ep, its bf16
stays near ep = 1's, its compiled blocks log ep = 1's losses, and convert takes --ep; Llama's
runs resume, with the uninterrupted losses, at another ep (2 to 1, 1 to 2, ZeRO-1's 2 to 4) and
at the same (ZeRO-1's 2 to 2), each rank reading the experts files that hold its experts. An
ep = 2 checkpoint's experts are in one file per ep rank. Two launches per family: one of 2
ranks, one of 4 (tests/mpi_scripts/ep_runs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from family_runs import HOROVOD_OVER_MPI, MOE, cli, tiny
from mpirun import python, run_mpi

from hpcllm.config import check, load_config
from hpcllm.errors import UserError

HOROVOD = "parallel.dp_engine=horovod"
# Small buckets, so that the model spans several of each kind.
ZERO = ["parallel.distributed_optimizer=true", "parallel.ddp_bucket_mb=0.01"]
CAPACITY = ["model.moe_capacity_factor=1.0", "model.moe_drop_policy=probs"]
# With recomputation, one family each: full in fp16 (the loss scale on the tokens'
# way back), selective with the sigmoid router (its bias moved by every rank's loads).
MORE = {
    "gpt2": ["model.recompute=full", "train.precision=fp16"],
    "llama": [
        "model.recompute=selective",
        "model.moe_router=sigmoid",
        "model.moe_bias_rate=0.01",
    ],
}
BF16 = ["train.precision=bf16", "train.steps=20", "train.log_interval=1"]


def _runs(np: int, data: Path, scratch: Path, runs: list) -> dict:
    command = [*python("tests/mpi_scripts/ep_runs.py", str(data), str(scratch)), json.dumps(runs)]
    result = run_mpi(np, command, env=HOROVOD_OVER_MPI, timeout=900).check()
    return json.loads(result.rank_stdout[0].splitlines()[-1])


def _grads_equal(scratch: Path, name: str, reference: str, ranks: int) -> None:
    """Assert each rank's first-step gradients of run ``name`` equal ``reference``'s (the
    largest difference within 1e-6 of the tensor's largest value)."""
    for rank in range(ranks):
        got = torch.load(scratch / name / f"grads-rank{rank}.pt")
        want = torch.load(scratch / reference / f"grads-rank{rank}.pt")
        assert got.keys() == want.keys() and any("experts" in k for k in got), (name, rank)
        for key, grad in want.items():
            worst = (got[key] - grad).abs().max().item()
            assert worst <= 1e-6 * grad.abs().max().item() + 1e-12, (name, rank, key, worst)


def _same(records: list, reference: list, keys: tuple[str, ...], rel: float) -> None:
    for key in keys:
        got, want = [r[key] for r in records], [r[key] for r in reference]
        assert len(got) == len(want) and got == pytest.approx(want, rel=rel), (key, got, want)


@pytest.mark.mpi
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_expert_parallel_runs_equal_ep1_in_losses_norms_gradients_drops_and_resume(
    arch, stdlib, tmp_path
):
    base = [*tiny(arch), *MOE[arch]]
    ep2 = ["parallel.ep=2"]
    short = ["train.steps=2", "train.save_interval=1"]
    two = [
        ["ep1", "ep1", base],
        ["ep2", "ep2", [*base, *ep2]],
        ["ep2-horovod", "ep2-horovod", [*base, *ep2, HOROVOD]],
        ["ep2-zero", "ep2-zero", [*base, *ep2, *ZERO]],
        # Recomputation replays the all-to-alls inside the backward; one kind each.
        ["ep1-more", "ep1-more", [*base, *MORE[arch]]],
        ["ep2-more", "ep2-more", [*base, *MORE[arch], *ep2]],
    ]
    # The rest of the layer is the same in both families: each checks its half.
    if arch == "gpt2":
        two += [
            ["ep1-capacity", "ep1-capacity", [*base, *CAPACITY]],
            ["ep2-capacity", "ep2-capacity", [*base, *CAPACITY, *ep2]],
            ["ep1-bf16", "ep1-bf16", [*base, *BF16]],
            ["ep2-bf16", "ep2-bf16", [*base, *BF16, *ep2]],
            # Compiled blocks: the all-to-alls run eagerly between the compiled parts.
            ["ep2-compile", "ep2-compile", [*base, *ep2, "model.compile=blocks"]],
        ]
    else:  # stopped after step 2 at one ep, resumed to step 4 at the other
        two += [
            ["from-ep2", "from-ep2", [*base, *ep2, *short]],
            ["from-ep2", "from-ep2", base],
            ["from-ep1", "from-ep1", [*base, *short]],
            ["from-ep1", "from-ep1", [*base, *ep2]],
        ]
    logged = _runs(2, stdlib, tmp_path, two)
    four = [
        ["d4-ep2-horovod", "d4-ep2-horovod", [*base, *ep2, HOROVOD]],
        ["d4-ep1", "d4-ep1", base],
        ["d4-ep2", "d4-ep2", [*base, *ep2]],
        ["t2-ep1", "t2-ep1", [*base, "parallel.tp=2", "parallel.sequence_parallel=true"]],
        ["t2-ep2", "t2-ep2", [*base, *ep2, "parallel.tp=2", "parallel.sequence_parallel=true"]],
        ["p2-ep1", "p2-ep1", [*base, "parallel.pp=2"]],
        ["p2-ep2", "p2-ep2", [*base, *ep2, "parallel.pp=2"]],
        # ZeRO-1: the experts' buckets cut over expert-dp (two ranks here).
        ["d4-ep2-zero", "d4-ep2-zero", [*base, *ep2, *ZERO]],
        ["d4-ep2-zero-horovod", "d4-ep2-zero-horovod", [*base, *ep2, *ZERO, HOROVOD]],
    ]
    if arch == "llama":
        four += [
            # ZeRO-1's state saved at ep = 2, resumed at ep = 4 by plain AdamW (each rank
            # reads half of one saved experts file), and at ep = 2 again (its own file).
            ["zero-from-ep2", "zero-from-ep2", [*base, *ep2, *ZERO, *short]],
            ["zero-from-ep2", "zero-from-ep2", [*base, "parallel.ep=4"]],
            ["zero-same-ep", "zero-same-ep", [*base, *ep2, *ZERO, *short]],
            ["zero-same-ep", "zero-same-ep", [*base, *ep2, *ZERO]],
            ["zero-from-ep1", "zero-from-ep1", [*base, *short]],
            ["zero-from-ep1", "zero-from-ep1", [*base, *ep2, *ZERO]],
        ]
    logged |= _runs(4, stdlib, tmp_path, four)

    reference = logged["ep1"]
    assert len(reference) == 4
    for name in ("ep2", "ep2-horovod", "d4-ep2", "d4-ep2-horovod", "t2-ep2", "p2-ep2",
                 "ep2-zero", "d4-ep2-zero", "d4-ep2-zero-horovod"):  # fmt: skip
        _same(logged[name], reference, ("loss", "grad_norm", "moe_balance_loss"), 1e-5)
    # At ep > 1 each logged step says how long this rank spent in the all-to-alls.
    assert all(r["moe_all_to_all_s"] > 0 for r in logged["ep2"] + logged["ep2-horovod"])
    assert not any("moe_all_to_all_s" in r for r in reference)
    _grads_equal(tmp_path, "ep2", "ep1", 2)
    _grads_equal(tmp_path, "ep2-horovod", "ep1", 2)
    for name, ref in (("d4-ep2", "d4-ep1"), ("d4-ep2-horovod", "d4-ep1"), ("t2-ep2", "t2-ep1"),
                      ("p2-ep2", "p2-ep1")):  # fmt: skip
        _grads_equal(tmp_path, name, ref, 4)
    _same(logged["ep2-more"], logged["ep1-more"], ("loss", "grad_norm"), 1e-5)
    if arch == "llama":  # re-cut both ways on resume: the uninterrupted run's losses
        for name in ("from-ep2", "from-ep1", "zero-from-ep2", "zero-same-ep", "zero-from-ep1"):
            _same(logged[name], reference, ("loss", "grad_norm"), 1e-5)
    else:
        # A capacity counts one rank's micro-batch, whatever ep: the same drops and losses.
        dropped = [r["moe_dropped"] for r in logged["ep1-capacity"]]
        assert all(d > 0 for d in dropped), dropped
        _same(logged["ep2-capacity"], logged["ep1-capacity"], ("loss", "moe_dropped"), 1e-5)
        # Inductor reorders fp32 sums (tests/test_compile.py's bound).
        _same(logged["ep2-compile"], reference, ("loss", "grad_norm"), 1e-4)
        # bf16: within 2 % of ep = 1 over 20 steps.
        _same(logged["ep2-bf16"], logged["ep1-bf16"], ("loss",), 2e-2)
        # convert's --ep: the config it writes, and its refusals.
        out = tmp_path / "converted"
        cli("convert", "--checkpoint", str(tmp_path / "ep2"), "--out", str(out), "--ep", "1",
            check=True)  # fmt: skip
        assert load_config(out / "config.yaml", []).parallel.ep == 1
        for args, says in ((["--dp", "1"], "must divide the data-parallel size d = 1"),
                           (["--ep", "3"], "does not divide model.moe_experts 4")):  # fmt: skip
            done = cli("convert", "--checkpoint", str(tmp_path / "ep2"), "--out",
                       str(tmp_path / "refused"), *args)  # fmt: skip
            assert done.returncode == 2 and says in done.stderr, done.stderr
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    # Each ep rank wrote its own experts; the model file holds the rest. Read whole (as
    # load_model reads it) the checkpoint is the ep = 1 model.
    folder = tmp_path / "ep2" / "checkpoints" / "step_00000004"
    whole = torch.load(folder / "model_tp00_pp00.pt")
    own = [torch.load(folder / f"experts_tp00_pp00_ep{r:02d}.pt") for r in range(2)]
    dense = torch.load(tmp_path / "ep1" / "checkpoints" / "step_00000004" / "model_tp00_pp00.pt")
    from hpcllm import families  # in the body, as hpcllm below

    family = families.get(arch)
    experts = [key for key in dense["model"] if family.rule(key).experts]
    assert experts and not any(key in whole["model"] for key in experts)
    for key in experts:
        parts = [o["model"][key] for o in own]
        assert [p.shape[0] for p in parts] == [2, 2], key
        moments = [o["optimizer"]["state"] for o in own]
        assert moments[0] and moments[0].keys() == moments[1].keys()
    import hpcllm  # here: importing it at collection would import Triton before test_kernels

    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(
        hpcllm.load_model(tmp_path / "ep2")(ids),
        hpcllm.load_model(tmp_path / "ep1")(ids),
        rtol=0,
        atol=1e-4,
    )


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["parallel.ep=2"], "model.moe_experts is 0"),
        (["model.moe_experts=4", "parallel.ep=3"], "does not divide model.moe_experts 4"),
        (["model.moe_experts=4", "parallel.ep=2", "parallel.dp=3"], "must divide the data"),
        (["model.moe_experts=4", "parallel.ep=2", "parallel.dp_engine=ps"], "use ddp or horovod"),
        (["model.moe_experts=4", "parallel.ep=2", "parallel.dp_engine=local-sgd"], "local-sgd"),
    ],
)
def test_an_expert_parallel_size_that_cannot_work_is_refused_in_one_line(sets, says):
    with pytest.raises(UserError) as err:
        check(load_config(None, sets))
    assert says in str(err.value) and "\n" not in str(err.value)
