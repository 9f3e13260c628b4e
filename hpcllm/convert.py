"""``hpcllm convert``: Hugging Face checkpoints in and out (config.json + safetensors), for
every family whose spec maps its tensors (:attr:`hpcllm.families.Family.hf_tensors`): GPT-2
(GPT2LMHeadModel) and Llama (LlamaForCausalLM; MixtralForCausalLM as a Llama with experts;
Qwen2's and Qwen3's causal models, dense and MoE, as a Llama with their attention variants).
A mapped tensor may be one of theirs or one per routed expert, stacked along our dim 0; a form
the family reads but does not write (transformers' fused ``gate_up_proj``) is read where a
checkpoint lacks the written form's tensors.

Hugging Face's GPT-2 stores linear layers as ``Conv1D`` (weight shape in × out, the transpose
of ``nn.Linear``), keeps q|k|v fused in ``c_attn`` in the same order as ours, uses the tanh
GeLU (``gelu_new``) and ties ``lm_head`` to ``wte``. Its Llama has our matrices as they are.
Our embedding is padded to a multiple of 128·t; the padding is dropped on the way out and added
(as zeros) on the way in.

In: one ``model.safetensors`` or shards named by ``model.safetensors.index.json``, read one
tensor at a time into a model built on the meta device, so that the import holds one copy of
the weights (in fp32, the training copy), never two. Out: the merged model, written in shards
of at most :data:`MAX_SHARD_BYTES` with an index when it is larger, in fp32, bf16 or fp16.
The tokenizer goes along both ways when there is one; a model without one keeps the BOS and
EOS ids of the config.json it came from (``RUN_DIR/hf_config.json``).

A model whose positions hold no weights (rotary: Llama) comes in to train at
:data:`hpcllm.families.IMPORTED_SEQ_LEN` tokens, or its config.json's context where shorter,
and goes out with the context of the config.json it came from unless it trained longer. A
config.json whose sizes disagree with its tensors is refused naming the key to fix
(:attr:`hpcllm.families.Family.hf_sizes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from hpcllm import families
from hpcllm.config import Config, ModelConfig, model_config
from hpcllm.datasets.tokenizer import CONFIG_FILE, TOKENIZER_FILE, Tokenizer, load_tokenizer
from hpcllm.errors import UserError
from hpcllm.files import honour_umask, new_folder
from hpcllm.model import build
from hpcllm.train.run_dir import IMPORTED_CONFIG

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# transformers 4's default shard size for save_pretrained.
MAX_SHARD_BYTES = 5 * 1024**3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _hf_family(cfg: ModelConfig) -> families.Family:
    """Return ``cfg``'s family; a UserError where it has no Hugging Face mapping."""
    family = families.get(cfg.arch)
    if not family.hf_tensors or family.hf_config is None:
        raise UserError(f"model.arch {cfg.arch} has no Hugging Face mapping")
    return family


@dataclasses.dataclass(frozen=True)
class _Link:
    """One of our tensors (of a whole model: tp = 1, one stage) and the Hugging Face tensors
    it is made of: one, or one per routed expert (``per_expert``: stacked along dim 0), each
    stored transposed (``transpose``: the last two dims swapped) or fused with others
    (``part``: (dim, index, count), ours being chunk ``index`` of ``count`` along ``dim``)."""

    ours: str
    theirs: tuple[str, ...]
    transpose: bool = False
    part: tuple[int, int, int] | None = None
    per_expert: bool = False


def _links(model: nn.Module, available: set[str] | None = None) -> list[_Link]:
    """Return the link of every tensor of a whole model that has a Hugging Face name (a tied
    model's output layer has none of its own), in the family's order.

    The names are those of the Hugging Face kind the model is (:meth:`Family.hf_kind`).
    Where the family names several forms of a tensor, ``available`` (a checkpoint's tensor
    names) picks the first form it holds whole; without it (an export), or where it holds
    none, the first form that is not an alternative."""
    family = _hf_family(model.cfg)
    kind = family.hf_kind(model.cfg)
    present = set(model.state_dict())
    experts = range(model.cfg.moe_experts)
    chosen: dict[str, _Link] = {}
    # The written forms first, so that an alternative listed before them is still weighed.
    forms = sorted(
        (t for t in family.hf_tensors if not t.kinds or kind in t.kinds),
        key=lambda t: t.alternative,
    )
    for tensor in forms:
        indices = range(model.cfg.n_layer) if "{i}" in tensor.ours else [None]
        for i in indices:
            ours = tensor.ours.format(i=i)
            if ours not in present:
                continue
            if tensor.one_expert:
                theirs = (tensor.theirs.format(i=i),)
            elif tensor.per_expert:
                theirs = tuple(tensor.theirs.format(i=i, e=e) for e in experts)
            else:
                theirs = (tensor.theirs.format(i=i),)
            link = _Link(ours, theirs, tensor.transpose, tensor.part, tensor.per_expert)
            if ours not in chosen:
                if not tensor.alternative:
                    chosen[ours] = link
            elif (
                tensor.alternative
                and available is not None
                and not (set(chosen[ours].theirs) <= available)
            ):
                if set(theirs) <= available:
                    chosen[ours] = link
    return list(chosen.values())


def _export_links(model: nn.Module) -> list[_Link]:
    """Return the links an export writes; a UserError where a parameter has no Hugging Face
    name (a part the family's Hugging Face model lacks), which the export would drop."""
    links = _links(model)
    named = {link.ours for link in links}
    missing = [name for name, _ in model.named_parameters() if name not in named]
    if missing:
        raise UserError(
            f"{missing[0]} has no Hugging Face name in family {model.cfg.arch}"
            + (f" (nor {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; this model has no Hugging Face form"
        )
    return links


def _stored_shape(link: _Link, ours: tuple[int, ...]) -> tuple[int, ...]:
    """Return the shape each Hugging Face tensor of ``link`` has, ours being ``ours``."""
    shape = list(ours[1:] if link.per_expert else ours)
    if link.transpose:
        shape[-2], shape[-1] = shape[-1], shape[-2]
    if link.part is not None:
        shape[link.part[0]] *= link.part[2]
    return tuple(shape)


def _theirs(model: nn.Module, link: _Link, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """Return our tensor ``value`` of ``link`` as Hugging Face stores it, by name (views where
    it can be)."""
    if link.part is not None:
        raise ValueError(f"{link.theirs[0]} is a form hpcllm reads, not one it writes")
    if _hf_family(model.cfg).rule(link.ours).padded:
        value = value[: model.vocab_size]
    values = list(value) if link.per_expert else [value]
    if link.transpose:
        values = [v.transpose(-2, -1) for v in values]
    return dict(zip(link.theirs, values, strict=True))


def to_hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return the Hugging Face state dict of a (tp = 1) model, its vocabulary padding dropped."""
    ours = model.state_dict()
    return {
        name: value.detach().contiguous().clone()
        for link in _export_links(model)
        for name, value in _theirs(model, link, ours[link.ours]).items()
    }


def _ours(
    model: nn.Module, shapes: dict[str, Any], link: _Link, get: Callable[[str], torch.Tensor]
) -> torch.Tensor:
    """Return our tensor of ``link`` (fp32, padded) from the Hugging Face tensors ``get``
    gives, checking each has the shape ``shapes[link.ours]`` implies (padded: the
    vocabulary's rows)."""
    expected = tuple(shapes[link.ours])
    padded = _hf_family(model.cfg).rule(link.ours).padded
    want = (model.vocab_size, *expected[1:]) if padded else expected
    stored = _stored_shape(link, want)
    stack = None  # the routed experts' tensor, filled one source tensor at a time
    for e, name in enumerate(link.theirs):
        value = get(name)
        if tuple(value.shape) != stored:
            named = "" if link.per_expert else f" (ours: {link.ours})"
            raise UserError(
                f"tensor {name}: shape {tuple(value.shape)} where the config gives {stored}" + named
            )
        if link.part is not None:
            dim, index, count = link.part
            value = value.chunk(count, dim)[index]
        value = value.transpose(-2, -1) if link.transpose else value
        if link.per_expert:
            if stack is None:
                stack = torch.empty((len(link.theirs), *value.shape), dtype=torch.float32)
            stack[e] = value
            del value
    if stack is not None:
        return stack
    if padded:
        out = torch.zeros(expected, dtype=torch.float32)
        out[: value.shape[0]] = value
        return out
    return value.to(torch.float32).contiguous()


def from_hf_state(state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Load a Hugging Face state dict into ``model`` (vocabulary padding rows set to zero)."""
    shapes = {n: v.shape for n, v in model.state_dict().items()}
    links = _links(model, set(state))
    ours = {link.ours: _ours(model, shapes, link, state.__getitem__) for link in links}
    model.load_state_dict(ours)


class HFWeights(contextlib.ExitStack):
    """The tensors of a Hugging Face folder, one safetensors file or shards with an index,
    read one at a time."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        from safetensors import safe_open

        self._open = safe_open
        self.folder = folder
        self._handles: dict[Path, Any] = {}
        if (folder / INDEX).is_file():
            try:
                weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise UserError(f"{folder / INDEX} is not a safetensors index: {err}") from None
            self.where = {name: folder / file for name, file in weight_map.items()}
            missing = sorted({p.name for p in self.where.values() if not p.is_file()})
            if missing:
                raise UserError(f"{folder / INDEX} names {', '.join(missing)}, not in {folder}")
        elif (folder / SINGLE).is_file():
            self.where = dict.fromkeys(self._handle(folder / SINGLE).keys(), folder / SINGLE)
        else:
            raise UserError(
                f"{folder} has no {SINGLE} or {INDEX} (what save_pretrained writes; "
                "pytorch_model.bin files are not read)"
            )

    def _handle(self, path: Path) -> Any:
        if path not in self._handles:
            try:
                self._handles[path] = self.enter_context(self._open(str(path), framework="pt"))
            except Exception as err:  # safetensors raises its own error types
                raise UserError(f"{path} is not a safetensors file: {err}") from None
        return self._handles[path]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Return the shape of every tensor of the folder, read from the files' headers."""
        return {
            name: tuple(self._handle(path).get_slice(name).get_shape())
            for name, path in self.where.items()
        }

    def get(self, name: str) -> torch.Tensor:
        """Return the tensor ``name``; a UserError where the folder has none."""
        if name not in self.where:
            raise UserError(f"{self.folder} has no tensor {name}")
        return self._handle(self.where[name]).get_tensor(name)


def _read_hf_config(hf_dir: Path) -> tuple[dict[str, Any], families.Family, ModelConfig, int]:
    """Return (config.json, its family, the model config it describes, the context it gives)
    of a Hugging Face folder; a UserError naming what cannot be read.

    A model whose positions hold no weights trains at the shorter of the context and
    :data:`~hpcllm.families.IMPORTED_SEQ_LEN`. The family's checks of the shape are left to
    the caller, after the tensors' sizes (:func:`_check_sizes`), which say better what is
    wrong.
    """
    config_path = hf_dir / "config.json"
    if not hf_dir.exists():
        raise UserError(f"{hf_dir} does not exist (--from-hf takes a save_pretrained folder)")
    if not hf_dir.is_dir():
        raise UserError(
            f"{hf_dir} is a file; --from-hf takes the save_pretrained folder that holds "
            "config.json and the weights"
        )
    if not config_path.is_file():
        raise UserError(f"{hf_dir} has no config.json (a save_pretrained folder has one)")
    try:
        hf = json.loads(config_path.read_text())
    except (ValueError, OSError) as err:
        raise UserError(f"{config_path} is unreadable: {err}") from None
    readable = families.by_hf_model_type()
    family = readable.get(hf.get("model_type")) if isinstance(hf, dict) else None
    if family is None or family.model_keys_of_hf is None:
        known = ", ".join(sorted(readable))
        raise UserError(
            f"{config_path}: model_type {hf.get('model_type')!r} is not read; hpcllm reads {known}"
        )
    try:
        keys = family.model_keys_of_hf(hf, str(config_path))
    except KeyError as err:
        raise UserError(f"{config_path} lacks {err.args[0]}") from None
    model_cfg = model_config(family.name, preset=None, **keys)
    kind = family.hf_kind(model_cfg)
    if kind != hf.get("model_type"):
        # The tensors are named as the kind the model reads as; a file of another kind
        # whose shape reads so would be looked up under names it does not have.
        raise UserError(
            f"{config_path}: this {hf.get('model_type')} model's shape is a {kind}'s, which "
            "hpcllm would name otherwise; it is not read"
        )
    context = keys["seq_len"]
    if not family.seq_in_weights and isinstance(context, int):
        model_cfg = dataclasses.replace(model_cfg, seq_len=min(context, families.IMPORTED_SEQ_LEN))
    return hf, family, model_cfg, context


def _check_sizes(family: families.Family, hf: dict, weights: HFWeights, where: Path) -> None:
    """Raise a UserError naming the config.json key whose size the tensors contradict."""
    if family.hf_sizes is None:
        return
    for size in family.hf_sizes(hf, weights.shapes()):
        line = size.disagreement(str(where))
        if line is not None:
            raise UserError(line)


def _imported_context(run_dir: Path, family: families.Family) -> int | None:
    """Return the context (the model.seq_len) of the config.json ``run_dir`` was imported
    from, None where it was not imported or the file does not say."""
    path = Path(run_dir) / IMPORTED_CONFIG
    if not path.is_file() or family.model_keys_of_hf is None:
        return None
    try:
        context = family.model_keys_of_hf(json.loads(path.read_text()), str(path))["seq_len"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UserError):
        return None
    return context if isinstance(context, int) else None


def from_hf(hf_dir: Path, run_dir: Path, tokenizer: Path | None = None) -> Path:
    """Make a run folder whose step-0 checkpoint holds a Hugging Face model; return it.

    The folder appears whole or not at all. Train from it with ``hpcllm train --config
    RUN_DIR/config.yaml`` (it resumes from that step). The tokenizer: ``tokenizer`` (a file
    or a Hugging Face folder), else the one in ``hf_dir`` if any.
    """
    return import_hf(hf_dir, run_dir, tokenizer)[0]


def import_hf(hf_dir: Path, run_dir: Path, tokenizer: Path | None = None) -> tuple[Path, int, int]:
    """Return (:func:`from_hf`'s folder, the model.seq_len it trains at, the context its
    config.json gives): shorter where the model's positions hold no weights."""
    from hpcllm.train import checkpoint

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    hf, family, model_cfg, context = _read_hf_config(hf_dir)
    with HFWeights(hf_dir) as weights:
        _check_sizes(family, hf, weights, hf_dir / "config.json")
        if family.check is not None:
            family.check(model_cfg, 1)
        tok = _tokenizer(tokenizer, hf_dir, model_cfg.vocab_size)
        cfg = Config()
        cfg.model = model_cfg
        cfg.run.dir = str(run_dir.resolve())
        with torch.device("meta"):
            model = build(cfg.model, hf["vocab_size"])
        shapes = {n: v.shape for n, v in model.state_dict().items()}
        state = {
            link.ours: _ours(model, shapes, link, weights.get)
            for link in _links(model, set(weights.where))
        }
    model.load_state_dict(state, assign=True)
    config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    meta = {"consumed_samples": 0, "vocab_size": model.vocab_size}
    try:
        with new_folder(run_dir) as partial:
            cfg.dump(partial / "config.yaml")
            (partial / IMPORTED_CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
            if tok is not None:
                tok.save(partial / TOKENIZER_FILE)
            checkpoint.write_offline(
                partial, 0, {(0, 0): {"model": model.state_dict()}}, meta, config_yaml,
                tp=1, pp=1, dp=None,
            )  # fmt: skip
    except OSError as err:
        raise UserError(f"writing {run_dir} failed: {err}") from None
    return run_dir, model_cfg.seq_len, context


def _tokenizer(given: Path | None, folder: Path, vocab: int) -> Tokenizer | None:
    """Return the tokenizer ``given``, else the one in ``folder`` (None: neither); a UserError
    where it has more ids than the model's vocabulary."""
    if given is None and not (folder / TOKENIZER_FILE).is_file():
        return None
    tok = load_tokenizer(given if given is not None else folder)
    if tok.vocab_size > vocab:
        raise UserError(
            f"the tokenizer {given or folder} has {tok.vocab_size} ids, the model's vocabulary "
            f"only {vocab}"
        )
    return tok


def _shards(model: nn.Module, dtype: torch.dtype, limit: int) -> list[list[_Link]]:
    """Return the export's links, grouped into files of at most ``limit`` bytes each (a larger
    tensor alone; a routed experts' stack counts whole)."""
    shapes = {n: v.shape for n, v in model.state_dict().items()}
    size = torch.tensor([], dtype=dtype).element_size()
    groups: list[list[_Link]] = [[]]
    used = 0
    for link in _export_links(model):
        name = link.ours
        rows = model.vocab_size if _hf_family(model.cfg).rule(name).padded else shapes[name][0]
        nbytes = rows * shapes[name][1:].numel() * size
        if groups[-1] and used + nbytes > limit:
            groups.append([])
            used = 0
        groups[-1].append(link)
        used += nbytes
    return groups


def write_hf_weights(
    model: nn.Module, folder: Path, dtype: str = "float32", max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[Path]:
    """Write a whole model's Hugging Face tensors into ``folder``: one model.safetensors, or
    shards and model.safetensors.index.json when larger than ``max_shard_bytes``; return the
    files. Holds one shard's copies at a time."""
    from safetensors.torch import save_file

    to = DTYPES[dtype]
    groups = _shards(model, to, max_shard_bytes)
    ours = model.state_dict()
    weight_map, written, total = {}, [], 0
    for index, group in enumerate(groups, start=1):
        name = SINGLE if len(groups) == 1 else f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        tensors = {
            theirs: value.detach().to(to).contiguous().clone()
            for link in group
            for theirs, value in _theirs(model, link, ours[link.ours]).items()
        }
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        honour_umask(folder / name)
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        written.append(folder / name)
        del tensors
    if len(groups) > 1:
        index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index_file, indent=2) + "\n")
        written.append(folder / INDEX)
    return written


def to_hf(
    run_dir: Path,
    out_dir: Path,
    step: int | None = None,
    allow_unverified: bool = False,
    dtype: str = "float32",
    tokenizer: Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write a run's checkpoint (any layout) as a Hugging Face folder; return it.

    The newest checkpoint that verifies, or the one of ``step``. The folder appears whole or
    not at all, its files with the user's umask. The tokenizer: ``tokenizer``, else the run's
    (a run without one, imported so, is written without one).
    """
    return export_hf(run_dir, out_dir, step, allow_unverified, dtype, tokenizer, max_shard_bytes)[0]


def export_hf(
    run_dir: Path,
    out_dir: Path,
    step: int | None = None,
    allow_unverified: bool = False,
    dtype: str = "float32",
    tokenizer: Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> tuple[Path, int]:
    """Return (:func:`to_hf`'s folder, the step of the checkpoint it wrote)."""
    from safetensors import SafetensorError

    from hpcllm.generate import load_model, special_ids

    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    model = load_model(run_dir, step=step, allow_unverified=allow_unverified)
    family = _hf_family(model.cfg)
    tok = _tokenizer(tokenizer, Path(run_dir), model.vocab_size)
    # The context the model states: its seq_len, or, where its positions hold no weights, the
    # one of the config.json it came from, unless it trained longer.
    context = model.cfg.seq_len
    if not family.seq_in_weights:
        context = max(context, _imported_context(Path(run_dir), family) or 0)
    stated = dataclasses.replace(model.cfg, seq_len=context)
    config = family.hf_config(stated, model.vocab_size, special_ids(Path(run_dir), tok))
    config["torch_dtype"] = dtype
    try:
        with new_folder(out_dir) as partial:
            write_hf_weights(model, partial, dtype, max_shard_bytes)
            (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if tok is not None and tok.kind == "hf":
                (partial / TOKENIZER_FILE).write_text(tok.spec)
                (partial / CONFIG_FILE).write_text(tok.hf_config(context))
    except (OSError, SafetensorError) as err:  # safetensors reports a full disk its own way
        raise UserError(f"writing {out_dir} failed: {err}") from None
    return Path(out_dir), model.checkpoint_step
