"""The Llama family: its spec against its module (tensors, parameters, FLOPs counted from the
module's own matrices), rotary frequencies against Meta's piecewise rule, the config's
refusals, and its own shapes (a tied output layer, key/value heads replicated over t) and
fused kernels trained to their one-process losses. llama-tiny under every layout and engine,
as every family, is tests/test_family_training.py's."""

from __future__ import annotations

import math
import re

import pytest
import torch
from family_runs import cli, losses, tiny, train, train_together

import hpcllm
from hpcllm import families
from hpcllm.config import load_config
from hpcllm.errors import UserError
from hpcllm.model import build
from hpcllm.model.llama import Llama, ReplicatedHeadLinear, rope_frequencies
from hpcllm.model.stages import build_chunks
from hpcllm.parallel.roles import role
from hpcllm.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

LLAMA = tiny("llama")
# Qwen's attention variants on llama-tiny: heads of 24 over a hidden size of 128 (a free
# head_dim), biases on q, k and v (Qwen2's), q and k normed per head (Qwen3's); together
# here, which no Hugging Face model is, so that one model carries every variant.
QWEN = ["model.head_dim=24", "model.qkv_bias=true", "model.qk_norm=true"]


def _model_cfg(*extra: str):
    return load_config(None, [*LLAMA, *extra]).model


@pytest.mark.parametrize("tied", [False, True])
def test_every_tensor_has_one_rule_and_the_spec_counts_the_modules_parameters(tied):
    cfg = _model_cfg(f"model.tie_embeddings={str(tied).lower()}")
    family = families.get("llama")
    with torch.device("meta"):
        whole = build(cfg, 300)
        last = build_chunks(cfg, 300, p=2, rank=1, v=2, tp_group=None, seed=0,
                            sequence_parallel=False)[1]  # fmt: skip
    for name, param in whole.named_parameters():
        rules = [rule for rule in family.tensors if rule.matches(name)]
        assert len(rules) == 1, name
        assert rules[0].split == getattr(param, "partition", None), name
    shape = families.shape(cfg, 384)  # the module pads 300 to 384 rows
    assert sum(p.numel() for p in whole.parameters()) == family.parameters(shape)
    # The last stage: its blocks, the final norm and its own output layer (or the tied copy).
    names = {n for n, _ in last.named_parameters() if not n.startswith("blocks.")}
    assert names == ({"wte.weight"} if tied else {"lm_head.weight"}) | {"norm_f.weight"}
    if tied:
        assert "tied" in role(last.wte.weight).sums and role(last.wte.weight).stage_copy
    else:
        assert role(last.lm_head.weight).sums == () and role(last.lm_head.weight).counted


def test_qwen_s_attention_parts_have_their_rules_counts_and_flops():
    cfg = _model_cfg(*QWEN)
    family, shape = families.get("llama"), families.shape(_model_cfg(*QWEN), 384)
    model = Llama(cfg, 384)
    attn = model.blocks["0"].attn
    assert attn.q.weight.shape == (4 * 24, 128) and attn.proj.weight.shape == (128, 96)
    assert attn.k.bias.shape == (2 * 24,) and attn.q_norm.weight.shape == (24,)
    for name, param in model.named_parameters():
        rules = [rule for rule in family.tensors if rule.matches(name)]
        assert len(rules) == 1, name
        assert rules[0].split == getattr(param, "partition", None), name
    assert sum(p.numel() for p in model.parameters()) == family.parameters(shape)
    split, whole = family.layer_parameters(shape)
    block = model.blocks["0"]
    assert split + whole == sum(p.numel() for p in block.parameters())
    assert whole == sum(p.numel() for p in block.parameters() if p.dim() == 1 and
                        getattr(p, "partition", None) is None)  # fmt: skip
    # FLOPs: the matrices' 2 per weight, the core's 4·s·(heads × head_dim) per token.
    b, s = 3, cfg.seq_len
    forward = _linear_flops_per_token(model) + 4.0 * s * 96 * cfg.n_layer
    forward += 2.0 * 128 * model.lm_head.weight.shape[0]
    assert family.step_flops(b, shape, "none") / (b * s) == pytest.approx(3 * forward, rel=1e-12)
    # The q and k norms' gradient sums over tp (each rank norms its own heads), always.
    with torch.device("meta"):
        cut = build_chunks(cfg, 384, p=1, rank=0, v=1, tp_group=None, seed=0,
                           sequence_parallel=False)[0]  # fmt: skip
    assert family.rule("blocks.0.attn.q_norm.weight").grad == "tp-sum"
    assert role(cut.blocks["0"].attn.q_norm.weight).sums == ()  # nothing to sum at t = 1
    assert role(cut.blocks["0"].attn.k.bias).split == (0, 1)
    # A head size equal to d_model / n_head is the model a silent config gives.
    assert families.shape(_model_cfg("model.head_dim=32"), 384) == families.shape(_model_cfg(), 384)
    # A head size that is not d_model / n_head needs no divisible d_model; an odd one is refused.
    assert (
        families.get("llama").head_dim(
            _model_cfg("model.head_dim=24", "model.n_head=3", "model.n_kv_heads=1")
        )
        == 24
    )
    with pytest.raises(UserError, match="model.head_dim 25 must be even"):
        _model_cfg("model.head_dim=25")


def _linear_flops_per_token(model: torch.nn.Module) -> float:
    """2 FLOPs per weight per token of every matrix in the blocks, from the module's shapes."""
    layers = (ColumnParallelLinear, RowParallelLinear, ReplicatedHeadLinear)
    return sum(2.0 * m.weight.numel() for m in model.modules() if isinstance(m, layers))


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_flops_per_token_equal_a_count_from_the_modules_matrices(recompute):
    cfg = _model_cfg()
    model = Llama(cfg, 384)
    b, s, h, layers = 3, cfg.seq_len, cfg.d_model, cfg.n_layer
    matrices = _linear_flops_per_token(model)  # q, k, v (GQA: smaller), o, gate, up, down
    core = 4.0 * s * h * layers  # q·kᵀ and the weighted sum, per token
    logits = 2.0 * h * model.lm_head.weight.shape[0]
    forward = matrices + core + logits
    expected = 3 * forward + {"none": 0, "full": matrices + core, "selective": core}[recompute]
    shape = families.shape(cfg, 384)
    got = families.get("llama").step_flops(b, shape, recompute) / (b * s)
    assert got == pytest.approx(expected, rel=1e-12)
    # GQA: k and v are half of q here (2 kv heads of 4), and three MLP matrices.
    block = model.blocks["0"]
    assert block.attn.k.weight.shape[0] * 2 == block.attn.q.weight.shape[0]
    assert block.mlp.gate.weight.shape == block.mlp.up.weight.shape == (352, h)


def _meta_rope(head_dim: int, theta: float, factor, low, high, context) -> list[float]:
    """Meta's Llama 3.1 rule, written as the piecewise function it is."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * math.pi / freq
        if factor is None or wavelength < context / high:
            out.append(freq)
        elif wavelength > context / low:
            out.append(freq / factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["model.rope_scaling=null"],
        [
            "model.d_model=256",
            "model.n_head=2",
            "model.rope_theta=500000",
            "model.rope_scaling=8",
            "model.rope_original_seq_len=8192",
            "model.ffn_size=512",
        ],
    ],  # fmt: skip
)
def test_rotary_frequencies_follow_metas_rule(sets):
    cfg = _model_cfg(*sets)
    got = rope_frequencies(cfg).double()
    want = _meta_rope(
        cfg.d_model // cfg.n_head,
        cfg.rope_theta,
        cfg.rope_scaling,
        cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor,
        cfg.rope_original_seq_len,
    )
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    if cfg.rope_scaling is not None:  # the scaling changes some frequencies, not all
        plain = _meta_rope(cfg.d_model // cfg.n_head, cfg.rope_theta, None, 1, 4, 1)
        assert got[0] == pytest.approx(plain[0]) and got[-1] < plain[-1]


def test_attention_is_grouped_query_attention():
    """One block's attention equals attention written out with each kv head repeated for the
    query heads that share it (rotations applied the same way)."""
    cfg = _model_cfg()
    attn = Llama(cfg, 300).blocks["0"].attn
    x = torch.randn(2, 16, cfg.d_model, generator=torch.Generator().manual_seed(1))
    out, _ = attn(x)
    b, s, d = 2, 16, cfg.d_model // cfg.n_head
    q = attn.q(x).view(b, s, 4, d).transpose(1, 2)
    k = attn.k(x).view(b, s, 2, d).transpose(1, 2).repeat_interleave(2, dim=1)
    v = attn.v(x).view(b, s, 2, d).transpose(1, 2).repeat_interleave(2, dim=1)
    inv = torch.tensor(attn.inv_freq)
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()

    def rot(t):
        return t * cos + torch.cat([-t[..., d // 2 :], t[..., : d // 2]], -1) * sin

    scores = rot(q) @ rot(k).transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, cfg.d_model)
    torch.testing.assert_close(out, attn.proj(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["model.arch=gpt2", "model.n_kv_heads=2"], "model.n_kv_heads is not a gpt2 setting"),
        (["model.arch=gpt2", "model.tie_embeddings=false"], "tie_embeddings is not a gpt2 setting"),
        (["model.arch=gpt2", "model.preset=llama-tiny"], "is a llama preset"),
        ([*LLAMA, "model.n_kv_heads=3"], "not a multiple of model.n_kv_heads 3"),
        (
            [*LLAMA, "model.n_head=12", "model.n_kv_heads=4", "model.d_model=384", "parallel.tp=3"],
            "one must divide the other",
        ),
        ([*LLAMA, "model.ffn_size=350", "parallel.tp=4"], "MLP width 350"),
        ([*LLAMA, "model.n_head=8", "model.d_model=120"], "must be even"),
        ([*LLAMA, "model.rope_high_freq_factor=1"], "must be above"),
    ],  # fmt: skip
)
def test_shapes_the_family_cannot_run_are_one_line(sets, words):
    with pytest.raises(UserError, match=words) as err:
        load_config(None, sets)
    assert "\n" not in str(err.value)


def test_meta_s_mlp_width_rule():
    from hpcllm.families.llama import ffn_size

    # Llama 3 8B: 4096 -> 2/3 of 4h = 10922, x 1.3 = 14199, up to a multiple of 1024: 14336.
    sizes = ["model.preset=null", "model.n_layer=2", "model.seq_len=64", "model.d_model=4096"]
    sizes += ["model.n_head=32", "model.ffn_multiplier=1.3", "model.ffn_multiple_of=1024"]
    cfg = load_config(None, ["model.arch=llama", *sizes]).model
    assert ffn_size(cfg) == families.get("llama").presets["llama3-8b"]["ffn_size"] == 14336


def _assert_merged_and_recut_alike(tmp_path, whole: str, split: str) -> None:
    """Run ``split`` (t = 2), merged whole, gives run ``whole``'s logits (to rounding: it
    trained apart), and ``whole`` re-cut at t = 2, p = 2 and merged back gives them exactly."""
    ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    one = hpcllm.load_model(tmp_path / whole)(ids)
    torch.testing.assert_close(hpcllm.load_model(tmp_path / split)(ids), one,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    cli("convert", "--checkpoint", str(tmp_path / whole), "--out", str(tmp_path / "recut"),
        "--tp", "2", "--pp", "2", check=True)  # fmt: skip
    torch.testing.assert_close(hpcllm.load_model(tmp_path / "recut")(ids), one, rtol=0, atol=0)


@pytest.mark.mpi
def test_llama_s_tied_output_and_replicated_kv_heads_train_alike_and_recut(stdlib, tmp_path):
    # A tied model and one with a single kv head are other models: each its own reference.
    # One kv head for two tp ranks: each keeps it, sums its gradient, counts it once (a
    # vocabulary that t = 1 and t = 2 pad alike, so that the parameter counts compare), also
    # under the distributed optimizer over d = 2, whose norm takes its own parts.
    tied = ["model.tie_embeddings=true"]
    kv1 = ["model.n_kv_heads=1", "model.vocab_size=512"]
    runs = {
        "t1": (1, []),
        "tied-t1": (1, tied),
        "kv1-t1": (1, kv1),
        "tied-p2-gpipe": (2, [*tied, "parallel.pp=2", "parallel.schedule=gpipe"]),
        "kv1-t2-sp": (2, [*kv1, "parallel.tp=2", "parallel.sequence_parallel=true"]),
        "kv1-t2-zero1": (4, [*kv1, "parallel.tp=2", "parallel.distributed_optimizer=true"]),
    }
    logged = {}
    for ranks in (1, 2, 4):
        mine = {name: [*LLAMA, *sets] for name, (n, sets) in runs.items() if n == ranks}
        logged |= train_together(ranks, stdlib, tmp_path, mine)
    losses = {name: [r["loss"] for r in run["records"]] for name, run in logged.items()}
    for name, reference in [
        ("tied-p2-gpipe", "tied-t1"),
        ("kv1-t2-sp", "kv1-t1"),
        ("kv1-t2-zero1", "kv1-t1"),
    ]:
        assert losses[name] == pytest.approx(losses[reference], rel=1e-5), name
    assert losses["kv1-t1"] != pytest.approx(losses["t1"], rel=1e-3)  # another model
    assert losses["tied-t1"] != pytest.approx(losses["t1"], rel=1e-3)
    parameters = {name: run["summary"]["parameters"] for name, run in logged.items()}
    assert parameters["kv1-t2-sp"] == parameters["kv1-t1"] == parameters["kv1-t2-zero1"]
    # Merged whole, the replicated heads are the one head; re-cut into replicated heads
    # (t = 2, p = 2), the model is the same to the last bit.
    _assert_merged_and_recut_alike(tmp_path, "kv1-t1", "kv1-t2-sp")


@pytest.mark.mpi
def test_qwen_s_attention_parts_train_alike_at_t2_sp_and_p2_and_recut(stdlib, tmp_path):
    # q/k/v biases, q/k norms and heads of 24 at t = 2 with sequence parallelism, at p = 2
    # (1F1B), and with one key/value head replicated on both tp ranks (its bias and k norm
    # too): the one-process losses and gradient norms of the same model.
    kv1 = [*QWEN, "model.n_kv_heads=1"]
    runs = {
        "t1": (1, QWEN),
        "kv1-t1": (1, kv1),
        "t2-sp": (2, [*QWEN, "parallel.tp=2", "parallel.sequence_parallel=true"]),
        "p2": (2, [*QWEN, "parallel.pp=2"]),
        "kv1-t2": (2, [*kv1, "parallel.tp=2"]),
    }
    logged = {}
    for ranks in (1, 2):
        # A vocabulary that t = 1 and t = 2 pad alike, so that the parameter counts compare.
        mine = {
            name: [*LLAMA, *sets, "model.vocab_size=512"]
            for name, (n, sets) in runs.items()
            if n == ranks
        }
        logged |= train_together(ranks, stdlib, tmp_path, mine)
    for name, reference in [("t2-sp", "t1"), ("p2", "t1"), ("kv1-t2", "kv1-t1")]:
        # The norms to 1e-4: three updates' rounding moves the fourth step's by 1e-5.
        for key, rel in (("loss", 1e-5), ("grad_norm", 1e-4)):
            got = [r[key] for r in logged[name]["records"]]
            want = [r[key] for r in logged[reference]["records"]]
            assert got == pytest.approx(want, rel=rel), (name, key)
        assert logged[name]["summary"]["parameters"] == logged[reference]["summary"]["parameters"]
    _assert_merged_and_recut_alike(tmp_path, "t1", "t2-sp")


@pytest.mark.mpi
def test_llama_tiny_trains_alike_with_its_fused_kernels(stdlib, tmp_path):
    # RMSNorm, SwiGLU and the rotation as Triton kernels (on the CPU under Triton's
    # interpreter, which fused_kernels: on requires there) against the torch references, at
    # t = 2 with sequence parallelism (one process: test_kernels' Llama step, in-process).
    # Short runs: the interpreter is slow. Qwen's attention parts ride along: the q and k
    # norms are the RMSNorm kernel over heads of 24, which the rotation turns too.
    short = ["train.global_batch_size=4", "train.eval_iters=1", "train.steps=2"]
    for name, np, layout in [("t2-sp", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"])]:
        said, logged = {}, {}
        for fused, env in [("off", None), ("on", {"TRITON_INTERPRET": "1"})]:
            run = tmp_path / f"{name}-{fused}"
            result = train(np, stdlib, run, *LLAMA, *QWEN, *layout, *short,
                           f"model.fused_kernels={fused}", env=env).check()  # fmt: skip
            said[fused] = result.rank_stdout.get(0, result.stdout) + result.rank_stderr.get(0, "")
            logged[fused] = losses(run)
        assert logged["on"] == pytest.approx(logged["off"], rel=1e-5), name
        ran = re.search(r"fused kernels \(Triton\): (.*)", said["on"])
        assert ran and {"rms_norm", "rotary", "swiglu"} <= set(ran.group(1).split(", ")), name
        assert "fused kernels" not in said["off"]


def test_rotary_positions_are_relative_and_the_cache_continues_them():
    """Rotary attention sees position differences only: every position shifted by 5 gives the
    default's logits to rounding, a permutation other logits. Decoding after a cached prompt
    (positions cache.length …) gives the whole sequence's last logits."""
    from hpcllm.model.decoder import KVCache

    model = Llama(_model_cfg("model.dropout=0"), 300, seed=4).eval()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        default = model(ids)
        shifted = model(ids, positions=torch.arange(5, 17))
        order = torch.randperm(12, generator=torch.Generator().manual_seed(2))
        permuted = model(ids, positions=order)
        torch.testing.assert_close(shifted, default, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(permuted, default, rtol=1e-2, atol=1e-3)
        cache = KVCache(len(model.blocks), 16)
        model.decode(ids[:, :11], cache)
        torch.testing.assert_close(
            model.decode(ids[:, 11:], cache)[:, -1], default[:, -1], rtol=1e-5, atol=1e-5
        )


def test_compiled_llama_blocks_share_one_graph_and_match_eager():
    from torch._dynamo.utils import counters

    from hpcllm.train.parallelize import compile_chunks

    torch._dynamo.reset()
    counters.clear()
    cfg = _model_cfg("model.n_layer=3", "model.d_model=64", "model.ffn_size=96")
    model, reference = Llama(cfg, 50, seed=3), Llama(cfg, 50, seed=3)
    compile_chunks(torch.nn.ModuleList([model]), "blocks")
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    loss, expected = model(ids, ids), reference(ids, ids)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert counters["stats"]["unique_graphs"] == 2  # one block graph for 3 blocks, the head's
    assert list(model.state_dict()) == list(reference.state_dict())
