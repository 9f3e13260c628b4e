"""``hpcllm convert``: Hugging Face GPT-2 checkpoints in and out (config.json + safetensors).

Hugging Face's GPT-2 stores linear layers as ``Conv1D`` (weight shape in × out, the transpose
of ``nn.Linear``), keeps q|k|v fused in ``c_attn`` in the same order as ours, uses the tanh
GeLU (``gelu_new``) and ties ``lm_head`` to ``wte``. Our embedding is padded to a multiple of
128·t; the padding is dropped on the way out and added (as zeros) on the way in.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from hpcllm.config import Config, ModelConfig
from hpcllm.errors import UserError
from hpcllm.files import honour_umask, new_folder
from hpcllm.model.gpt import GPT

_LAYER = {  # ours -> theirs, inside block i; "T" marks a Conv1D weight (transposed)
    "ln1.weight": ("ln_1.weight", False),
    "ln1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln2.weight": ("ln_2.weight", False),
    "ln2.bias": ("ln_2.bias", False),
    "mlp.fc.weight": ("mlp.c_fc.weight", True),
    "mlp.fc.bias": ("mlp.c_fc.bias", False),
    "mlp.proj.weight": ("mlp.c_proj.weight", True),
    "mlp.proj.bias": ("mlp.c_proj.bias", False),
}


def hf_config(model: ModelConfig, vocab_size: int, eos_id: int | None) -> dict:
    """Return the config.json of a Hugging Face GPT2LMHeadModel with our model's shape."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": model.seq_len,
        "n_ctx": model.seq_len,
        "n_embd": model.d_model,
        "n_layer": model.n_layer,
        "n_head": model.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": model.dropout,
        "embd_pdrop": model.dropout,
        "attn_pdrop": model.dropout,
        "layer_norm_epsilon": model.layer_norm_eps,
        "initializer_range": model.init_std,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
    }


def to_hf_state(model: GPT) -> dict[str, torch.Tensor]:
    """Return the Hugging Face state dict of a (tp = 1) model."""
    ours = model.state_dict()
    out = {
        "transformer.wte.weight": ours["wte.weight"][: model.vocab_size],
        "transformer.wpe.weight": ours["wpe.weight"],
        "transformer.ln_f.weight": ours["ln_f.weight"],
        "transformer.ln_f.bias": ours["ln_f.bias"],
    }
    for i in range(model.cfg.n_layer):
        for name, (theirs, transpose) in _LAYER.items():
            value = ours[f"blocks.{i}.{name}"]
            out[f"transformer.h.{i}.{theirs}"] = value.t() if transpose else value
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_hf_state(state: dict[str, torch.Tensor], model: GPT) -> None:
    """Load a Hugging Face GPT-2 state dict into ``model`` (padding rows set to zero)."""
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    ours: dict[str, torch.Tensor] = {}
    wte = state["wte.weight"]
    padded = torch.zeros(model.padded_vocab, wte.shape[1], dtype=wte.dtype)
    padded[: wte.shape[0]] = wte
    ours["wte.weight"] = padded
    ours["wpe.weight"] = state["wpe.weight"]
    ours["ln_f.weight"], ours["ln_f.bias"] = state["ln_f.weight"], state["ln_f.bias"]
    for i in range(model.cfg.n_layer):
        for name, (theirs, transpose) in _LAYER.items():
            value = state[f"h.{i}.{theirs}"]
            ours[f"blocks.{i}.{name}"] = value.t() if transpose else value
    model.load_state_dict({k: v.float().contiguous() for k, v in ours.items()})


def to_hf(run_dir: Path, out_dir: Path, step: int | None = None) -> Path:
    """Write a run's checkpoint (any layout) as a Hugging Face GPT-2 folder; return it.

    The newest checkpoint that verifies, or the one of ``step``. The folder appears whole or
    not at all, its files with the user's umask.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from hpcllm.generate import load_run_model

    model, tokenizer = load_run_model(run_dir, step=step)
    try:
        with new_folder(out_dir) as partial:
            weights = partial / "model.safetensors"
            save_file(to_hf_state(model), str(weights), metadata={"format": "pt"})
            honour_umask(weights)
            config = hf_config(model.cfg, model.vocab_size, tokenizer.eos_id)
            (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if tokenizer.kind == "hf":
                shutil.copyfile(Path(run_dir) / "tokenizer.json", partial / "tokenizer.json")
    except (OSError, SafetensorError) as err:  # safetensors reports a full disk its own way
        raise UserError(f"writing {out_dir} failed: {err}") from None
    return out_dir


def from_hf(hf_dir: Path, run_dir: Path) -> Path:
    """Make a run folder whose step-0 checkpoint holds a Hugging Face GPT-2; return it.

    Train from it with ``hpcllm train --set run.dir=RUN_DIR`` (it resumes from that step).
    """
    from safetensors.torch import load_file

    config_path = hf_dir / "config.json"
    weights = hf_dir / "model.safetensors"
    if not config_path.is_file() or not weights.is_file():
        raise UserError(
            f"{hf_dir} needs config.json and model.safetensors (a Hugging Face "
            "GPT-2 saved with save_pretrained)"
        )
    hf = json.loads(config_path.read_text())
    if hf.get("model_type") != "gpt2":
        raise UserError(f"{config_path}: model_type {hf.get('model_type')!r} is not gpt2")
    if hf.get("activation_function", "gelu_new") != "gelu_new" or hf.get("n_inner"):
        raise UserError(f"{config_path}: only gelu_new and n_inner = 4*n_embd are supported")
    cfg = Config()
    cfg.model = ModelConfig(
        preset=None,
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        d_model=hf["n_embd"],
        seq_len=hf["n_positions"],
        vocab_size=hf["vocab_size"],
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        init_std=hf.get("initializer_range", 0.02),
    )
    cfg.run.dir = str(run_dir)
    model = GPT(cfg.model, hf["vocab_size"])
    from_hf_state(load_file(str(weights)), model)
    _write_step0(cfg, model, run_dir)
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copy(hf_dir / "tokenizer.json", run_dir / "tokenizer.json")
    return run_dir


def _write_step0(cfg: Config, model: GPT, run_dir: Path) -> None:
    from hpcllm import topology
    from hpcllm.train import checkpoint

    grid = topology.init()
    if grid.world_size != 1:
        raise UserError("hpcllm convert runs as one process, not under mpirun")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.dump(run_dir / "config.yaml")
    import yaml

    checkpoint.save(
        run_dir,
        0,
        grid,
        {"model": model.state_dict()},
        {"consumed_samples": 0, "vocab_size": model.vocab_size},
        yaml.safe_dump(cfg.to_dict(), sort_keys=False),
    )
