"""Context parallelism (parallel.cp): sequences split over ranks train as whole ones do.

In one process: the chunks each rank holds (r and 2·cp−1−r, the same causal work on every
rank), attention over the gathered keys and values against whole causal attention (outputs
and the gradients of q, k and v, with and without grouped key/value heads), the grid's rank
order (cp next to t; nothing moves at cp = 1) and the config's refusals. Under mpirun, each
family's tiny model at cp = 2, at cp = 2 with recomputation, and at cp = 2 × t = 2 (SP),
× p = 2 and × d = 2 under DDP, Horovod and ZeRO-1, and under the parameter server, logs the
cp = 1 losses and gradient norms (and, at d = 2, its final validation loss), and so does
cp = 2 under the packed documents' masks;
after the first step each rank's gradients are cp = 1's; a run stopped at cp = 2 resumes at
cp = 1 (and the reverse) with the uninterrupted losses. One launch of 2 ranks and one of 4
per family (tests/mpi_scripts/ep_runs.py, which trains any list of runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from family_runs import HOROVOD_OVER_MPI, tiny
from mpirun import python, run_mpi

from hpcllm.config import check, load_config
from hpcllm.errors import UserError
from hpcllm.parallel.context import ContextParallel, chunk_positions
from hpcllm.topology import Layout


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_holds_two_chunks_with_the_same_causal_work(cp):
    s = 8 * cp
    held = [chunk_positions(s, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(s))
    c = s // (2 * cp)
    assert held[0].tolist() == [*range(c), *range(s - c, s)]
    # The keys each rank's queries see under the causal mask: the same count on every rank.
    work = {int(ContextParallel(None, cp, r, s).mask(torch.device("cpu")).sum()) for r in range(cp)}
    assert len(work) == 1
    with pytest.raises(ValueError, match="does not cut into 2 x"):
        chunk_positions(s + 2, cp, 0)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_over_gathered_chunks_equals_whole_causal_attention(cp, kv_heads):
    """Every rank's queries over the gathered keys and values (here gathered in one process,
    from the same leaves, so that autograd sums each key's gradient over the ranks as the
    reduce-scatter does) give whole causal attention's outputs and gradients."""
    gen = torch.Generator().manual_seed(cp * 10 + kv_heads)
    b, heads, s, d = 2, 4, 16 * cp, 8
    q = torch.randn(b, heads, s, d, generator=gen, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, generator=gen, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, generator=gen, requires_grad=True)
    grad = torch.randn(b, heads, s, d, generator=gen)
    gqa = kv_heads != heads
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    want = torch.autograd.grad(whole, (q, k, v), grad)

    order = torch.cat([chunk_positions(s, cp, r) for r in range(cp)])
    k_all, v_all = k[:, :, order], v[:, :, order]  # what the all-gather hands every rank
    out = torch.zeros_like(whole)
    total = 0
    for r in range(cp):
        context = ContextParallel(None, cp, r, s)
        mine = context.positions(q.device)
        y = context.attend(q[:, :, mine], k_all, v_all, gqa=gqa)
        out[:, :, mine] = y.detach()
        total = total + (y * grad[:, :, mine]).sum()
    got = torch.autograd.grad(total, (q, k, v))
    torch.testing.assert_close(out, whole.detach(), rtol=1e-6, atol=1e-6)
    for name, g, w in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-5, msg=name)


def test_the_grid_puts_cp_next_to_t_and_moves_nothing_at_cp1():
    plain = Layout(tp=2, pp=2, dp=2)
    same = Layout(tp=2, pp=2, dp=2, cp=1)
    assert [plain.coords(r) for r in range(8)] == [same.coords(r) for r in range(8)]
    assert plain.replicas() is plain
    layout = Layout(tp=2, pp=2, dp=2, cp=2)
    assert layout.world_size == 16
    # rank = t + tp·(c + cp·(d + dp·p)): a cp group is t·cp consecutive ranks.
    assert layout.cp_group(0) == [0, 2] and layout.cp_group(5) == [5, 7]
    assert layout.tp_group(2) == [2, 3]
    assert layout.dp_group(0) == [0, 4] and layout.pp_group(2) == [2, 10]
    assert layout.dp_cp_group(0) == [0, 2, 4, 6]
    flat = layout.replicas()
    assert (flat.tp, flat.pp, flat.dp, flat.cp) == (2, 2, 4, 1)
    # The replicas' data-parallel index is cp_rank + cp·dp_rank: the same world ranks.
    for rank in range(16):
        t, p, d = layout.coords(rank)
        assert flat.rank(t, p, layout.cp_rank(rank) + 2 * d) == rank
    assert sorted(sum(layout.groups("cp"), [])) == list(range(16))
    with pytest.raises(UserError, match="tp\\*cp\\*pp\\*dp = 2\\*2\\*1\\*2 = 8 does not equal"):
        Layout.for_world(6, tp=2, cp=2, dp=2)
    assert Layout.for_world(8, tp=2, cp=2).dp == 2


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["parallel.cp=3"], "parallel.cp 3 cuts model.seq_len 32 into 2 x cp = 6 chunks"),
        (
            [
                "parallel.cp=2",
                "parallel.tp=4",
                "parallel.sequence_parallel=true",
                "model.seq_len=24",
            ],  # fmt: skip
            "cuts model.seq_len 24 into 2 x cp x t = 16 parts",
        ),
        (["parallel.cp=2", "parallel.dp_engine=ps-async"], "must step together"),
        (["parallel.cp=2", "parallel.dp_engine=local-sgd"], "must step together"),
        (
            ["parallel.cp=2", "parallel.ep=2", "model.moe_experts=4"],
            "expert parallelism is not carved out of d x cp",
        ),
        (["parallel.cp=2", "model.moe_experts=4"], "train mixtures of experts at parallel.cp: 1"),
    ],
)
def test_a_context_split_that_cannot_work_is_refused_in_one_line(sets, says):
    with pytest.raises(UserError) as caught:
        check(load_config(None, [*tiny("gpt2"), *sets]))
    assert says in str(caught.value) and "\n" not in str(caught.value)


HOROVOD = "parallel.dp_engine=horovod"
ZERO = ["parallel.distributed_optimizer=true", "parallel.ddp_bucket_mb=0.01"]
CP2 = ["parallel.cp=2"]
SHORT = ["train.steps=2", "train.save_interval=1"]
# The packed documents' masks (tests/test_documents.py), on short documents.
DOCS = ["data.reset_attention_at_eos=true", "data.mask_eod_loss=true"]
# Recomputation replays the gather inside the backward; one kind each family.
MORE = {
    "gpt2": ["model.recompute=full", "train.precision=fp16"],
    "llama": ["model.recompute=selective"],
}


def _runs(np: int, data: Path, scratch: Path, runs: list) -> dict:
    command = [*python("tests/mpi_scripts/ep_runs.py", str(data), str(scratch)), json.dumps(runs)]
    result = run_mpi(np, command, env=HOROVOD_OVER_MPI, timeout=900).check()
    return json.loads(result.rank_stdout[0].splitlines()[-1])


def _same(records: list, reference: list, rel: float = 1e-5, val: bool = False) -> None:
    for key in ("loss", "grad_norm"):
        got, want = [r[key] for r in records], [r[key] for r in reference]
        assert len(got) == len(want) == 4 and got == pytest.approx(want, rel=rel), (key, got, want)
    if val:  # the final validation, at the reference's d (d ranks read d shares of it)
        assert records[-1]["val_loss"] == pytest.approx(reference[-1]["val_loss"], rel=rel)


@pytest.mark.mpi
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_context_parallel_runs_equal_cp1_in_losses_norms_gradients_and_resume(
    arch, stdlib, short_docs, tmp_path
):
    base = tiny(arch)
    docs = [*base, f"data.path={short_docs}", *DOCS]
    two = [
        ["cp1-docs", "cp1-docs", docs],
        ["cp2-docs", "cp2-docs", [*docs, *CP2]],
        ["cp1", "cp1", base],  # d = 2: the reference, two ranks like every cp = 2 run here
        ["cp2", "cp2", [*base, *CP2]],
        ["cp2-ps", "cp2-ps", [*base, *CP2, "parallel.dp_engine=ps"]],
        ["cp1-more", "cp1-more", [*base, *MORE[arch]]],
        ["cp2-more", "cp2-more", [*base, *MORE[arch], *CP2]],
        # Stopped after step 2 at one cp, resumed to step 4 at the other (d·cp stays 2).
        ["from-cp2", "from-cp2", [*base, *CP2, *SHORT]],
        ["from-cp2", "from-cp2", base],
        ["from-cp1", "from-cp1", [*base, *SHORT]],
        ["from-cp1", "from-cp1", [*base, *CP2]],
    ]
    logged = _runs(2, stdlib, tmp_path, two)
    sp = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    four = [
        ["cp2-t2-sp", "cp2-t2-sp", [*base, *CP2, *sp]],
        ["cp2-p2", "cp2-p2", [*base, *CP2, "parallel.pp=2"]],
        ["cp2-d2", "cp2-d2", [*base, *CP2]],
        ["cp2-d2-horovod", "cp2-d2-horovod", [*base, *CP2, HOROVOD]],
        ["cp2-d2-zero", "cp2-d2-zero", [*base, *CP2, *ZERO]],
    ]
    logged |= _runs(4, stdlib, tmp_path, four)

    reference = logged["cp1"]
    for name in ("cp2", "cp2-ps", "from-cp2", "from-cp1", *(name for name, _, _ in four)):
        _same(logged[name], reference, val=name in ("from-cp2", "cp2-d2", "cp2-d2-horovod",
                                                     "cp2-d2-zero"))  # fmt: skip
    # Each rank's chunks hold their own share of the documents and of the labels that count.
    _same(logged["cp2-docs"], logged["cp1-docs"])
    # GPT-2's is fp16: the masked attention rounds apart from the causal one (5.7e-5 seen).
    _same(logged["cp2-more"], logged["cp1-more"], rel=1e-5 if arch == "llama" else 5e-4)
    # After the first step's reduction every rank holds cp = 1's whole gradients.
    for rank in range(2):
        got = torch.load(tmp_path / "cp2" / f"grads-rank{rank}.pt")
        want = torch.load(tmp_path / "cp1" / f"grads-rank{rank}.pt")
        assert got.keys() == want.keys()
        for key, grad in want.items():
            worst = (got[key] - grad).abs().max().item()
            assert worst <= 1e-6 * grad.abs().max().item() + 1e-12, (rank, key, worst)
    # The checkpoint says what cut it; the re-cut run went on at cp = 1.
    meta = json.loads(
        (tmp_path / "cp2" / "checkpoints" / "step_00000004" / "meta.json").read_text()
    )
    assert (meta["cp"], meta["dp"]) == (2, 2)
    assert load_config(tmp_path / "from-cp2" / "config.yaml", []).parallel.cp == 1
    # Read back whole (generate, evaluate, convert), the cp = 2 run is the cp = 1 model.
    import hpcllm

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    split, whole = (hpcllm.load_model(tmp_path / name)(ids) for name in ("cp2", "cp1"))
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-4)


def test_activation_bytes_count_each_saved_storage_once_and_no_parameter():
    from hpcllm.bench.cp import activation_bytes

    layer = torch.nn.Linear(16, 16, bias=False)
    x = torch.randn(8, 16, requires_grad=True)

    def step():
        h = layer(x)  # saves x (for the weight's gradient) and the weight (a parameter)
        return (h * h).sum()  # saves h, twice over: one storage

    loss, counted = activation_bytes(step, list(layer.parameters()))
    assert counted == x.nbytes + 8 * 16 * 4
    loss.backward()  # what was saved still serves the backward
    assert x.grad is not None


@pytest.mark.mpi
def test_bench_cp_smoke_halves_the_activations_in_an_empty_folder(tmp_path):
    from family_runs import cli

    cli("bench", "cp", "--cpu-smoke", "--seq", "256", cwd=tmp_path, check=True)
    out = tmp_path / "runs" / "bench-cp"
    result = json.loads((out / "bench_cp.json").read_text())
    rows = {row["cp"]: row for row in result["rows"]}
    assert set(rows) == {1, 2} and all(r["seq"] == 256 for r in rows.values())
    assert rows[1]["vs_cp1"] == 1.0 and rows[2]["vs_cp1"] <= 0.6, rows
    assert all(r["step_time_s"] > 0 and r["tokens_per_s"] > 0 for r in rows.values())
    assert (out / "bench_cp.png").stat().st_size > 0 and "vs cp=1" in (
        out / "bench_cp.txt"
    ).read_text()


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_lower_right_causal_attention_by_either_mask_is_the_masked_reference(kv_heads):
    """A chunk's queries over the keys up to its end: the cached additive mask (CPU) and
    torch's CausalBias (what CUDA runs) give the boolean-masked reference, values and
    gradients; equal lengths are plain causal attention."""
    from hpcllm.parallel.context import lower_right_attention

    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(2, 4, 8, 16, generator=gen, requires_grad=True)
    k = torch.randn(2, kv_heads, 24, 16, generator=gen, requires_grad=True)
    v = torch.randn(2, kv_heads, 24, 16, generator=gen, requires_grad=True)
    gqa = kv_heads != 4
    seen = torch.arange(24)[None, :] <= torch.arange(8)[:, None] + 16
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=gqa)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    cache: dict = {}
    for causal_bias in (False, True):
        got = lower_right_attention(q, k, v, 0.0, gqa, cache, causal_bias=causal_bias)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for g, w in zip(torch.autograd.grad(got.sum(), (q, k, v)), want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-5)
    assert len(cache) == 1  # the additive mask, made once
    same = lower_right_attention(q, k[:, :, :8], v[:, :, :8], 0.0, gqa, cache)
    plain = F.scaled_dot_product_attention(q, k[:, :, :8], v[:, :, :8], is_causal=True,
                                           enable_gqa=gqa)  # fmt: skip
    torch.testing.assert_close(same, plain, rtol=0, atol=0)


def test_the_documented_yaml_loads_and_takes_its_grid(tmp_path):
    from hpcllm.train.preflight import preflight

    text = (Path(__file__).parent.parent / "docs" / "context-parallel.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "cp.yaml").write_text(block)
    cfg = load_config(tmp_path / "cp.yaml", [])
    assert (cfg.parallel.cp, cfg.parallel.tp, cfg.model.seq_len) == (2, 2, 8192)
    preflight(cfg, 8)  # t·cp = 4, d = 2
    with pytest.raises(UserError, match="tp\\*cp\\*pp = 2\\*2\\*1 = 4"):
        preflight(cfg, 6)
