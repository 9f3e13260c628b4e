"""Hugging Face in and out: LlamaForCausalLM through `hpcllm convert` both ways (either rope
form, tied or not, one file or shards, fp32 or bf16), MixtralForCausalLM (the hub's
per-expert tensors and transformers' stacked ones, trained at ep = 2 and exported), tokenizer
folders with their own BOS and EOS (Llama 3's, Mistral's) through prepare, convert and
generate, and runs without a tokenizer (exported back, sampled from ids). Every reference is
transformers' own model, run here."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from datasets_fixtures import full_stream, split_docs
from family_runs import cli
from mpirun import REPO

import hpcllm
from hpcllm.convert import from_hf, to_hf
from hpcllm.datasets.shards import load_manifest
from hpcllm.datasets.tokenizer import load_tokenizer
from hpcllm.errors import UserError

transformers = pytest.importorskip("transformers")

VOCAB = 300
ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def perturbed_and_saved(model: torch.nn.Module, folder, **save) -> torch.nn.Module:
    """Return ``model`` with its weights moved off the init's (larger, so that logits are far
    from 0; the norms off 1), saved into ``folder`` by save_pretrained."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.3 if "norm" in name else 0.05))
    model.save_pretrained(folder, **save)
    return model


def hf_llama(folder, *, tied: bool = False, **save) -> torch.nn.Module:
    """Save a random tiny LlamaForCausalLM (GQA, Llama 3.1 rope scaling, norm weights moved off
    1) into ``folder``; return it in eval mode."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rope_scaling=dict(ROPE_SCALING),
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(1 if tied else 0)
    model = transformers.LlamaForCausalLM(config).eval()
    return perturbed_and_saved(model, folder, **save)


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def assert_same_logits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """fp32: the largest difference within 1e-5 of the largest logit."""
    scale = theirs.abs().max().item()
    assert scale > 1.0  # logits that could differ
    assert (ours - theirs).abs().max().item() <= 1e-5 * scale


IDS = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))


def assert_the_stacked_form_reads_alike(reference, tmp_path, expected: torch.Tensor) -> None:
    """Save ``reference``'s state dict as is (transformers 5's stacked experts: gate_up_proj,
    down_proj) beside tmp_path/hf's config.json; imported, it gives ``expected``."""
    from safetensors.torch import save_file

    stacked = tmp_path / "stacked"
    stacked.mkdir()
    state = reference.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items()}, str(stacked / "model.safetensors"))
    (stacked / "config.json").write_bytes((tmp_path / "hf" / "config.json").read_bytes())
    from_hf(stacked, tmp_path / "run-stacked")
    assert_same_logits(logits(hpcllm.load_model(tmp_path / "run-stacked"), IDS), expected)


def assert_greedy_tokens_as_transformers(run, reference) -> None:
    """``hpcllm generate`` at temperature 0 (the KV cache) gives ``reference``'s greedy tokens."""
    out = cli("generate", "--checkpoint", str(run), "--prompt-ids", "5,6,7",
              "--tokens", "8", "--temperature", "0", check=True).stdout  # fmt: skip
    greedy = reference.generate(
        torch.tensor([[5, 6, 7]]), max_new_tokens=8, do_sample=False, eos_token_id=2
    )
    assert out.strip() == ",".join(map(str, greedy[0].tolist()))


def rewrite_rope(folder, form: str) -> None:
    """Rewrite config.json's rotary settings in ``form``: "parameters" (transformers 5's
    rope_parameters) or "theta+scaling" (transformers 4's and the hub's Llama 3.1 files)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    params = config.pop("rope_parameters", None) or {
        **(config.pop("rope_scaling", None) or {"rope_type": "default"}),
        "rope_theta": config.get("rope_theta", 10000.0),
    }
    config.pop("rope_theta", None)
    config.pop("rope_scaling", None)
    if form == "parameters":
        config["rope_parameters"] = params
    else:
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = params if params.get("rope_type") != "default" else None
    path.write_text(json.dumps(config, indent=2))


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_imports_and_exports_with_transformers_logits(tmp_path, tied):
    reference = hf_llama(tmp_path / "hf", tied=tied)
    expected = logits(reference, IDS)
    cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), check=True)
    model = hpcllm.load_model(tmp_path / "run")
    assert model.cfg.arch == "llama" and model.cfg.tie_embeddings is tied
    assert model.cfg.n_kv_heads == 2 and model.cfg.rope_scaling == 4.0
    assert_same_logits(logits(model, IDS), expected)
    # The other form of the rope settings reads the same.
    for form in ("theta+scaling", "parameters"):
        rewrite_rope(tmp_path / "hf", form)
        from_hf(tmp_path / "hf", tmp_path / f"run-{form}")
        assert_same_logits(logits(hpcllm.load_model(tmp_path / f"run-{form}"), IDS), expected)
    # Out again: transformers reads the folder and gives the same logits.
    cli("convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out"),
        check=True)  # fmt: skip
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["rope_theta"] == 10000.0 and written["rope_scaling"]["rope_type"] == "llama3"
    assert (written["bos_token_id"], written["eos_token_id"]) == (1, 2)  # kept from the import
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_same_logits(logits(again, IDS), expected)
    assert ("lm_head.weight" in again.state_dict()) and (
        again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    ) is tied


def hf_mixtral(folder) -> torch.nn.Module:
    """Save a random tiny MixtralForCausalLM (4 experts, top-2, GQA) into ``folder`` in the
    hub's form (each expert's w1, w2, w3 apart); return it in eval mode."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(2)
    model = transformers.MixtralForCausalLM(config).eval()
    return perturbed_and_saved(model, folder)


@pytest.mark.slow
def test_mixtral_imports_in_either_form_exports_and_generates_as_transformers(tmp_path):
    from safetensors import safe_open

    reference = hf_mixtral(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in f.keys()  # the hub's form
    expected = logits(reference, IDS)
    cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), check=True)
    model = hpcllm.load_model(tmp_path / "run")
    assert (model.cfg.arch, model.cfg.moe_experts, model.cfg.moe_top_k) == ("llama", 4, 2)
    assert model.cfg.moe_router == "topk-softmax" and model.cfg.moe_ffn_size == 48
    assert_same_logits(logits(model, IDS), expected)
    # transformers 5's stacked form (gate_up_proj, down_proj, mlp.gate), as a file saved from
    # its state dict holds it: the same model.
    assert_the_stacked_form_reads_alike(reference, tmp_path, expected)
    # Out: a MixtralForCausalLM in the hub's form, which transformers reads back.
    cli("convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out"),
        check=True)  # fmt: skip
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == "mixtral" and written["num_local_experts"] == 4
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_same_logits(logits(again, IDS), expected)
    # Greedy generation with the KV cache: transformers' tokens.
    assert_greedy_tokens_as_transformers(tmp_path / "run", reference)


@pytest.mark.slow
def test_mixtral_forms_hpcllm_cannot_hold_are_one_line(tmp_path):
    from hpcllm import families
    from hpcllm.config import load_config

    hf_mixtral(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    written = json.loads(path.read_text())
    for key, value, says in (
        ("sliding_window", 16, "sliding_window 16 (sliding-window attention) is not supported"),
        ("router_jitter_noise", 0.1, "router_jitter_noise 0.1 (router noise) is not supported"),
    ):
        path.write_text(json.dumps({**written, key: value}))
        with pytest.raises(UserError, match=re.escape(says)):
            from_hf(tmp_path / "hf", tmp_path / f"run-{key}")
        assert not (tmp_path / f"run-{key}").exists()
    # Out: an MoE Llama that is no Mixtral is refused in one line naming why.
    llama = families.get("llama")
    base = ["model.arch=llama", "model.preset=llama-tiny", "model.moe_experts=4",
            "model.moe_router=topk-softmax"]  # fmt: skip

    def config(*sets: str) -> dict:
        return llama.hf_config(load_config(None, [*base, *sets]).model, VOCAB, {})

    assert config()["model_type"] == "mixtral"
    for sets, says in (
        # A shared expert makes it a Qwen2-MoE, whose shared expert has a gate.
        (["model.moe_shared_ffn_size=32"], "Qwen2-MoE's blocks have a shared expert with a"),
        (["model.moe_first_dense=1"], "keeps blocks [0] dense"),
        (["model.moe_router=sigmoid"], "MixtralForCausalLM's router is a softmax"),
        (["model.moe_router=softmax-topk"], "model.moe_renormalize: true"),
    ):
        with pytest.raises(UserError, match=re.escape(says)):
            config(*sets)
    # GPT2LMHeadModel has no experts: refused, and an export never drops a tensor it cannot name.
    from hpcllm.convert import to_hf_state
    from hpcllm.model import build

    gpt2 = load_config(None, ["model.moe_experts=4"]).model
    with pytest.raises(UserError, match="GPT2LMHeadModel has no mixture of experts"):
        families.get("gpt2").hf_config(gpt2, VOCAB, {})
    with pytest.raises(UserError, match=r"blocks\.0\.mlp\.router\.weight has no Hugging Face"):
        to_hf_state(build(gpt2, VOCAB))
    # A Mixtral config.json silent on rotary base and norm epsilon means Mixtral's defaults.
    silent = {k: v for k, v in written.items() if k not in ("rope_theta", "rms_norm_eps")}
    silent.pop("rope_parameters", None)
    keys = llama.model_keys_of_hf(silent, "config.json")
    assert (keys["rope_theta"], keys["layer_norm_eps"]) == (1e6, 1e-5)


def hf_qwen(kind: str, folder) -> torch.nn.Module:
    """Save a random tiny Qwen causal model of ``kind`` (config.json's model_type) into
    ``folder`` as save_pretrained writes it; return it in eval mode. Qwen2's have q/k/v
    biases, Qwen3's q/k norms and heads of 24 or 32 over a hidden size of 64; the MoE ones 4
    experts of 48, 2 per token; Qwen2-MoE's a gated shared expert, block 1 dense
    (mlp_only_layers) and top-k weights not renormalised, Qwen3-MoE's renormalised."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)  # fmt: skip
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
    config = {
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common,
            **moe,
            shared_expert_intermediate_size=40,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),  # fmt: skip
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, **moe, head_dim=24, norm_topk_prob=True
        ),
    }[kind]()
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return perturbed_and_saved(model, folder)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_qwen_models_import_in_either_form_export_and_generate_as_transformers(tmp_path, kind):
    from safetensors import safe_open

    reference = hf_qwen(kind, tmp_path / "hf")
    expected = logits(reference, IDS)
    from_hf(tmp_path / "hf", tmp_path / "run")
    model = hpcllm.load_model(tmp_path / "run")
    cfg = model.cfg
    assert (bool(cfg.qkv_bias), bool(cfg.qk_norm)) == (
        kind.startswith("qwen2"),
        kind.startswith("qwen3"),
    )  # noqa: E501
    assert cfg.head_dim == {"qwen3": 32, "qwen3_moe": 24}.get(kind)  # null: 64 / 4
    assert_same_logits(logits(model, IDS), expected)
    if kind.endswith("_moe"):
        assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_ffn_size) == (4, 2, 48)
        assert cfg.moe_renormalize is (kind == "qwen3_moe")
        if kind == "qwen2_moe":
            assert (cfg.moe_dense_layers, cfg.moe_shared_ffn_size, cfg.moe_shared_gate) == (
                [1], 40, True
            )  # fmt: skip
        with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
            assert "model.layers.0.mlp.experts.3.down_proj.weight" in f.keys()  # the hub's form
        # transformers 5's stacked form, as a file saved from its state dict holds it.
        assert_the_stacked_form_reads_alike(reference, tmp_path, expected)
    # Out as the same kind, which transformers reads back.
    to_hf(tmp_path / "run", tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == kind
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(reference)
    assert_same_logits(logits(again, IDS), expected)
    if kind.endswith("_moe"):  # greedy generation with the KV cache: transformers' tokens
        assert_greedy_tokens_as_transformers(tmp_path / "run", reference)


@pytest.mark.slow
def test_qwen_forms_hpcllm_cannot_hold_are_one_line(tmp_path):
    from hpcllm import families
    from hpcllm.config import load_config

    for kind, change, says in (
        ("qwen3", {"attention_bias": True}, "attention_bias true (biases on q, k, v and o)"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window true (sliding-window"),
        ("qwen3_moe", {"num_experts": 8}, "gives num_experts 8 but model.layers.0.mlp.gate"),
        ("qwen3_moe", {"head_dim": 16}, "gives head_dim 16 but .*q_proj.weight has 96 rows"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 32},
         "gives shared_expert_intermediate_size 32 but .*shared_expert.gate_proj.weight has 40"),
    ):  # fmt: skip
        folder = tmp_path / kind
        if not folder.exists():
            hf_qwen(kind, folder)
        path = folder / "config.json"
        written = json.loads(path.read_text())
        path.write_text(json.dumps({**written, **change}))
        with pytest.raises(UserError, match=says.replace("(", r"\(").replace(")", r"\)")) as err:
            from_hf(folder, tmp_path / "run")
        assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
        path.write_text(json.dumps(written))
    # A config.json silent on key/value heads means its kind's default, as transformers reads
    # it: Qwen3-MoE's 4 (so this one, of 2, is refused), Llama's one per query head.
    llama = families.get("llama")
    written = json.loads((tmp_path / "qwen3_moe" / "config.json").read_text())
    silent = {k: v for k, v in written.items() if k != "num_key_value_heads"}
    assert llama.model_keys_of_hf(silent, "config.json")["n_kv_heads"] == 4
    (tmp_path / "qwen3_moe" / "config.json").write_text(json.dumps(silent))
    with pytest.raises(UserError, match=r"gives no num_key_value_heads \(so 4, as transformers"):
        from_hf(tmp_path / "qwen3_moe", tmp_path / "run")
    silent["model_type"] = "llama"
    assert llama.model_keys_of_hf(silent, "config.json")["n_kv_heads"] == 4  # 4 query heads
    # Out: a model no Hugging Face model is, refused in one line naming why.
    base = ["model.arch=llama", "model.preset=llama-tiny"]

    def config(*sets: str) -> dict:
        return llama.hf_config(load_config(None, [*base, *sets]).model, VOCAB, {})

    assert config("model.qkv_bias=true")["model_type"] == "qwen2"
    assert config("model.qk_norm=true", "model.head_dim=16")["head_dim"] == 16
    moe = ["model.moe_experts=4", "model.moe_renormalize=true"]
    assert config(*moe, "model.qk_norm=true")["model_type"] == "qwen3_moe"
    shared = ["model.moe_shared_ffn_size=32", "model.moe_shared_gate=true"]
    assert config(*moe, *shared, "model.moe_every=2")["mlp_only_layers"] == []
    assert config(*moe, *shared, "model.moe_first_dense=2")["mlp_only_layers"] == [0, 1]
    for sets, says in (
        (["model.qkv_bias=true", "model.qk_norm=true"], "puts a bias on o_proj too"),
        ([*moe, "model.qkv_bias=true"], "Qwen2-MoE's blocks have a shared expert with a sigmoid"),
        ([*moe, "model.qk_norm=true", *shared], "Qwen3-MoE has no shared expert"),
        ([*moe, "model.qk_norm=true", "model.moe_router=sigmoid"], "router is a softmax"),
    ):
        with pytest.raises(UserError, match=re.escape(says)):
            config(*sets)


@pytest.mark.slow
def test_the_qwen3_moe_tiny_preset_trains_and_goes_out_as_a_qwen3_moe(tmp_path):
    run = tmp_path / "run"
    cli("train", "--no-progress", "--set", "model.arch=llama", "--set",
        "model.preset=qwen3-moe-tiny", "--set", "data.synthetic=true", "--set", "train.steps=2",
        "--set", f"run.dir={run}", "--set", "train.eval_interval=0", "--set",
        "run.tensorboard=false", check=True)  # fmt: skip
    model = hpcllm.load_model(run)
    assert (model.cfg.head_dim, model.cfg.qk_norm, model.cfg.moe_experts) == (24, True, 4)
    to_hf(run, tmp_path / "out")
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    expected = logits(model, ids)
    scale = expected.abs().max().item()
    assert (logits(again, ids) - expected).abs().max().item() <= 1e-5 * scale


@pytest.mark.slow
def test_the_mixtral_tiny_preset_trains_and_goes_out_as_a_mixtral(tmp_path):
    run = tmp_path / "run"
    cli("train", "--no-progress", "--set", "model.arch=llama", "--set", "model.preset=mixtral-tiny",
        "--set", "data.synthetic=true", "--set", "train.steps=2", "--set", f"run.dir={run}",
        "--set", "train.eval_interval=0", "--set", "run.tensorboard=false", check=True)  # fmt: skip
    model = hpcllm.load_model(run)
    assert (model.cfg.moe_experts, model.cfg.moe_top_k, model.cfg.moe_router) == (
        4, 2, "topk-softmax"
    )  # fmt: skip
    to_hf(run, tmp_path / "out")
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    expected = logits(model, ids)
    scale = expected.abs().max().item()
    assert (logits(again, ids) - expected).abs().max().item() <= 1e-5 * scale


@pytest.mark.mpi
def test_an_imported_mixtral_trained_at_ep2_exports_its_logits(stdlib, tmp_path):
    from mpirun import python, run_mpi

    hf_mixtral(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "run")
    sets = [f"data.path={stdlib}", "model.seq_len=32", "train.steps=2", "parallel.ep=2",
            "train.micro_batch_size=2", "train.eval_interval=0",
            "run.tensorboard=false"]  # fmt: skip
    args = ["train", "--config", str(tmp_path / "run" / "config.yaml"), "--no-progress"]
    for item in sets:
        args += ["--set", item]
    run_mpi(2, python("-m", "hpcllm", *args), timeout=300).check()
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    assert (step / "experts_tp00_pp00_ep01.pt").is_file()  # each ep rank wrote its experts
    model = hpcllm.load_model(tmp_path / "run")
    assert model.checkpoint_step == 2
    to_hf(tmp_path / "run", tmp_path / "out")
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = IDS[:, :32]  # it trained at 32 tokens
    assert_same_logits(logits(again, ids), logits(model, ids))
    # And evaluate reads it as any run: a finite loss on the corpus.
    done = cli("evaluate", "--checkpoint", str(tmp_path / "run"), "--data", str(stdlib),
               check=True)  # fmt: skip
    assert "loss" in done.stdout and "nan" not in done.stdout.lower()


@pytest.mark.slow
def test_sharded_safetensors_in_and_out_and_bf16(tmp_path):
    reference = hf_llama(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    expected = logits(reference, IDS)
    from_hf(tmp_path / "hf", tmp_path / "run")
    assert_same_logits(logits(hpcllm.load_model(tmp_path / "run"), IDS), expected)
    # Out in shards of at most 48 KiB (a larger tensor alone), with an index.
    to_hf(tmp_path / "run", tmp_path / "out", max_shard_bytes=48 * 1024)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (tmp_path / "out" / "model.safetensors").exists()
    assert len(index["weight_map"]) == len(reference.state_dict())
    assert_same_logits(
        logits(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval(), IDS),
        expected,
    )
    # bf16 out: every tensor is the fp32 one rounded.
    cli("convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "bf16"),
        "--dtype", "bfloat16", check=True)  # fmt: skip
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from safetensors.torch import load_file

    to_hf(tmp_path / "run", tmp_path / "fp16", dtype="float16")
    for dtype, folder in [(torch.bfloat16, "bf16"), (torch.float16, "fp16")]:
        half = load_file(str(tmp_path / folder / "model.safetensors"))
        for name, value in reference.state_dict().items():
            assert torch.equal(half[name], value.to(dtype)), (folder, name)


@pytest.mark.slow
def test_imports_refuse_what_the_family_cannot_hold_in_one_line(tmp_path):
    hf_llama(tmp_path / "hf")
    original = (tmp_path / "hf" / "config.json").read_text()
    for change, words in [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not read"),
        ({"attention_bias": True}, "attention_bias true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not silu"),
        ({"head_dim": 32}, "gives head_dim 32 but .*q_proj.weight has 64 rows, 4 heads of 16"),
        ({"intermediate_size": 128}, "gives intermediate_size 128 but .*gate_proj.weight has 96"),
        ({"model_type": "mistral"}, "model_type 'mistral' is not read; hpcllm reads gpt2, llama"),
        ({"num_hidden_layers": None}, "lacks num_hidden_layers"),
    ]:
        config = json.loads(original)
        config.pop("rope_parameters", None)
        config["rope_theta"] = 10000.0
        for key, value in change.items():
            if value is None:
                config.pop(key)
            else:
                config[key] = value
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
        with pytest.raises(UserError, match=words):
            from_hf(tmp_path / "hf", tmp_path / "run")
        assert not (tmp_path / "run").exists()  # nothing half-written
    (tmp_path / "hf" / "config.json").write_text(original)
    (tmp_path / "hf" / "model.safetensors").unlink()
    result = cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "has no model.safetensors" in result.stderr


# --- tokenizers ---------------------------------------------------------------------------


def llama3_tokenizer(folder, texts) -> None:
    """Write a Llama-3-style tokenizer folder: byte-level BPE, <|begin_of_text|> added by the
    post-processor, <|end_of_text|> named as EOS only by tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def mistral_tokenizer(folder, texts) -> None:
    """Write a Mistral-style folder: <s> and </s> as added-token objects, add_bos_token true,
    no post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    token = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {"content": "<s>", **token},
        "eos_token": {"content": "</s>", **token},
        "tokenizer_class": "LlamaTokenizer",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.slow
@pytest.mark.parametrize(
    "style, bos, eos",
    [("llama3", "<|begin_of_text|>", "<|end_of_text|>"), ("mistral", "<s>", "</s>")],
)
def test_prepare_with_a_tokenizer_folder_writes_its_bos_and_eos(tmp_path, style, bos, eos):
    from datasets_fixtures import TEXTS

    make = llama3_tokenizer if style == "llama3" else mistral_tokenizer
    make(tmp_path / "tok", TEXTS)
    tok = load_tokenizer(tmp_path / "tok")
    assert (tok.bos_token, tok.eos_token) == (bos, eos)
    out = tmp_path / "data"
    result = cli("prepare", "--input", *_corpus(tmp_path), "--out", str(out),
                 "--tokenizer", str(tmp_path / "tok"), "--quiet", check=True)  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["bos_id"] == tok.bos_id
    assert manifest["tokenizer"]["eos_id"] == tok.eos_id
    assert (out / "tokenizer_config.json").read_bytes() == (
        tmp_path / "tok" / "tokenizer_config.json"
    ).read_bytes()
    # Every document is BOS, its ids, EOS: the stream is exactly that, in corpus order.
    docs = split_docs(json.loads((tmp_path / "docs.json").read_text()), 0.01)["train"]
    expected = [i for text in docs for i in [tok.bos_id, *tok.encode_batch([text])[0], tok.eos_id]]
    assert full_stream(out).tolist() == expected
    assert np.count_nonzero(full_stream(out) == tok.eos_id) == len(docs)
    # The dump gives the documents back (no BOS in the text).
    dumped = subprocess.run(
        [sys.executable, "-m", "hpcllm", "inspect", str(out), "--dump", "train"],
        capture_output=True,
        cwd=REPO,
        check=True,
    ).stdout
    assert dumped == "".join(text + "\n<|endoftext|>\n" for text in docs).encode()
    assert result.returncode == 0
    # A manifest whose tokenizer_config.json was changed is refused.
    (out / "tokenizer_config.json").write_text("{}")
    with pytest.raises(UserError, match="tokenizer_config.json does not match"):
        load_manifest(out)


def _corpus(tmp_path) -> list[str]:
    from datasets_fixtures import make_corpus

    inputs, docs = make_corpus(tmp_path / "corpus")
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    return inputs


def test_tokenizers_without_a_known_eos_are_one_line(tmp_path):
    from tokenizers import Tokenizer, models

    plain = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    plain.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match="no end-of-text token .*name it as eos_token"):
        load_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(UserError, match="names eos_token '</s>', which the tokenizer lacks"):
        load_tokenizer(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path / "empty")
    # Llama 3's EOS without a config is found by name; no BOS is guessed.
    plain.add_special_tokens(["<|end_of_text|>"])
    plain.save(str(tmp_path / "bare.json"))
    found = load_tokenizer(tmp_path / "bare.json")
    assert found.eos_token == "<|end_of_text|>" and found.bos_id is None


@pytest.mark.slow
def test_convert_and_generate_take_a_tokenizer_folder_with_its_bos(tmp_path):
    from datasets_fixtures import TEXTS

    llama3_tokenizer(tmp_path / "tok", TEXTS)
    tok = load_tokenizer(tmp_path / "tok")
    reference = hf_llama(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).write_bytes((tmp_path / "tok" / name).read_bytes())
    cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), check=True)
    assert (tmp_path / "run" / "tokenizer_config.json").is_file()
    prompt = "def f(x):"
    text = cli("generate", "--checkpoint", str(tmp_path / "run"), "--prompt", prompt,
               "--tokens", "6", "--temperature", "0", check=True).stdout  # fmt: skip
    # transformers' greedy continuation of BOS + the prompt's ids, decoded.
    ids = torch.tensor([[tok.bos_id, *tok.encode_batch([prompt])[0]]])
    greedy = reference.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_id)
    new = greedy[0, ids.shape[1] :].tolist()
    new = new[: new.index(tok.eos_id)] if tok.eos_id in new else new
    assert text == prompt + tok.decode(new) + "\n"
    # The export carries the tokenizer, which transformers loads with the same BOS and EOS.
    to_hf(tmp_path / "run", tmp_path / "out")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert (loaded.bos_token, loaded.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert loaded("def")["input_ids"][0] == tok.bos_id
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_id, tok.eos_id)
    # An imported list of EOS ids that holds the tokenizer's (Llama 3 Instruct's) is kept.
    imported = json.loads((tmp_path / "run" / "hf_config.json").read_text())
    imported.update(bos_token_id=tok.bos_id, eos_token_id=[tok.eos_id, tok.eos_id + 1])
    (tmp_path / "run" / "hf_config.json").write_text(json.dumps(imported))
    to_hf(tmp_path / "run", tmp_path / "instruct")
    config = json.loads((tmp_path / "instruct" / "config.json").read_text())
    assert config["eos_token_id"] == [tok.eos_id, tok.eos_id + 1]


@pytest.mark.slow
def test_a_gpt2_import_without_a_tokenizer_exports_back_and_samples_ids(tmp_path):
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, eos_token_id=7
    )
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    cli("convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), check=True)
    assert not (tmp_path / "run" / "tokenizer.json").exists()
    cli("convert", "--checkpoint", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out"),
        check=True)  # fmt: skip
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    ids = IDS[:, :32]
    torch.testing.assert_close(logits(again, ids), logits(reference, ids), rtol=0, atol=0)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 7
    out = cli("generate", "--checkpoint", str(tmp_path / "run"), "--prompt-ids", "1,2,3",
              "--tokens", "8", "--temperature", "0", check=True).stdout  # fmt: skip
    greedy = reference.generate(
        torch.tensor([[1, 2, 3]]), max_new_tokens=8, do_sample=False, eos_token_id=7
    )
    assert out.strip() == ",".join(map(str, greedy[0].tolist()))
    # GPT-2's positions are weights: it cannot train at another length.
    result = cli("train", "--config", str(tmp_path / "run" / "config.yaml"),
                 "--set", "model.seq_len=16", "--set", "data.synthetic=true")  # fmt: skip
    assert result.returncode == 2 and "seq_len 32 vs 16" in result.stderr
    # Text needs a tokenizer: one line saying how to get on without one.
    result = cli("generate", "--checkpoint", str(tmp_path / "run"), "--prompt", "x")
    assert result.returncode == 2 and "--prompt-ids" in result.stderr
    bad = cli("generate", "--checkpoint", str(tmp_path / "run"), "--prompt-ids", "1,300")
    assert bad.returncode == 2 and "ids from 0 to 299" in bad.stderr


@pytest.mark.slow
def test_an_imported_llama_trains_at_a_shorter_length(stdlib, tmp_path):
    # Rotary positions hold no weights: an import (which has read no data) may train at
    # another seq_len than its max_position_embeddings; GPT-2's learned positions may not.
    hf_llama(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "run")
    result = cli("train", "--config", str(tmp_path / "run" / "config.yaml"), "--no-progress",
                 "--set", f"data.path={stdlib}", "--set", "model.seq_len=32",
                 "--set", "train.steps=2", "--set", "train.micro_batch_size=2",
                 "--set", "train.eval_interval=0", "--set", "run.tensorboard=false",
                 check=True)  # fmt: skip
    assert "resumes from step 0" in result.stdout
    assert hpcllm.load_model(tmp_path / "run").cfg.seq_len == 32
    # Trained shorter: the export states the imported context, not the trained length.
    to_hf(tmp_path / "run", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())[CONTEXT] == 64


@pytest.mark.slow
def test_an_import_holds_one_source_tensor_at_a_time(tmp_path, monkeypatch):
    # A bf16 checkpoint comes in a tensor at a time: each is converted to the fp32 training
    # copy and dropped before the next is read, so the import never holds the source whole.
    import gc
    import weakref

    from hpcllm import convert

    reference = hf_llama(tmp_path / "hf-32")
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    alive: list[weakref.ref] = []
    most = []
    read = convert.HFWeights.get

    def get(self, name):
        gc.collect()
        most.append(sum(ref() is not None for ref in alive))
        tensor = read(self, name)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(convert.HFWeights, "get", get)
    from_hf(tmp_path / "hf", tmp_path / "run")
    assert len(most) == len(reference.state_dict()) and max(most) == 0
    # And the bf16 values came in exactly (bf16 → fp32 is exact).
    model = hpcllm.load_model(tmp_path / "run")
    assert torch.equal(
        model.blocks["1"].mlp.proj.weight,
        reference.model.layers[1].mlp.down_proj.weight.float(),
    )


def test_from_hf_of_a_missing_folder_or_a_file_says_which_in_one_line(tmp_path, capsys):
    from hpcllm.cli import main

    config = tmp_path / "config.json"
    config.write_text("{}")
    cases = {
        tmp_path / "nowhere": "nowhere does not exist (--from-hf takes a save_pretrained folder)",
        config: "config.json is a file; --from-hf takes the save_pretrained folder that holds",
        tmp_path: "has no config.json (a save_pretrained folder has one)",
    }
    config_dir = tmp_path / "empty"
    config_dir.mkdir()
    cases[config_dir] = cases.pop(tmp_path)
    for given, says in cases.items():
        assert main(["convert", "--from-hf", str(given), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        assert not (tmp_path / "out").exists()


# --- config.json against the tensors, the imported length, evaluate's length ---------------

CONTEXT = "max_position_embeddings"


def tiny_hf_folder(folder, arch: str = "llama", **keys) -> dict:
    """Write a random tiny Hugging Face folder of ``arch`` (2 layers, 4 heads, width 64, 64
    positions; Llama with 2 kv heads and an MLP of 96) through our own export, without
    transformers; return its config.json."""
    from safetensors.torch import save_file

    from hpcllm import families
    from hpcllm.config import model_config
    from hpcllm.convert import to_hf_state
    from hpcllm.model import build

    sizes = {"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64, "vocab_size": VOCAB}
    if arch == "llama":
        sizes.update(n_kv_heads=2, ffn_size=96)
    cfg = model_config(arch, preset=None, **{**sizes, **keys})
    folder.mkdir(parents=True)
    save_file(to_hf_state(build(cfg, VOCAB)), str(folder / "model.safetensors"))
    config = families.get(arch).hf_config(cfg, VOCAB, {})
    (folder / "config.json").write_text(json.dumps(config))
    return config


def convert_says(capsys, *args: str) -> tuple[int, list[str], list[str]]:
    """Run ``hpcllm convert ARGS`` in this process; return (exit code, stdout, stderr lines)."""
    from hpcllm.cli import main

    code = main(["convert", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_a_config_json_its_tensors_contradict_names_the_key_to_set(tmp_path, capsys):
    llama = tiny_hf_folder(tmp_path / "llama")
    gpt2 = tiny_hf_folder(tmp_path / "gpt2", "gpt2")
    k = "model.layers.0.self_attn.k_proj.weight"
    for folder, original, change, says in [
        # transformers takes an absent num_key_value_heads for as many as the query heads.
        ("llama", llama, {"num_key_value_heads": None},
         f"gives no num_key_value_heads (so 4, as transformers assumes) but {k} has 32 rows, "
         "2 heads of 16; set num_key_value_heads: 2"),
        ("llama", llama, {"num_key_value_heads": 4},
         f"gives num_key_value_heads 4 but {k} has 32 rows, 2 heads of 16; set "
         "num_key_value_heads: 2"),
        ("llama", llama, {"hidden_size": 128, "head_dim": None},
         "gives hidden_size 128 but model.embed_tokens.weight has 64 columns; set hidden_size: "
         "64"),
        ("llama", llama, {"vocab_size": 256},
         "gives vocab_size 256 but model.embed_tokens.weight has 300 rows; set vocab_size: 300"),
        # Fewer layers than the weights hold would have dropped the last one unsaid.
        ("llama", llama, {"num_hidden_layers": 1},
         "gives num_hidden_layers 1 but the weights hold 2 layers (model.layers.0 to 1); set "
         "num_hidden_layers: 2"),
        ("llama", llama, {"intermediate_size": 128},
         "gives intermediate_size 128 but model.layers.0.mlp.gate_proj.weight has 96 rows; set "
         "intermediate_size: 96"),
        ("gpt2", gpt2, {"n_positions": 32},
         "gives n_positions 32 but transformer.wpe.weight has 64 rows; set n_positions: 64"),
        ("gpt2", gpt2, {"n_layer": 3},
         "gives n_layer 3 but the weights hold 2 layers (transformer.h.0 to 1); set n_layer: 2"),
    ]:  # fmt: skip
        config = {**original, **change}
        config = {key: value for key, value in config.items() if value is not None}
        (tmp_path / folder / "config.json").write_text(json.dumps(config))
        code, out, err = convert_says(capsys, "--from-hf", tmp_path / folder, "--out",
                                      tmp_path / "run")  # fmt: skip
        assert code == 2 and len(err) == 1 and not out, err
        assert err[0] == f"hpcllm: error: {tmp_path / folder / 'config.json'} {says} in config.json"
        assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_imported_rotary_model_trains_at_2048_and_exports_its_context(tmp_path, capsys):
    from hpcllm.families import IMPORTED_SEQ_LEN

    assert IMPORTED_SEQ_LEN == 2048
    config = tiny_hf_folder(tmp_path / "hf")
    # Llama 3.1's context: one sample of it would not fit a small corpus.
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, CONTEXT: 131072}))
    code, out, _ = convert_says(capsys, "--from-hf", tmp_path / "hf", "--out", tmp_path / "run")
    assert code == 0
    assert out == [
        f"wrote {tmp_path / 'run'}: it trains at model.seq_len 2048, not config.json's 131072 "
        "positions (--set model.seq_len=N for another; --to-hf writes 131072 back)"
    ]
    assert hpcllm.load_model(tmp_path / "run").cfg.seq_len == 2048

    def exported(name: str) -> int:
        to_hf(tmp_path / "run", tmp_path / name)
        return json.loads((tmp_path / name / "config.json").read_text())[CONTEXT]

    assert exported("imported") == 131072  # trained at less: the imported context
    imported = json.loads((tmp_path / "run" / "hf_config.json").read_text())
    (tmp_path / "run" / "hf_config.json").write_text(json.dumps({**imported, CONTEXT: 1024}))
    assert exported("longer") == 2048  # trained longer than it came: the trained length
    (tmp_path / "run" / "hf_config.json").unlink()
    assert exported("never-imported") == 2048  # the training seq_len, as ever


@pytest.mark.slow
def test_evaluate_takes_a_seq_len_its_advice_names(tmp_path, capsys):
    from datasets_fixtures import prepare_corpus

    from hpcllm.cli import main

    prepare_corpus(tmp_path / "corpus", tmp_path / "data", tokenizer="byte")
    for arch in ("llama", "gpt2"):  # both 64 positions
        tiny_hf_folder(tmp_path / f"hf-{arch}", arch)
        from_hf(tmp_path / f"hf-{arch}", tmp_path / arch)

    def evaluate(arch: str, *args: str) -> tuple[int, list[str], list[str]]:
        code = main(["evaluate", "--checkpoint", str(tmp_path / arch), "--data",
                     str(tmp_path / "data"), "--split", "train", "--json", *args])  # fmt: skip
        out, err = capsys.readouterr()
        return code, out.splitlines(), err.splitlines()

    for arch, seq_len in [("gpt2", 16), ("llama", 16), ("llama", 128)]:
        code, out, err = evaluate(arch, "--seq-len", str(seq_len), "--micro-batch-size", "2",
                                  "--iters", "2")  # fmt: skip
        assert code == 0, err
        result = json.loads(out[-1])
        assert (result["seq_len"], result["samples"], result["tokens"]) == (seq_len, 4, 4 * seq_len)
        assert 0 < result["loss"] < 100
    # GPT-2's positions are weights: not past them.
    code, _, err = evaluate("gpt2", "--seq-len", "128")
    assert code == 2 and err == [
        "hpcllm: error: --seq-len 128 is longer than the 64 positions the gpt2 model has "
        "weights for (its model.seq_len); give at most 64"
    ]
    # A split too small for one micro-batch: the options that make it fit.
    code, _, err = evaluate("llama", "--seq-len", "100000")
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith(
        "fewer than one micro-batch of 4; give a shorter --seq-len or a smaller "
        "--micro-batch-size, or evaluate on more data"
    )
    # This corpus has no validation split (the default): the option that reads another.
    assert main(["evaluate", "--checkpoint", str(tmp_path / "llama"), "--data",
                 str(tmp_path / "data")]) == 2  # fmt: skip
    assert capsys.readouterr().err.splitlines() == [
        f"hpcllm: error: the val split of {tmp_path / 'data'} is empty; evaluate --split "
        "train, or prepare with a larger --val-fraction"
    ]
