import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets_fixtures import prepare_corpus

from hpcllm import families
from hpcllm.bench.step import plain_optimizer
from hpcllm.cli import main
from hpcllm.config import load_config
from hpcllm.model.plain_gpt2 import PlainGPT2

REPO = Path(__file__).resolve().parents[1]

# The smallest model that still runs every part: one block, 16 tokens.
TINY = [
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=32",
    "model.seq_len=16",
    "train.micro_batch_size=2",
]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-step")
    prepare_corpus(root / "corpus", root / "data", tokenizer="byte")
    return root / "data"


@pytest.mark.slow
def test_cpu_smoke_writes_every_row_to_json(data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # --cpu-smoke sets it; give it back after
    out = tmp_path / "out" / "step.json"
    sets = [arg for key in [*TINY, f"data.path={data}"] for arg in ("--set", key)]
    argv = ["bench", "step", "--cpu-smoke", "--compile", *sets, "--steps", "1", "--rounds", "2"]
    assert main([*argv, "--warmup", "1", "--loop-steps", "3", "--json-out", str(out)]) == 0
    # The command destroyed the process group it started, so no Gloo worker thread outlives
    # it into the interpreter's exit (where one that releases a tensor aborts the rank).
    assert not torch.distributed.is_initialized()
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["precision"] == "fp32"
    assert result["compile"] is True and result["torch"] == torch.__version__
    (shape,) = result["shapes"]
    assert shape["shape"] == "cpu-smoke" and (shape["n_layer"], shape["d_model"]) == (1, 32)
    assert shape["tokens_per_step"] == 2 * 16
    # The smoke shape gives the model 512 ids; the data (bytes + EOS) uses 257 of them.
    assert shape["vocab"] == {"model": 512, "padded": 512, "data": 257, "synthetic": False}
    assert shape["flops_per_step"] > 0 and shape["peak_tflops"] is None
    rows = {r["key"]: r for r in shape["rows"]}
    assert list(rows) == [
        "plain_eager",
        "plain_compile",
        "hpcllm",
        "hpcllm_kernels_off",
        "hpcllm_loop",
    ]
    for r in rows.values():
        for key in (
            "step_ms",
            "cpu_ms",
            "tokens_per_s",
            "tflops",
            "vs_plain_eager",
            "vs_plain_compile",
            "vs_plain_eager_cpu_time",
        ):
            assert math.isfinite(r[key]) and r[key] > 0, (r["key"], key)
        assert r["mfu"] is None
        assert r["tokens_per_s"] == pytest.approx(32 / (r["step_ms"] / 1e3))
        assert r["name"] in table
    assert rows["plain_eager"]["vs_plain_eager"] == rows["plain_compile"]["vs_plain_compile"] == 1.0
    assert len(rows["hpcllm"]["block_ms"]) == 2
    assert rows["plain_eager"]["triton_ops"] is rows["plain_compile"]["triton_ops"] is None
    assert rows["hpcllm"]["triton_ops"] == rows["hpcllm_loop"]["triton_ops"] == []
    assert shape["loop_metrics_tokens_per_s"] > 0 and len(shape["loop_interval_ms"]) == 1
    assert shape["torch_threads"] >= 1 and result["cpu_cores"] >= 1
    assert not list(out.parent.glob(".*partial*"))


@pytest.mark.slow
def test_plain_gpt_counts_nanogpts_parameters_and_starts_uniform():
    vocab, layers, d, seq = 512, 3, 64, 32
    sizes = [
        f"model.n_layer={layers}",
        "model.n_head=4",
        f"model.d_model={d}",
        f"model.seq_len={seq}",
    ]
    model = PlainGPT2(load_config(None, sizes).model, vocab, seed=0)
    # nanoGPT's count with the output layer tied: embeddings, 12d² + 13d per block, final LN.
    expected = vocab * d + seq * d + layers * (12 * d * d + 13 * d) + 2 * d
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.lm_head.weight is model.wte.weight
    ids = torch.randint(0, vocab, (4, seq), generator=torch.Generator().manual_seed(0))
    loss = model(ids, ids.roll(-1, dims=1))
    assert loss.item() == pytest.approx(math.log(vocab), abs=0.1)
    optimizer = plain_optimizer(model, lr=1e-3, weight_decay=0.1)
    decayed, plain = optimizer.param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and decayed["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in plain["params"]) and plain["weight_decay"] == 0.0
    loss.backward()
    optimizer.step()
    assert model(ids, ids.roll(-1, dims=1)).item() < loss.item()


@pytest.mark.slow
def test_cpu_smoke_with_a_llama_model_in_an_empty_folder(tmp_path):
    # --model picks the family (at the smoke size with --cpu-smoke): plain Llama against
    # hpcllm's, on synthetic data, with nothing but the JSON written where it runs.
    import os
    import subprocess
    import sys

    out = tmp_path / "step.json"
    sets = [arg for key in [*TINY, "model.n_kv_heads=1"] for arg in ("--set", key)]
    done = subprocess.run(
        [sys.executable, "-m", "hpcllm", "bench", "step", "--cpu-smoke", "--model", "llama-tiny",
         *sets, "--steps", "1", "--rounds", "2", "--warmup", "1", "--loop-steps", "3",
         "--json-out", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.json"]
    (shape,) = json.loads(out.read_text())["shapes"]
    assert (shape["model"], shape["arch"], shape["n_layer"], shape["d_model"]) == (
        "llama-tiny", "llama", 1, 32
    )  # fmt: skip
    rows = {r["key"]: r for r in shape["rows"]}
    assert {"plain_eager", "hpcllm", "hpcllm_kernels_off", "hpcllm_loop"} <= set(rows)
    assert all(r["step_ms"] > 0 and r["tflops"] > 0 for r in rows.values())
    assert "cpu-smoke (llama-tiny): llama, 1 layers" in done.stdout
    assert "| plain llama eager |" in done.stdout
    assert "| hpcllm step (as configured) |" in done.stdout
    assert shape["baseline"] == "hpcllm.model.plain_llama:PlainLlama"
    assert "baseline: the llama family's plain PyTorch model" in done.stdout


def test_a_family_without_a_plain_model_is_told_so_in_one_line(monkeypatch, capsys):
    # A family registered with no baseline: bench step names it and measures nothing.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # --cpu-smoke sets it; give it back after
    gpt2 = families.get("gpt2")
    bare = dataclasses.replace(
        gpt2, name="bare", reference=None, presets={"bare-tiny": gpt2.presets["tiny"]}
    )
    monkeypatch.setitem(families._REGISTRY, "bare", bare)
    assert main(["bench", "step", "--cpu-smoke", "--model", "bare-tiny"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "model family bare registers no plain PyTorch model" in line


# hpcllm's weight names → the plain model's, by family (the rest are the same).
PLAIN_NAMES = {
    "gpt2": {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
             "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"},
    "llama": {"wte": "embed", "norm_f": "norm", "norm1": "input_norm", "norm2": "post_norm",
              "attn.q": "attn.q_proj", "attn.k": "attn.k_proj", "attn.v": "attn.v_proj",
              "attn.proj": "attn.o_proj", "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj",
              "mlp.proj": "mlp.down_proj"},
}  # fmt: skip


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_a_familys_plain_model_computes_hpcllms(preset):
    # The same function, so the same FLOPs: hpcllm's weights in the plain model its family
    # registers give its loss (GPT-2's tied head; Llama's GQA, scaled rope, untied head).
    from hpcllm.model import build

    arch = families.preset_family(preset)
    cfg = load_config(None, [f"model.arch={arch}", f"model.preset={preset}", "model.dropout=0"])
    ours = build(cfg.model, 512, seed=3).eval()
    plain = families.reference_class(arch)(cfg.model, 512, seed=0).eval()
    names = PLAIN_NAMES[arch]
    state = {}
    for name, value in ours.state_dict().items():
        for a, b in names.items():
            name = name.replace(f".{a}.", f".{b}.") if f".{a}." in name else name
        head = name.split(".")[0]
        state[names.get(head, head) + name[len(head) :]] = value
    missing, unexpected = plain.load_state_dict(state, strict=False)
    # A tied output layer is the embedding: loaded under the embedding's name.
    tied = families.shape(cfg.model, 512).tied
    assert not unexpected and missing == (["lm_head.weight"] if tied else [])
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in ours.parameters())
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids, ids.roll(-1, 1)), ours(ids, ids.roll(-1, 1)))


@pytest.mark.slow
def test_step_levers_times_each_lever_against_the_plain_step_in_its_blocks(tmp_path):
    """scripts/step_levers.py on the CPU: one trainer per set of keys, a switch lever inside
    the trainer of its keys, every lever's ratio to the plain step of its own blocks; an
    unknown lever is refused in one line."""
    out = tmp_path / "levers"
    done = subprocess.run(
        [sys.executable, "scripts/step_levers.py", "--shape", "cpu-smoke",
         "--levers", "configured,eager,eager-kernels-off", "--rounds", "2", "--steps", "1",
         "--out", str(out), *(f"--set={s}" for s in TINY)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads((out / "levers.json").read_text())
    assert list(result["levers"]) == ["plain_eager", "configured", "eager", "eager-kernels-off"]
    for name, row in result["levers"].items():
        assert len(row["blocks_ms"]) == 2 and row["step_ms"] > 0, name
        assert row["vs_plain_compile_same_blocks"] == row["baseline_ms"] / row["step_ms"]
        assert row["tokens_per_s"] == pytest.approx(2 * 16 / (row["step_ms"] / 1e3))
    both = [result["levers"][n]["keys"] for n in ("eager", "eager-kernels-off")]
    assert both == [["model.compile=none"]] * 2  # one trainer, the switch inside it
    assert "| eager-kernels-off |" in done.stdout and (out / "levers.md").exists()
    bad = subprocess.run(
        [sys.executable, "scripts/step_levers.py", "--levers", "configured,warp-drive"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown levers ['warp-drive']" in bad.stderr


def test_gpu_check_runs_parts_under_one_deadline_and_names_what_it_left(tmp_path):
    """scripts/gpu_check.sh: a part it does not know, and parts the deadline leaves no time
    for, are named in the summary; the script itself ends well."""
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(tmp_path), "5", "nosuch,env,tests"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert summary[:3] == [
        "nosuch: no such part",
        "env: not run (deadline)",
        "tests: not run (deadline)",
    ]
    assert summary[3].startswith("done in ")
