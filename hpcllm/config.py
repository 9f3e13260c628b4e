"""Typed run configuration: YAML files, ``--set section.key=value`` overrides, validation.

A config has five sections (model, parallel, data, train, run). Every key has a type and a
default; unknown keys and wrong types are user errors, reported in one line.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpcllm.errors import UserError
from hpcllm.files import atomic_write


class _Yaml12Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's core schema for plain (unquoted) scalars.

    YAML 1.1, which PyYAML implements, reads ``on``/``off``/``yes``/``no`` as booleans and
    ``7:3`` as the base-60 number 423; a user typing ``fused_kernels: off`` or
    ``profile_steps: 7:3`` means the words. Under YAML 1.2 only ``true``/``false`` are
    booleans and numbers are decimal (or ``0x``/``0o``), so every documented value works
    unquoted, in files and in ``--set``.
    """


_Yaml12Loader.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("null", r"^(?:~|null|Null|NULL|)$", "~nN"),
    ("int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
):
    _Yaml12Loader.add_implicit_resolver(
        f"tag:yaml.org,2002:{_tag}", re.compile(_pattern), list(_first) or [""]
    )
_Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:null", re.compile(r"^$"), [""])


def _construct_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = loader.construct_scalar(node)
    if text.startswith("0o"):
        return int(text[2:], 8)
    return int(text, 0) if text.startswith("0x") else int(text, 10)


def _construct_float(loader: yaml.SafeLoader, node: yaml.Node) -> float:
    text = str(loader.construct_scalar(node)).lower()
    return float(text.replace(".inf", "inf").replace(".nan", "nan"))


_Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Yaml12Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)


def load_yaml(text: str) -> Any:
    """Return the data of a YAML document, read with YAML 1.2's rules (see _Yaml12Loader)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


# Model sizes. gpt2-124m/350m are GPT-2 small/medium (Radford et al., 2019); 760m and 1.3b are
# the GPT-3 paper's sizes with Megatron-LM's head counts (head dim 96 and 128).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024},
    "gpt2-350m": {"n_layer": 24, "n_head": 16, "d_model": 1024, "seq_len": 1024},
    "gpt2-760m": {"n_layer": 24, "n_head": 16, "d_model": 1536, "seq_len": 1024},
    "gpt2-1.3b": {"n_layer": 24, "n_head": 16, "d_model": 2048, "seq_len": 2048},
}


@dataclass
class ModelConfig:
    """The GPT's shape; ``preset`` fills the sizes left unset."""

    preset: str | None = "tiny"
    n_layer: int | None = None
    n_head: int | None = None
    d_model: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None  # None: the prepared data's tokenizer decides
    dropout: float = 0.0
    recompute: str = "none"  # none | full | selective
    fused_kernels: str = "auto"  # auto | on | off
    compile: str = "auto"  # auto | none | blocks | full (torch.compile; auto: blocks on CUDA)
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02


@dataclass
class ParallelConfig:
    """Sizes of the grid and how each axis runs."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None  # None: world size / (tp * pp)
    vpp: int = 1
    schedule: str = "1f1b"
    dp_engine: str = "ddp"
    sequence_parallel: bool = False
    scatter_gather: bool = True
    pipeline_layers: list[int] | None = None  # blocks per stage (p x vpp); None: even split
    ddp_bucket_mb: float = 25.0
    ddp_bucket_view: bool = True  # gradient_as_bucket_view: grads live in DDP's buckets
    dp_compression: str = "none"  # none | fp16 | bf16: gradients cast for the all-reduce
    horovod_fusion_mb: float | None = None  # None: Horovod's default (64 MiB)
    horovod_cycle_ms: float | None = None  # None: Horovod's default (1 ms)


@dataclass
class DataConfig:
    """Where the prepared shards are, and the sampling seed."""

    path: str = "data/stdlib"
    seed: int = 1234
    prefetch: int = 4


@dataclass
class TrainConfig:
    """Optimisation, precision, logging and checkpoint cadence."""

    steps: int = 100
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # None: micro_batch_size * dp (no accumulation)
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 10
    lr_decay_steps: int | None = None  # None: train.steps
    lr_scaling: str = "none"  # none | linear
    lr_reference_batch: int = 256  # the global batch that train.lr was tuned for
    precision: str = "fp32"  # fp32 | bf16 | fp16
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 50
    eval_iters: int = 10
    save_interval: int = 0  # 0: only at the end
    peak_tflops: float | None = None  # per GPU; None: from the device table (null on CPU)
    profile_steps: str | None = None  # "A:B": cudaProfilerStart/Stop around steps A..B-1


@dataclass
class RunConfig:
    """Where the run writes, and whether it resumes."""

    dir: str = "runs/tiny"
    resume: str = "auto"  # auto: from dir/checkpoints/latest if there; none: start fresh
    tensorboard: bool = True


@dataclass
class Config:
    """A whole run's configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain nested dicts (what ``config.yaml`` holds)."""
        return dataclasses.asdict(self)

    def dump(self, path: Path) -> None:
        """Write the config as YAML, atomically."""
        atomic_write(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


_CHOICES = {
    ("model", "recompute"): ("none", "full", "selective"),
    ("model", "fused_kernels"): ("auto", "on", "off"),
    ("model", "compile"): ("auto", "none", "blocks", "full"),
    ("parallel", "schedule"): ("gpipe", "1f1b", "interleaved", "zb-h1"),
    ("parallel", "dp_engine"): ("ddp", "horovod", "ps"),
    ("parallel", "dp_compression"): ("none", "fp16", "bf16"),
    ("train", "lr_scaling"): ("none", "linear"),
    ("train", "precision"): ("fp32", "bf16", "fp16"),
}


def _coerce(section: str, key: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` as the field's type, or raise a UserError naming the key."""
    hint = typing.get_type_hints(annotation)
    ftype = hint[key]
    allowed = typing.get_args(ftype) if isinstance(ftype, types.UnionType) else (ftype,)
    if value is None:
        if type(None) in allowed:
            return None
        raise UserError(f"{section}.{key} cannot be null")
    for kind in allowed:
        if kind is type(None):
            continue
        if kind is bool:
            if isinstance(value, bool):
                return value
            continue
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind is float and isinstance(value, str):
            # YAML 1.1 reads "1e-3" (no dot) as a string; a user means the number.
            try:
                return float(value)
            except ValueError:
                pass
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if (
            typing.get_origin(kind) is list
            and isinstance(value, list)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            return list(value)
        if kind is str and isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    names = " or ".join(
        "null"
        if k is type(None)
        else "a list of integers"
        if typing.get_origin(k) is list
        else k.__name__
        for k in allowed
    )
    raise UserError(f"{section}.{key} must be {names}, got {value!r}")


def _apply(cfg: Config, section: str, key: str, value: Any) -> None:
    part = getattr(cfg, section, None)
    if part is None or section not in {f.name for f in dataclasses.fields(Config)}:
        raise UserError(
            f"unknown config section {section!r}; sections: "
            + ", ".join(f.name for f in dataclasses.fields(Config))
        )
    names = [f.name for f in dataclasses.fields(part)]
    if key not in names:
        raise UserError(f"unknown key {section}.{key}; {section} keys: {', '.join(names)}")
    setattr(part, key, _coerce(section, key, value, type(part)))


def parse_override(text: str) -> tuple[str, str, Any]:
    """Return ``(section, key, value)`` of a ``section.key=value`` override (value as YAML)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UserError(f"--set expects section.key=value, got {text!r}")
    path, raw = text.split("=", 1)
    section, key = path.split(".", 1)
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return section.strip(), key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Return the config from a YAML file (optional) with ``--set`` overrides applied."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} does not exist")
        try:
            raw = load_yaml(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise UserError(f"{path} is not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise UserError(f"{path} must hold a mapping of sections")
        for section, values in raw.items():
            if not isinstance(values, dict):
                raise UserError(f"{path}: section {section!r} must be a mapping")
            for key, value in values.items():
                _apply(cfg, section, key, value)
    for text in overrides or []:
        _apply(cfg, *parse_override(text))
    _fill_preset(cfg.model)
    check(cfg)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Return a Config from nested dicts (a saved ``config.yaml``), validated."""
    cfg = Config()
    for section, values in raw.items():
        for key, value in values.items():
            _apply(cfg, section, key, value)
    _fill_preset(cfg.model)
    check(cfg)
    return cfg


def _fill_preset(model: ModelConfig) -> None:
    if model.preset is not None:
        if model.preset not in PRESETS:
            raise UserError(
                f"unknown model.preset {model.preset!r}; presets: "
                f"{', '.join(PRESETS)} (or null with every size given)"
            )
        for key, value in PRESETS[model.preset].items():
            if getattr(model, key) is None:
                setattr(model, key, value)
    missing = [k for k in ("n_layer", "n_head", "d_model", "seq_len") if getattr(model, k) is None]
    if missing:
        raise UserError(f"model.{missing[0]} is not set (no preset gives it)")


def check(cfg: Config) -> None:
    """Raise a UserError for the first setting that cannot work (sizes known without MPI)."""
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise UserError(f"{section}.{key} must be one of {', '.join(choices)}, got {value!r}")
    m, t, p = cfg.model, cfg.train, cfg.parallel
    for section, key in (
        ("model", "n_layer"),
        ("model", "n_head"),
        ("model", "d_model"),
        ("model", "seq_len"),
        ("train", "steps"),
        ("train", "micro_batch_size"),
        ("train", "log_interval"),
        ("train", "eval_iters"),
        ("train", "lr_reference_batch"),
    ):
        if getattr(getattr(cfg, section), key) < 1:
            raise UserError(f"{section}.{key} must be positive")
    if m.d_model % m.n_head:
        raise UserError(f"model.d_model {m.d_model} is not divisible by model.n_head {m.n_head}")
    if m.n_head % p.tp:
        raise UserError(f"model.n_head {m.n_head} is not divisible by parallel.tp {p.tp}")
    if p.sequence_parallel and p.tp > 1 and m.seq_len % p.tp:
        raise UserError(
            f"parallel.sequence_parallel splits model.seq_len {m.seq_len} over "
            f"parallel.tp {p.tp} ranks; use a seq_len divisible by {p.tp}"
        )
    if not 0 <= m.dropout < 1:
        raise UserError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.vocab_size is not None and m.vocab_size < 2:
        raise UserError("model.vocab_size must be at least 2")
    if t.warmup_steps < 0 or t.eval_interval < 0 or t.save_interval < 0:
        raise UserError("train.warmup_steps, eval_interval and save_interval must be >= 0")
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        raise UserError(
            f"need 0 <= train.min_lr <= train.lr and lr > 0, got lr={t.lr}, min_lr={t.min_lr}"
        )
    if t.grad_clip < 0 or t.weight_decay < 0:
        raise UserError("train.grad_clip and train.weight_decay must be >= 0")
    if t.global_batch_size is not None and t.global_batch_size < 1:
        raise UserError(f"train.global_batch_size must be positive, got {t.global_batch_size}")
    if not (0 <= t.beta1 < 1 and 0 <= t.beta2 < 1):
        raise UserError(f"train.beta1 and beta2 must be in [0, 1), got {t.beta1}, {t.beta2}")
    if t.adam_eps <= 0:
        raise UserError(f"train.adam_eps must be positive, got {t.adam_eps}")
    if t.lr_decay_steps is not None and t.lr_decay_steps < 1:
        raise UserError(f"train.lr_decay_steps must be positive, got {t.lr_decay_steps}")
    if t.peak_tflops is not None and t.peak_tflops <= 0:
        raise UserError(f"train.peak_tflops must be positive, got {t.peak_tflops}")
    if p.ddp_bucket_mb <= 0:
        raise UserError(f"parallel.ddp_bucket_mb must be positive, got {p.ddp_bucket_mb}")
    for key in ("horovod_fusion_mb", "horovod_cycle_ms"):
        if getattr(p, key) is not None and getattr(p, key) < 0:
            raise UserError(f"parallel.{key} must be >= 0")
    if t.global_batch_size is not None and t.global_batch_size % t.micro_batch_size:
        raise UserError(
            f"train.global_batch_size {t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size {t.micro_batch_size}"
        )
    if t.profile_steps is not None:
        parse_profile_steps(t.profile_steps)
    if cfg.run.resume not in ("auto", "none"):
        raise UserError(f"run.resume must be auto or none, got {cfg.run.resume!r}")


def parse_profile_steps(text: str) -> tuple[int, int]:
    """Return the step range ``[a, b)`` of ``--profile-steps A:B``."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"train.profile_steps must be A:B (steps A to B-1), got {text!r}") from None
    if not 0 <= a < b:
        raise UserError(f"train.profile_steps {text}: need 0 <= A < B")
    return a, b


def accumulation_steps(train: TrainConfig, dp: int) -> int:
    """Return micro-batches per step per rank: global = micro × accumulation × d."""
    if train.global_batch_size is None:
        return 1
    per_step = train.micro_batch_size * dp
    if train.global_batch_size % per_step:
        raise UserError(
            f"train.global_batch_size {train.global_batch_size} is not a multiple "
            f"of micro_batch_size x dp = {train.micro_batch_size} x {dp}"
        )
    return train.global_batch_size // per_step


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Return the vocabulary padded to a multiple of 128·t (Megatron's rule)."""
    multiple = 128 * tp
    return -(-vocab_size // multiple) * multiple
