"""``hpcllm convert``: Hugging Face checkpoints in and out (config.json + safetensors), for
every family whose spec maps its tensors (:attr:`hpcllm.families.Family.hf_tensors`).

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
from torch import nn

from hpcllm import families
from hpcllm.config import Config, ModelConfig
from hpcllm.errors import UserError
from hpcllm.files import honour_umask, new_folder
from hpcllm.model import build


def _hf_family(cfg: ModelConfig) -> families.Family:
    """Return ``cfg``'s family; a UserError where it has no Hugging Face mapping."""
    family = families.get(cfg.arch)
    if not family.hf_tensors or family.hf_config is None:
        raise UserError(f"model.arch {cfg.arch} has no Hugging Face mapping")
    return family


def _names(family: families.Family, n_layer: int) -> list[tuple[str, str, bool]]:
    """Return (ours, theirs, transpose) for every tensor of an ``n_layer`` model."""
    found = []
    for tensor in family.hf_tensors:
        indices = range(n_layer) if "{i}" in tensor.ours else [None]
        for i in indices:
            found.append((tensor.ours.format(i=i), tensor.theirs.format(i=i), tensor.transpose))
    return found


def to_hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return the Hugging Face state dict of a (tp = 1) model, its vocabulary padding dropped."""
    family = _hf_family(model.cfg)
    ours = model.state_dict()
    out = {}
    for name, theirs, transpose in _names(family, model.cfg.n_layer):
        value = ours[name]
        if family.rule(name).padded:
            value = value[: model.vocab_size]
        out[theirs] = value.t() if transpose else value
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def from_hf_state(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Load a Hugging Face state dict into ``model`` (vocabulary padding rows set to zero)."""
    family = _hf_family(model.cfg)
    ours: dict[str, torch.Tensor] = {}
    for name, theirs, transpose in _names(family, model.cfg.n_layer):
        value = state[theirs]
        value = value.t() if transpose else value
        if family.rule(name).padded:
            padded = torch.zeros(model.padded_vocab, *value.shape[1:], dtype=value.dtype)
            padded[: value.shape[0]] = value
            value = padded
        ours[name] = value
    model.load_state_dict({k: v.float().contiguous() for k, v in ours.items()})


def to_hf(
    run_dir: Path, out_dir: Path, step: int | None = None, allow_unverified: bool = False
) -> Path:
    """Write a run's checkpoint (any layout) as a Hugging Face GPT-2 folder; return it.

    The newest checkpoint that verifies, or the one of ``step``. The folder appears whole or
    not at all, its files with the user's umask.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    from hpcllm.generate import load_run_model

    model, tokenizer = load_run_model(run_dir, step=step, allow_unverified=allow_unverified)
    try:
        with new_folder(out_dir) as partial:
            weights = partial / "model.safetensors"
            save_file(to_hf_state(model), str(weights), metadata={"format": "pt"})
            honour_umask(weights)
            config = _hf_family(model.cfg).hf_config(model.cfg, model.vocab_size, tokenizer.eos_id)
            (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if tokenizer.kind == "hf":
                shutil.copyfile(Path(run_dir) / "tokenizer.json", partial / "tokenizer.json")
    except (OSError, SafetensorError) as err:  # safetensors reports a full disk its own way
        raise UserError(f"writing {out_dir} failed: {err}") from None
    return out_dir


def from_hf(hf_dir: Path, run_dir: Path) -> Path:
    """Make a run folder whose step-0 checkpoint holds a Hugging Face model; return it.

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
    readable = families.by_hf_model_type()
    family = readable.get(hf.get("model_type"))
    if family is None or family.model_keys_of_hf is None:
        raise UserError(
            f"{config_path}: model_type {hf.get('model_type')!r} is not "
            + " or ".join(sorted(readable))
        )
    cfg = Config()
    cfg.model = ModelConfig(
        arch=family.name, preset=None, **family.model_keys_of_hf(hf, str(config_path))
    )
    cfg.run.dir = str(run_dir)
    model = build(cfg.model, hf["vocab_size"])
    from_hf_state(load_file(str(weights)), model)
    _write_step0(cfg, model, run_dir)
    if (hf_dir / "tokenizer.json").is_file():
        shutil.copy(hf_dir / "tokenizer.json", run_dir / "tokenizer.json")
    return run_dir


def _write_step0(cfg: Config, model: nn.Module, run_dir: Path) -> None:
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
