"""Typed run configuration: YAML files, ``--set section.key=value`` overrides, validation.

A config has five sections (model, parallel, data, train, run). Every key has a type and a
default; unknown keys, wrong types and values without meaning (a nan learning rate, a negative
epsilon, zero ranks, a run folder that cannot be a folder) are user errors, reported in one
line. :func:`check` knows nothing of the world size or the data; ``hpcllm.train.preflight``
adds what needs the world size.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from collections.abc import Callable
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
    layer_norm_eps: float = 1e-5  # > 0
    init_std: float = 0.02  # > 0: the weights' normal initialisation


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
    distributed_optimizer: bool = False  # ZeRO-1: Adam's state sharded over d (ddp, horovod)
    # ps-async: a worker whose weights are more than K versions old pulls fresh ones; 0 is
    # the synchronous ps. The order the server takes gradients in: as they arrive, or
    # round-robin over the dp ranks (deterministic, for tests).
    max_staleness: int = 4
    ps_async_order: str = "arrival"
    # local-sgd: average every H steps, AdamW's moments too or not, by ddp (torch) or horovod.
    local_sgd_steps: int = 4
    local_sgd_average_optimizer: bool = False
    local_sgd_engine: str = "ddp"
    # Horovod's settings; None: the HOROVOD_* variable if set, else hpcllm's default for the
    # device (cycle 5 ms on CPU), else Horovod's (128 MiB, 1 ms, cache 1024, autotune off).
    horovod_fusion_mb: float | None = None  # HOROVOD_FUSION_THRESHOLD
    horovod_cycle_ms: float | None = None  # HOROVOD_CYCLE_TIME
    horovod_response_cache: int | None = None  # HOROVOD_CACHE_CAPACITY; 0 turns it off
    horovod_autotune: bool | None = None  # HOROVOD_AUTOTUNE
    horovod_autotune_log: str | None = None  # HOROVOD_AUTOTUNE_LOG: a CSV of what it tried


@dataclass
class DataConfig:
    """Where the prepared shards are, and the sampling seed."""

    path: str = "data/stdlib"
    seed: int = 1234  # 0 to 2**32 - 1
    prefetch: int = 4  # micro-batches read ahead, >= 1


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
    # The model's weights and gradients: fp32 (autocast casts per use), or bf16 with fp32
    # master weights in the distributed optimizer (2 + 2 + 12/d bytes per parameter).
    param_dtype: str = "fp32"
    grad_clip: float = 1.0  # 0: no clipping
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    seed: int = 1234  # 0 to 2**32 - 1
    log_interval: int = 10
    eval_interval: int = 50  # 0: never during training
    eval_iters: int = 10
    save_interval: int = 0  # 0: only at the end
    peak_tflops: float | None = None  # per GPU; None: from the device table (null on CPU)
    profile_steps: str | None = None  # "A:B": cudaProfilerStart/Stop around steps A..B-1
    # A straggler you can dial: this rank's compute takes straggler_factor times as long (it
    # sleeps (factor - 1) x its measured forward and backward time each step).
    straggler_rank: int | None = None
    straggler_factor: float = 1.0
    max_bad_steps: int = 10  # consecutive steps with a non-finite loss or grad norm: stop


@dataclass
class RunConfig:
    """Where the run writes, and whether it resumes."""

    dir: str = "runs/tiny"
    resume: str = "auto"  # auto: from dir/checkpoints/latest if there; none: start fresh
    overwrite: bool = False  # resume none on a folder with checkpoints: move the old run aside
    save_failure: str = "fail"  # fail | warn (and go on) when a checkpoint cannot be written
    timeout_s: float = 600.0  # seconds a collective may hang before the job aborts
    tensorboard: bool = True
    reshard: bool = False  # resume a checkpoint of another layout (t, p, v) by re-cutting it
    keep_checkpoints: int | None = None  # keep the newest N checkpoints; None: all


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
    ("parallel", "dp_engine"): ("ddp", "horovod", "ps", "ps-async", "local-sgd"),
    ("parallel", "ps_async_order"): ("arrival", "round-robin"),
    ("parallel", "local_sgd_engine"): ("ddp", "horovod"),
    ("parallel", "dp_compression"): ("none", "fp16", "bf16"),
    ("train", "lr_scaling"): ("none", "linear"),
    ("train", "precision"): ("fp32", "bf16", "fp16"),
    ("train", "param_dtype"): ("fp32", "bf16"),
    ("run", "resume"): ("auto", "none"),
    ("run", "save_failure"): ("fail", "warn"),
}


def _show(value: Any) -> str:
    """Return ``repr(value)`` cut to one short line, for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _name(value: Any) -> str:
    """Return a key as typed when it is a short printable word, else as :func:`_show` does."""
    if isinstance(value, str) and value.isprintable() and len(value) <= 60:
        return value
    return _show(value)


# Every int goes to torch or numpy as a 64-bit integer.
_INT_LIMIT = 2**63


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
        if kind is float and isinstance(value, int | float | str) and not isinstance(value, bool):
            # YAML 1.1 reads "1e-3" (no dot) as a string; a user means the number.
            try:
                number = float(value)
            except (ValueError, OverflowError):
                continue
            # No float key has a meaning for nan or infinity: nan compares false with every
            # bound (train.grad_clip=nan would switch clipping off), infinity trains nan.
            if not math.isfinite(number):
                raise UserError(f"{section}.{key} must be a finite number, got {_show(value)}")
            return number
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            if not -_INT_LIMIT <= value < _INT_LIMIT:
                raise UserError(f"{section}.{key} must fit in 64 bits, got {_show(value)}")
            return value
        if (
            typing.get_origin(kind) is list
            and isinstance(value, list)
            and all(
                isinstance(v, int) and not isinstance(v, bool) and -_INT_LIMIT <= v < _INT_LIMIT
                for v in value
            )
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
    raise UserError(f"{section}.{key} must be {names}, got {_show(value)}")


def _apply(cfg: Config, section: Any, key: Any, value: Any) -> None:
    sections = [f.name for f in dataclasses.fields(Config)]
    if not isinstance(section, str) or section not in sections:
        raise UserError(f"unknown config section {_name(section)}; sections: {', '.join(sections)}")
    part = getattr(cfg, section)
    names = [f.name for f in dataclasses.fields(part)]
    if not isinstance(key, str) or key not in names:
        raise UserError(f"unknown key {section}.{_name(key)}; {section} keys: {', '.join(names)}")
    setattr(part, key, _coerce(section, key, value, type(part)))


def _apply_sections(cfg: Config, raw: Any, where: str) -> None:
    """Set every ``section: {key: value}`` of ``raw`` (a file's data) on ``cfg``."""
    if not isinstance(raw, dict):
        raise UserError(f"{where} must hold a mapping of sections, got {_show(raw)}")
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise UserError(f"{where}: section {_show(section)} must be a mapping")
        for key, value in values.items():
            _apply(cfg, section, key, value)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Return ``(section, key, value)`` of a ``section.key=value`` override (value as YAML)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UserError(f"--set expects section.key=value, got {_show(text)}")
    path, raw = text.split("=", 1)
    section, key = path.split(".", 1)
    try:
        value = load_yaml(raw) if raw != "" else ""
    except (yaml.YAMLError, RecursionError):
        value = raw
    return section.strip(), key.strip(), value


def _read_yaml_file(path: Path) -> Any:
    """Return the data of the YAML file ``path``; a UserError if it is not UTF-8 YAML."""
    try:
        if not path.is_file():
            raise UserError(f"config file {path} does not exist")
        data = path.read_bytes()
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read config file {path}: {err}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(
            f"{path} is not UTF-8 text (byte {err.start} is {data[err.start]:#04x}); "
            "a config file is YAML"
        ) from None
    try:
        return load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise UserError(f"{path}{at} is not valid YAML: {' '.join(str(problem).split())}") from None
    except RecursionError:
        raise UserError(f"{path} is not valid YAML: nested too deeply") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Return the config from a YAML file (optional) with ``--set`` overrides applied."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        raw = _read_yaml_file(path)
        _apply_sections(cfg, {} if raw is None else raw, str(path))
    for text in overrides or []:
        _apply(cfg, *parse_override(text))
    _fill_preset(cfg.model)
    check(cfg)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Return a Config from nested dicts (a saved ``config.yaml``), validated."""
    cfg = Config()
    _apply_sections(cfg, raw, "config.yaml")
    _fill_preset(cfg.model)
    check(cfg)
    return cfg


def _fill_preset(model: ModelConfig) -> None:
    if model.preset is not None:
        if model.preset not in PRESETS:
            raise UserError(
                f"unknown model.preset {_show(model.preset)}; presets: "
                f"{', '.join(PRESETS)} (or null with every size given)"
            )
        for key, value in PRESETS[model.preset].items():
            if getattr(model, key) is None:
                setattr(model, key, value)
    missing = [k for k in ("n_layer", "n_head", "d_model", "seq_len") if getattr(model, k) is None]
    if missing:
        raise UserError(f"model.{missing[0]} is not set (no preset gives it)")


# Each rule: the keys it covers, the test a value set there must pass, and what it says.
_BOUNDS: tuple[tuple[tuple[tuple[str, str], ...], Callable[[Any], bool], str], ...] = (
    (
        (
            ("model", "n_layer"),
            ("model", "n_head"),
            ("model", "d_model"),
            ("model", "seq_len"),
            ("parallel", "tp"),
            ("parallel", "pp"),
            ("parallel", "dp"),  # null: world size / (tp * pp)
            ("parallel", "vpp"),
            ("parallel", "local_sgd_steps"),
            ("data", "prefetch"),
            ("train", "steps"),
            ("train", "micro_batch_size"),
            ("train", "global_batch_size"),
            ("train", "lr_decay_steps"),
            ("train", "lr_reference_batch"),
            ("train", "log_interval"),
            ("train", "eval_iters"),
            ("train", "max_bad_steps"),
            ("run", "keep_checkpoints"),  # null: keep every checkpoint
        ),
        lambda v: v >= 1,
        "must be positive",
    ),
    (
        (
            ("train", "warmup_steps"),
            ("train", "eval_interval"),
            ("train", "save_interval"),
            ("parallel", "max_staleness"),
        ),
        lambda v: v >= 0,
        "must be >= 0 (0: none or never)",
    ),
    (
        (
            ("model", "layer_norm_eps"),
            ("model", "init_std"),
            ("parallel", "ddp_bucket_mb"),
            ("train", "lr"),
            ("train", "adam_eps"),
            ("train", "peak_tflops"),
            ("run", "timeout_s"),
        ),
        lambda v: v > 0,
        "must be above 0",
    ),
    (  # 0 is off: no decay to speak of, no clipping, Horovod's smallest setting
        (
            ("parallel", "horovod_fusion_mb"),
            ("parallel", "horovod_cycle_ms"),
            ("parallel", "horovod_response_cache"),
            ("train", "min_lr"),
            ("train", "grad_clip"),
            ("train", "weight_decay"),
        ),
        lambda v: v >= 0,
        "must be >= 0",
    ),
    (  # 1 would drop every activation, or never forget a gradient
        (("model", "dropout"), ("train", "beta1"), ("train", "beta2")),
        lambda v: 0 <= v < 1,
        "must be in [0, 1)",
    ),
    ((("train", "straggler_factor"),), lambda v: 1 <= v <= 1000, "must be from 1 to 1000"),
    ((("train", "straggler_rank"),), lambda v: v >= 0, "must be >= 0"),
    (  # what numpy's and torch's generators take, after the per-rank offsets
        (("data", "seed"), ("train", "seed")),
        lambda v: 0 <= v < 2**32,
        "must be from 0 to 2**32 - 1",
    ),
    (  # past these, no machine has a meaning for the value (and what it feeds overflows)
        (("model", "n_layer"),),
        lambda v: v <= 4096,  # more blocks than any GPT; bounds the per-stage lists
        "must be at most 4096",
    ),
    (
        (("parallel", "ddp_bucket_mb"), ("parallel", "horovod_fusion_mb")),
        lambda v: v <= 1e6,
        "must be at most 1e6 (a terabyte)",
    ),
    ((("run", "timeout_s"),), lambda v: v <= 7 * 24 * 3600, "must be at most a week (604800)"),
)

# Kernel file systems, where no run folder can be made.
_PSEUDO_FILE_SYSTEMS = ("/proc", "/sys")


def _check_bounds(cfg: Config) -> None:
    for keys, passes, rule in _BOUNDS:
        for section, key in keys:
            value = getattr(getattr(cfg, section), key)
            if value is not None and not passes(value):
                raise UserError(f"{section}.{key} {rule}, got {_show(value)}")


def check_folder(name: str, text: str) -> None:
    """Raise a UserError unless ``text`` names a folder that could exist or be made here.

    Looks at the file system (without writing): a path under /proc or /sys, or one that
    passes through an existing file, can never be a folder.
    """
    if not text or "\x00" in text:
        raise UserError(f"{name} must be a folder path, got {_show(text)}")
    try:
        path = Path(os.path.realpath(text))
        os.fsencode(path)
    except (OSError, ValueError) as err:  # no working folder, or not encodable as a path
        raise UserError(f"{name} {_show(text)} cannot be a folder: {err}") from None
    if any(path == Path(top) or Path(top) in path.parents for top in _PSEUDO_FILE_SYSTEMS):
        raise UserError(
            f"{name} {_show(text)} is in the kernel's /{path.parts[1]}, where no folder can be "
            "made; choose a folder elsewhere"
        )
    for place in (path, *path.parents):
        try:
            place.stat()
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as err:
            raise UserError(f"{name} {_show(text)} cannot be a folder: {err.strerror}") from None
        if not place.is_dir():
            what = "it is a file" if place == path else f"{place} is not a folder"
            raise UserError(f"{name} {_show(text)} cannot be a folder: {what}")
        return


def check(cfg: Config) -> None:
    """Raise a UserError for the first setting that cannot work (sizes known without MPI).

    Reads the file system (never writes it) only to see that ``run.dir`` can be a folder.
    """
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise UserError(
                f"{section}.{key} must be one of {', '.join(choices)}, got {_show(value)}"
            )
    _check_bounds(cfg)
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if m.d_model % m.n_head:
        raise UserError(f"model.d_model {m.d_model} is not divisible by model.n_head {m.n_head}")
    if m.n_head % p.tp:
        raise UserError(f"model.n_head {m.n_head} is not divisible by parallel.tp {p.tp}")
    if p.sequence_parallel and p.tp > 1 and m.seq_len % p.tp:
        raise UserError(
            f"parallel.sequence_parallel splits model.seq_len {m.seq_len} over "
            f"parallel.tp {p.tp} ranks; use a seq_len divisible by {p.tp}"
        )
    if m.vocab_size is not None and m.vocab_size < 2:
        raise UserError(f"model.vocab_size must be at least 2, got {m.vocab_size}")
    if t.min_lr > t.lr:
        raise UserError(f"train.min_lr {t.min_lr} is above train.lr {t.lr}")
    if t.global_batch_size is not None and t.global_batch_size % t.micro_batch_size:
        raise UserError(
            f"train.global_batch_size {t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size {t.micro_batch_size}"
        )
    if p.distributed_optimizer and p.dp_engine == "ps":
        raise UserError(
            "parallel.distributed_optimizer applies to the ddp and horovod engines; the ps "
            "baseline keeps the whole optimizer on its server"
        )
    if p.distributed_optimizer and p.dp_compression != "none":
        raise UserError(
            "parallel.distributed_optimizer reduce-scatters uncompressed gradients; set "
            "parallel.dp_compression: none"
        )
    if t.param_dtype == "bf16" and t.precision != "bf16":
        raise UserError(
            f"train.param_dtype: bf16 computes in bf16; set train.precision: bf16 (not "
            f"{t.precision})"
        )
    if t.param_dtype == "bf16" and not p.distributed_optimizer:
        raise UserError(
            "train.param_dtype: bf16 keeps its fp32 master weights in the distributed "
            "optimizer; set parallel.distributed_optimizer: true (at any d, 1 included)"
        )
    if p.dp_compression != "none" and p.dp_engine in ("ps", "ps-async", "local-sgd"):
        raise UserError(f"parallel.dp_compression applies to ddp and horovod, not {p.dp_engine}")
    if p.dp_engine in ("ps-async", "local-sgd"):
        _check_async(cfg)
    if p.dp_compression == "bf16" and p.dp_engine == "horovod":
        raise UserError(
            "Horovod compresses to fp16 only; use parallel.dp_compression: fp16 or none"
        )
    if t.profile_steps is not None:
        parse_profile_steps(t.profile_steps)
    if not cfg.data.path or "\x00" in cfg.data.path:
        raise UserError(f"data.path must be a folder path, got {_show(cfg.data.path)}")
    check_folder("run.dir", cfg.run.dir)


def _check_async(cfg: Config) -> None:
    """Refuse what ps-async and local-sgd do not do, in one line each."""
    t, p = cfg.train, cfg.parallel
    if p.tp > 1 or p.pp > 1:
        raise UserError(
            f"parallel.dp_engine: {p.dp_engine} runs data parallelism alone; set parallel.tp "
            f"and parallel.pp to 1 (got tp {p.tp}, pp {p.pp})"
        )
    if p.distributed_optimizer:
        raise UserError(
            f"parallel.distributed_optimizer applies to the ddp and horovod engines, not "
            f"{p.dp_engine}"
        )
    if p.dp_engine == "ps-async" and t.precision == "fp16":
        raise UserError(
            "parallel.dp_engine: ps-async has no loss scale shared by its workers; use "
            "train.precision bf16 or fp32"
        )
    if p.dp_engine == "local-sgd" and t.save_interval % p.local_sgd_steps:
        raise UserError(
            f"train.save_interval {t.save_interval} is not a multiple of "
            f"parallel.local_sgd_steps {p.local_sgd_steps}: a checkpoint averages the replicas, "
            "which must fall where the run averages anyway"
        )


def parse_profile_steps(text: str) -> tuple[int, int]:
    """Return the step range ``[a, b)`` of ``--profile-steps A:B``."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(
            f"train.profile_steps must be A:B (steps A to B-1), got {_show(text)}"
        ) from None
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
