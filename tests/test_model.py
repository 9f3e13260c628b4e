import json
import math

import pytest
import torch

from hpcllm import families
from hpcllm.config import ModelConfig, load_config, padded_vocab
from hpcllm.convert import from_hf_state, to_hf_state
from hpcllm.errors import UserError
from hpcllm.families.gpt2 import hf_config
from hpcllm.model.gpt import GPT
from hpcllm.train.optim import lr_at


def small(**kw) -> ModelConfig:
    cfg = dict(preset=None, n_layer=2, n_head=4, d_model=32, seq_len=16, dropout=0.0)
    cfg.update(kw)
    return ModelConfig(**cfg)


def test_vocab_is_padded_to_128_times_tp():
    assert padded_vocab(257, 1) == 384
    assert padded_vocab(50257, 1) == 50304
    assert padded_vocab(50257, 4) == 50688
    assert GPT(small(), 257).wte.weight.shape == (384, 32)


def test_logits_cover_the_real_vocabulary_and_loss_is_causal():
    torch.manual_seed(0)
    model = GPT(small(), 100).eval()
    ids = torch.randint(0, 100, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 100)
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 100
    # Positions before 10 cannot see the change.
    assert torch.equal(model(changed)[:, :10], logits[:, :10])
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])


def _loss_and_grads(recompute):
    model = GPT(small(recompute=recompute), 100, seed=3).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (3, 16), generator=gen)
    labels = torch.randint(0, 100, (3, 16), generator=gen)
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_gradients(recompute):
    base_loss, base_grads = _loss_and_grads("none")
    loss, grads = _loss_and_grads(recompute)
    torch.testing.assert_close(loss, base_loss, rtol=1e-6, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(
            grad, base_grads[name], rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )


def _hand_count(b, s, layers, h, v):
    """Matmul FLOPs counted layer by layer: 2·m·n·k per (m×k)(k×n), backward twice forward."""
    per_layer = (
        2 * b * s * h * 3 * h  # q, k, v projection
        + 2 * b * s * s * h  # scores q·kᵀ over all heads
        + 2 * b * s * s * h  # scores · v
        + 2 * b * s * h * h  # output projection
        + 2 * b * s * h * 4 * h  # MLP up
        + 2 * b * s * 4 * h * h
    )  # MLP down
    forward = layers * per_layer + 2 * b * s * h * v  # + logits
    return 3 * forward, layers * per_layer


def test_flop_count_matches_a_hand_count():
    b, s, layers, h, v = 8, 128, 4, 128, 384
    total, layer_forward = _hand_count(b, s, layers, h, v)
    gpt2, shape = families.get("gpt2"), families.Shape(layers, h, 1, s, v)
    assert gpt2.step_flops(b, shape, "none") == pytest.approx(total, rel=1e-12)
    # Full recomputation runs every layer's forward once more, not the logits.
    assert gpt2.step_flops(b, shape, "full") == pytest.approx(total + layer_forward, rel=1e-12)
    assert gpt2.step_flops(b, shape, "selective") == pytest.approx(
        total + layers * 4 * b * s * s * h, rel=1e-12
    )


def test_lr_warmup_cosine_and_linear_scaling():
    cfg = load_config(
        overrides=["train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=10", "train.steps=110"]
    ).train
    assert lr_at(0, cfg, 32) == pytest.approx(1e-4)
    assert lr_at(9, cfg, 32) == pytest.approx(1e-3)
    assert lr_at(60, cfg, 32) == pytest.approx(1e-4 + 0.5 * 9e-4)
    assert lr_at(110, cfg, 32) == pytest.approx(1e-4)
    cfg.lr_scaling, cfg.lr_reference_batch = "linear", 64
    assert lr_at(9, cfg, 256) == pytest.approx(4e-3)
    assert lr_at(110, cfg, 256) == pytest.approx(4e-4)


def test_config_overrides_presets_and_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: gpt2-124m\n  n_layer: 2\ntrain:\n  lr: 1.0e-3\n")
    cfg = load_config(
        path, ["train.steps=7", "parallel.sequence_parallel=true", "model.vocab_size=null"]
    )
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.seq_len) == (2, 768, 1024)
    assert cfg.train.steps == 7 and cfg.parallel.sequence_parallel is True
    for override, words in [
        ("train.stepz=1", "unknown key train.stepz"),
        ("train.steps=abc", "train.steps must be int"),
        ("model.n_head=5", "not divisible by model.n_head"),
        ("train.precision=fp8", "precision must be one of"),
        ("parallel.tp=8", "n_head 4 is not divisible by parallel.tp 8"),
        ("oops", "--set expects section.key=value"),
    ]:
        with pytest.raises(UserError, match=words):
            load_config(None, [override])


@pytest.mark.slow
def test_hf_conversion_matches_transformers(tmp_path):
    import transformers
    from safetensors.torch import load_file

    hf_cfg = transformers.GPT2Config(
        vocab_size=300,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(hf_cfg).eval()
    # Random biases and LayerNorm parameters too, so every tensor's mapping is exercised.
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)

    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    ours = GPT(small(n_layer=saved["n_layer"], vocab_size=300), 300)
    from_hf_state(load_file(str(tmp_path / "hf" / "model.safetensors")), ours)
    ours.eval()
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), reference(ids).logits, rtol=1e-5, atol=1e-5)
    # Round trip: ours -> HF -> ours is exact, and HF's own tensors come back bit for bit.
    back = to_hf_state(ours)
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, value in original.items():
        if name.endswith(("attn.bias", "masked_bias")) or name == "lm_head.weight":
            continue
        assert torch.equal(back[name], value), name
    again = GPT(small(), 300)
    from_hf_state(back, again)
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), again.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    # And our config.json loads in transformers with the same shape.
    shape = hf_config(ours.cfg, 300, {"eos_token_id": 0})
    loaded = transformers.GPT2Config(
        **{k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
    )
    assert (loaded.n_layer, loaded.n_embd, loaded.vocab_size) == (2, 32, 300)


def test_init_is_gpt2_style():
    model = GPT(small(n_layer=8, d_model=64, seq_len=16), 1000, seed=0)
    assert model.blocks["0"].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.1)
    scaled = 0.02 / math.sqrt(2 * 8)
    assert model.blocks["0"].mlp.proj.weight.std().item() == pytest.approx(scaled, rel=0.1)
    assert torch.equal(GPT(small(), 100, seed=5).wte.weight, GPT(small(), 100, seed=5).wte.weight)


def test_recompute_replays_in_each_backward_pass_zero_bubble_runs():
    # zb-h1 runs two backward passes over one graph (input gradients, then weights); each
    # recomputes the checkpointed block, entering the recompute context again.
    from torch.utils.checkpoint import checkpoint

    from hpcllm.parallel.random import recompute_context

    x = torch.randn(5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    y = checkpoint(
        lambda a: (a * w).sin(), x, use_reentrant=False, context_fn=recompute_context
    ).sum()
    (gx,) = torch.autograd.grad(y, x, retain_graph=True)
    y.backward(inputs=[w])
    assert torch.allclose(gx, w.detach() * torch.cos(x * w).detach())
    assert torch.allclose(w.grad, x.detach() * torch.cos(x * w).detach())


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_zero_bubble_split_backward_gives_the_plain_gradients(recompute):
    # B parks the linear layers' weight GEMMs and W runs them: together they must give what
    # one backward gives, with recomputation rebuilding the deferrable layers.
    import types

    from hpcllm.config import ModelConfig
    from hpcllm.model.stages import build_chunks
    from hpcllm.parallel.data.engine import Engine
    from hpcllm.train.stage_work import ChunkWork

    cfg = ModelConfig(preset=None, n_layer=2, n_head=2, d_model=32, seq_len=16, recompute=recompute)
    gen = torch.Generator().manual_seed(0)
    batches = [
        tuple(torch.randint(0, 100, (2, 16), generator=gen) for _ in range(2)) for _ in range(2)
    ]
    reference = GPT(cfg, 100, seed=3)
    for ids, labels in batches:
        (reference(ids, labels) / len(batches)).backward()
    chunks = build_chunks(
        cfg, 100, p=1, rank=0, v=1, tp_group=None, seed=3, sequence_parallel=False
    )
    grid = types.SimpleNamespace(tp=1, pp=1, dp=1)
    work = ChunkWork(chunks, Engine(grid), batches, split_backward=True)
    for micro in range(len(batches)):
        work.forward(0, micro, None)
        assert work.backward(0, micro, None, weights=False) is None
        # B left every linear weight's gradient for W.
        assert chunks[0].blocks["0"].mlp.fc.weight.grad is None or micro > 0
        work.backward_weight(0, micro)
    expected = dict(reference.named_parameters())
    for name, param in chunks[0].named_parameters():
        assert torch.allclose(param.grad, expected[name].grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "preset"), [("gpt2", "tiny"), ("llama", "llama-tiny")])
def test_cached_generation_gives_the_uncached_tokens(arch, preset):
    from hpcllm.model import build
    from hpcllm.model.decoder import KVCache

    cfg = load_config(None, [f"model.arch={arch}", f"model.preset={preset}", "model.dropout=0"])

    def build_varied(model_cfg):
        # Weights far from the init's, so that greedy sampling does not settle on one token.
        model = build(model_cfg, 300).eval()
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)
        return model

    model = build_varied(cfg.model)
    assert cfg.model.seq_len == 128
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    cached = model.generate(ids, 100, temperature=0, kv_cache=True)
    assert torch.equal(cached, model.generate(ids, 100, temperature=0, kv_cache=False))
    assert cached.shape == (1, 120) and len(set(cached[0, 20:].tolist())) > 10  # not one token
    # Past seq_len the window slides as without the cache, which is rebuilt from it.
    cfg.model.seq_len = 32
    short = build_varied(cfg.model)
    assert torch.equal(
        short.generate(ids, 40, temperature=0, kv_cache=True),
        short.generate(ids, 40, temperature=0, kv_cache=False),
    )
    # The cache holds each block's key/value heads once (GQA: the shared ones).
    cache = KVCache(cfg.model.n_layer, 128)
    logits = model.decode(ids, cache)
    kv = families.shape(cfg.model, 300).kv_heads or cfg.model.n_head
    head_dim = cfg.model.d_model // cfg.model.n_head
    assert cache.layers[0].keys.shape == (1, kv, 20, head_dim) and cache.length == 20
    torch.testing.assert_close(logits[:, -1], model(ids)[:, -1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one new token at a time"):
        model.decode(ids[:, :2], cache)


@pytest.mark.parametrize(("arch", "preset"), [("gpt2", "tiny"), ("llama", "llama-tiny")])
def test_explicit_positions_0_to_s_equal_the_default(arch, preset):
    """positions = arange(s), (s,) or per sequence (b, s), is what None means: the same logits,
    bitwise; other positions are other logits (learned or rotary)."""
    from hpcllm.model import build

    cfg = load_config(None, [f"model.arch={arch}", f"model.preset={preset}", "model.dropout=0"])
    model = build(cfg.model, 300).eval()
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    default = model(ids)
    assert torch.equal(model(ids, positions=torch.arange(20)), default)
    assert torch.equal(model(ids, positions=torch.arange(20).expand(2, 20)), default)
    restarted = torch.stack([torch.arange(20), torch.arange(20) % 7])  # documents of 7 in row 1
    packed = model(ids, positions=restarted)
    assert torch.equal(packed[0], default[0]) and not torch.allclose(packed[1], default[1])


@pytest.mark.slow
def test_bench_generate_checks_the_tokens_and_times_both(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "generate.json"
    done = subprocess.run(
        [sys.executable, "-m", "hpcllm", "bench", "generate", "--prompt", "4", "--tokens", "8",
         "--repeats", "2", "--seq-len", "16", "--json-out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [r["model"] for r in result["rows"]] == ["tiny", "llama-tiny"]
    for row in result["rows"]:
        assert row["same_tokens"] and len(row["cached_runs_s"]) == len(row["uncached_runs_s"]) == 2
        assert row["speedup"] == row["uncached_s"] / row["cached_s"]
    assert "| llama-tiny | 4 | 128 |" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "hpcllm", "bench", "generate", "--models", "gpt5"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and "gpt5 is no family's preset" in bad.stderr
    assert result["device"] == "cpu" and "on cpu," in done.stdout  # --device cpu, the default
    device = "cuda" if not torch.cuda.is_available() else "mps"
    wrong = subprocess.run(
        [sys.executable, "-m", "hpcllm", "bench", "generate", "--device", device],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = wrong.stderr.strip().splitlines()
    assert wrong.returncode == 2 and len(lines) == 1 and f"--device {device}:" in lines[0]
    assert ("torch sees no GPU here" if device == "cuda" else "cpu or cuda") in lines[0]
    from hpcllm.bench import generate

    with pytest.raises(UserError, match="--device tpu: Expected one of cpu"):
        generate.run(["tiny"], 2, 2, 16, 1, 1, device="tpu")
