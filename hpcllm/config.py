"""Typed run configuration: YAML files, ``--set section.key=value`` overrides, validation.

A config has five sections (model, parallel, data, train, run). Every key has a type and a
default; unknown keys, wrong types and values without meaning (a nan learning rate, a negative
epsilon, zero ranks, a run folder that cannot be a folder) are user errors, reported in one
line. :func:`check` knows nothing of the world size or the data; ``hpcllm.train.preflight``
adds what needs the world size.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from hpcllm import families
from hpcllm.errors import UserError
from hpcllm.files import atomic_write
from hpcllm.keys import (
    ABOVE_ZERO,
    COUNT_OR_NEVER,
    FRACTION,
    LAYERS,
    MEGABYTES,
    OFF_AT_ZERO,
    POSITIVE,
    RANK,
    RULES,
    SEED,
    STRAGGLE,
    TWO_TOKENS,
    WEEK,
    Rule,
    key,
    text_of,
)


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


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that names a key twice: YAML would keep the last silently; a config refuses."""

    def __init__(self, key: Any, first: int, second: int) -> None:
        super().__init__(f"{_show(key)} is given twice, on lines {first} and {second}")
        self.key, self.first, self.second = key, first, second


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """Return a mapping, refusing a key given twice (a section or a key of one)."""
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            continue  # the base constructor says what is wrong with such a key
        line = key_node.start_mark.line + 1
        if key in seen:
            raise DuplicateKeyError(key, seen[key], line)
        seen[key] = line
    return loader.construct_mapping(node, deep=True)


_Yaml12Loader.add_constructor("tag:yaml.org,2002:map", _construct_mapping)


def load_yaml(text: str) -> Any:
    """Return the data of a YAML document, read with YAML 1.2's rules (see _Yaml12Loader)."""
    return yaml.load(text, Loader=_Yaml12Loader)  # noqa: S506 - a SafeLoader subclass


# The one rule that reads the registry, so it lives above the families; the check tries it
# after every bound of hpcllm.keys.RULES. It names the families registered when it is shown.
FAMILY = Rule(
    lambda v: v in families.names(),
    lambda: (
        f"must be a model family: {', '.join(families.names())}, or one registered by a "
        "module HPCLLM_FAMILIES names"
    ),
)


@dataclass
class ModelConfig:
    """The model: its family (``arch``) and shape; ``preset`` fills the sizes left unset."""

    # The keys every family shares; a family's own follow them (model_config, Family.keys).
    arch: str = key("gpt2", "model family (hpcllm.families)", FAMILY, form="gpt2")
    preset: str | None = key(
        "tiny",
        "size preset filling the sizes left unset; null: give every size",
        form=lambda: ", ".join(families.presets()) + " or null",
    )
    n_layer: int | None = key(None, "transformer blocks", POSITIVE, LAYERS)
    n_head: int | None = key(None, "attention heads", POSITIVE)
    d_model: int | None = key(None, "hidden size", POSITIVE)
    seq_len: int | None = key(None, "tokens per sample", POSITIVE)
    vocab_size: int | None = key(
        None, "vocabulary; null: the prepared data's tokenizer decides", TWO_TOKENS
    )
    dropout: float = key(0.0, "dropout probability", FRACTION)
    recompute: Literal["none", "full", "selective"] = key(
        "none", "activation recomputation: none, every block (full), or attention only"
    )
    fused_kernels: Literal["auto", "on", "off"] = key(
        "auto", "fused Triton kernels: auto times them against torch per op and shape"
    )
    compile: Literal["auto", "none", "blocks", "full"] = key(
        "auto",
        "torch.compile: each block, each chunk whole, or none; auto: full on 1 GPU, else blocks",
    )
    compile_mode: Literal[
        "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"
    ] = key(
        "default",
        "torch.compile's mode for what model.compile compiles (reduce-overhead: CUDA graphs)",
    )
    layer_norm_eps: float = key(1e-5, "the norms' epsilon (LayerNorm, RMSNorm)", ABOVE_ZERO)
    init_std: float = key(
        0.02, "standard deviation of the weights' normal initialisation", ABOVE_ZERO
    )
    # Mixtures of experts (docs/moe.md): the blocks chosen by moe_every, moe_first_dense and
    # moe_dense_layers swap their MLP for a router and moe_experts expert MLPs.
    moe_experts: int = key(0, "experts of each MoE block; 0: every MLP dense", COUNT_OR_NEVER)
    moe_top_k: int = key(2, "experts each token goes to", POSITIVE)
    moe_ffn_size: int | None = key(
        None, "each expert's MLP width; null: the family's MLP width", POSITIVE
    )
    moe_every: int = key(
        1,
        "block i (from 0) is MoE when i >= moe_first_dense and (i + 1) % moe_every == 0",
        POSITIVE,
    )
    moe_first_dense: int = key(0, "the first blocks kept dense", COUNT_OR_NEVER)
    moe_dense_layers: list[int] | None = key(
        None, "blocks kept dense besides (Qwen's mlp_only_layers); null: none", form="block indices"
    )
    moe_shared_ffn_size: int = key(
        0, "width of a shared expert every token goes through; 0: none", COUNT_OR_NEVER
    )
    moe_shared_gate: bool = key(False, "a sigmoid gate on the shared expert's output (Qwen-MoE)")
    moe_router: Literal["softmax-topk", "topk-softmax", "sigmoid"] = key(
        "softmax-topk", "the router: softmax then top-k, top-k then softmax (Mixtral), sigmoid"
    )
    moe_renormalize: bool = key(
        False, "divide the k chosen weights by their sum (Qwen's norm_topk_prob)"
    )
    moe_aux_loss: float = key(
        0.01, "balancing loss coefficient (averaged over the MoE blocks); 0: none", OFF_AT_ZERO
    )
    moe_z_loss: float = key(0.0, "router z-loss coefficient; 0: none", OFF_AT_ZERO)
    moe_bias_rate: float = key(
        0.001, "the sigmoid router's balancing-bias step per optimizer step; 0: fixed", OFF_AT_ZERO
    )
    moe_capacity_factor: float | None = key(
        None, "each expert's slots per fair share of the tokens; null: dropless", ABOVE_ZERO
    )
    moe_drop_policy: Literal["probs", "position"] = key(
        "probs", "tokens over capacity dropped: the lowest-weighted or the latest first"
    )


def moe_layers(m: ModelConfig) -> list[int]:
    """Return the blocks (from 0) whose MLP is a mixture of experts: none when
    ``moe_experts`` is 0, else each i >= ``moe_first_dense`` with (i + 1) % ``moe_every`` == 0
    that ``moe_dense_layers`` does not keep dense."""
    if not m.moe_experts:
        return []
    dense = set(m.moe_dense_layers or ())
    return [
        i
        for i in range(m.n_layer or 0)
        if i >= m.moe_first_dense and (i + 1) % m.moe_every == 0 and i not in dense
    ]


def model_config(arch: str, **values: Any) -> ModelConfig:
    """Return the model section of family ``arch`` holding ``values``: the keys every family
    shares, then the family's own (``Family.keys``); the rest at their defaults."""
    family = families.get(arch)
    return _model_class(arch, family.keys)(**{**values, "arch": arch})


@functools.cache
def _model_class(arch: str, own: type | None) -> type[ModelConfig]:
    """Return the model section's class of family ``arch`` whose own keys are the dataclass
    ``own``: ModelConfig where it has none, else ModelConfig's fields followed by own's."""
    if own is None:
        return ModelConfig
    clash = {f.name for f in dataclasses.fields(ModelConfig)} & {
        f.name for f in dataclasses.fields(own)
    }
    if clash:
        raise TypeError(f"family {arch}'s own keys repeat shared ones: {', '.join(sorted(clash))}")
    # Bases in this order put ModelConfig's fields first (a dataclass collects its fields from
    # the far end of the MRO), and keep every instance a ModelConfig.
    return dataclasses.make_dataclass(
        f"ModelConfig[{arch}]", [], bases=(own, ModelConfig), namespace={"__module__": __name__}
    )


@dataclass
class ParallelConfig:
    """Sizes of the grid and how each axis runs."""

    tp: int = key(1, "tensor-parallel size t (ranks of a node)", POSITIVE)
    pp: int = key(1, "pipeline-parallel size p (stages)", POSITIVE)
    dp: int | None = key(None, "data-parallel size d; null: world size / (t x p)", POSITIVE)
    vpp: int = key(1, "virtual pipeline stages per rank v (interleaved schedule)", POSITIVE)
    ep: int = key(
        1, "expert-parallel size: the ranks of d that split each MoE layer's experts", POSITIVE
    )
    cp: int = key(
        1,
        "context-parallel size: ranks that split each sequence (in 2 x cp chunks), next to t",
        POSITIVE,
    )
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1"] = key(
        "1f1b", "pipeline schedule (1f1b with one stage)"
    )
    dp_engine: Literal["ddp", "horovod", "ps", "ps-async", "local-sgd"] = key(
        "ddp", "data-parallel engine"
    )
    sequence_parallel: bool = key(False, "split LayerNorm and dropout activations over t")
    scatter_gather: bool = key(True, "send 1/t of each activation between stages, gather after")
    pipeline_layers: list[int] | None = key(
        None,
        "blocks per stage; null: an even split",
        form="p x vpp positive counts that add up to model.n_layer",
    )
    ddp_bucket_mb: float = key(
        25.0, "DDP's gradient bucket (and the distributed optimizer's)", ABOVE_ZERO, MEGABYTES
    )
    ddp_bucket_view: bool = key(True, "gradient_as_bucket_view: gradients live in DDP's buckets")
    dp_compression: Literal["none", "fp16", "bf16"] = key(
        "none", "gradients cast for the all-reduce (ddp; horovod fp16 only)"
    )
    distributed_optimizer: bool = key(
        False, "ZeRO-1: AdamW's state sharded over d (ddp and horovod)"
    )
    max_staleness: int = key(
        4,
        "ps-async: versions a worker may lag before it pulls fresh weights; 0: synchronous",
        COUNT_OR_NEVER,
    )
    ps_async_order: Literal["arrival", "round-robin"] = key(
        "arrival", "ps-async: the order the server takes gradients in"
    )
    local_sgd_steps: int = key(4, "local-sgd: steps between two averages (H)", POSITIVE)
    local_sgd_average_optimizer: bool = key(False, "local-sgd: average AdamW's moments too")
    local_sgd_engine: Literal["ddp", "horovod"] = key("ddp", "local-sgd: who averages")
    # Horovod's settings; null: the HOROVOD_* variable if set, else hpcllm's default for the
    # device (cycle 5 ms on CPU), else Horovod's (128 MiB, 1 ms, cache 1024, autotune off).
    horovod_fusion_mb: float | None = key(
        None,
        "HOROVOD_FUSION_THRESHOLD in MB; null: variable, hpcllm's or Horovod's default",
        OFF_AT_ZERO,
        MEGABYTES,
    )
    horovod_cycle_ms: float | None = key(
        None,
        "HOROVOD_CYCLE_TIME in ms; null: variable, hpcllm's or Horovod's default",
        OFF_AT_ZERO,
    )
    horovod_response_cache: int | None = key(
        None, "HOROVOD_CACHE_CAPACITY (0: off); null: variable or Horovod's default", OFF_AT_ZERO
    )
    horovod_autotune: bool | None = key(None, "HOROVOD_AUTOTUNE; null: variable or off")
    horovod_autotune_log: str | None = key(
        None, "HOROVOD_AUTOTUNE_LOG: a CSV of the settings autotune tried", form="a file path"
    )


# data.blend's type: entries [path, weight, name], as blend_sources returns them.
BlendSources = list[list[str | float]]
BLEND_FORM = (
    "a list of [PATH, WEIGHT] or [PATH, WEIGHT, NAME] (weights > 0, normalised), or "
    "Megatron's 'W1 PATH1 W2 PATH2 ...'"
)
# A source's name is a metrics key (val_loss/NAME) and a TensorBoard tag.
_SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def blend_sources(key: str, value: Any) -> list[list[str | float]]:
    """Return a blend as ``[[path, weight, name], ...]``: ``~`` and ``$VARS`` expanded, each
    source named (by its folder where no name is given); a UserError naming ``key`` for a
    value that is no blend.

    Takes a list of ``[PATH, WEIGHT]`` or ``[PATH, WEIGHT, NAME]`` entries, or Megatron-LM's
    ``--data-path`` form, the text ``"W1 PATH1 W2 PATH2 ..."`` (or one ``PATH``, weight 1).
    """
    if isinstance(value, str):
        words = value.split()
        if len(words) == 1:  # Megatron's one folder, weight 1
            words = ["1", words[0]]
        if not words or len(words) % 2:
            raise UserError(
                f"{key} as text is Megatron's 'W1 PATH1 W2 PATH2 ...' (a weight before each "
                f"folder), got {_show(value)}"
            )
        value = [[path, weight] for weight, path in zip(words[::2], words[1::2], strict=True)]
    if not isinstance(value, list) or not value:
        if value == []:
            raise UserError(f"{key} needs at least one source (null: read data.path)")
        raise UserError(f"{key} must be {BLEND_FORM}, got {_show(value)}")
    sources: list[list[str | float]] = []
    for number, entry in enumerate(value, start=1):
        where = f"{key} entry {number}"
        if not isinstance(entry, list | tuple) or len(entry) not in (2, 3):
            raise UserError(
                f"{where} must be [PATH, WEIGHT] or [PATH, WEIGHT, NAME], got {_show(entry)}"
            )
        path, weight = entry[0], entry[1]
        if not isinstance(path, str) or not path.strip() or "\x00" in path:
            raise UserError(f"{where}: PATH must be a folder path, got {_show(path)}")
        path = os.path.normpath(os.path.expandvars(os.path.expanduser(path.strip())))
        try:
            weight = float(weight) if not isinstance(weight, bool) else math.nan
        except (TypeError, ValueError, OverflowError):
            weight = math.nan
        if not math.isfinite(weight) or weight <= 0:
            raise UserError(f"{where}: WEIGHT must be a number above 0, got {_show(entry[1])}")
        name = entry[2] if len(entry) == 3 else Path(path).name
        if not isinstance(name, str) or not _SOURCE_NAME.fullmatch(name):
            given = "NAME" if len(entry) == 3 else f"its folder's name {_show(name)}"
            raise UserError(
                f"{where}: {given} must be letters, digits, '_', '.' or '-' (a metrics key)"
                + ("" if len(entry) == 3 else "; give the source a name, [PATH, WEIGHT, NAME]")
                + f", got {_show(entry)}"
            )
        for other in sources:
            if other[0] == path:
                raise UserError(f"{key} lists {path} twice; give each folder once")
            if other[2] == name:
                raise UserError(
                    f"{key} names two sources {name} ({other[0]} and {path}); name them apart "
                    "with a third element, [PATH, WEIGHT, NAME]"
                )
        sources.append([path, weight, name])
    return sources


@dataclass
class DataConfig:
    """Where the prepared shards are (one folder, or a weighted blend), and the sampling seed."""

    path: str = key(
        "data/stdlib", "folder of the prepared shards (hpcllm prepare --out)", form="a folder"
    )
    blend: BlendSources | None = key(
        None,
        "prepared folders mixed by weight, read in place of data.path (docs/data.md)",
        form=BLEND_FORM,
    )
    synthetic: bool = key(
        False,
        "random ids over model.vocab_size (null: 50257), by data.seed, instead of data.path",
    )
    seed: int = key(1234, "sampling seed", SEED)
    prefetch: int = key(4, "micro-batches read ahead", POSITIVE)
    reset_attention_at_eos: bool = key(
        False,
        "attention and positions restart after each end-of-text token of a packed sample "
        "(docs/data.md)",
    )
    mask_eod_loss: bool = key(
        False, "no loss where the input token is end-of-text (Megatron's --eod-mask-loss)"
    )


@dataclass
class TrainConfig:
    """Optimisation, precision, logging and checkpoint cadence."""

    steps: int = key(100, "optimizer steps of the run", POSITIVE)
    micro_batch_size: int = key(4, "samples per micro-batch per rank", POSITIVE)
    global_batch_size: int | None = key(
        None,
        "samples per step over all ranks; null: micro_batch_size x d (no accumulation)",
        POSITIVE,
    )
    lr: float = key(6e-4, "peak learning rate (after warm-up)", ABOVE_ZERO)
    min_lr: float = key(6e-5, "learning rate at the end of the cosine decay", OFF_AT_ZERO)
    warmup_steps: int = key(10, "steps of linear warm-up", COUNT_OR_NEVER)
    lr_decay_steps: int | None = key(None, "steps of cosine decay; null: train.steps", POSITIVE)
    lr_scaling: Literal["none", "linear"] = key(
        "none", "linear: lr x global batch / lr_reference_batch (Goyal et al.)"
    )
    lr_reference_batch: int = key(256, "the global batch train.lr was tuned for", POSITIVE)
    precision: Literal["fp32", "bf16", "fp16"] = key(
        "fp32", "compute precision (autocast; fp16 with a loss scaler)"
    )
    param_dtype: Literal["fp32", "bf16"] = key(
        "fp32", "weights and gradients; bf16 keeps fp32 masters in the distributed optimizer"
    )
    grad_clip: float = key(
        1.0, "clip the global gradient norm to this; 0: no clipping", OFF_AT_ZERO
    )
    weight_decay: float = key(0.1, "AdamW's weight decay (matrices only)", OFF_AT_ZERO)
    beta1: float = key(0.9, "AdamW's beta1", FRACTION)
    beta2: float = key(0.95, "AdamW's beta2", FRACTION)
    adam_eps: float = key(1e-8, "AdamW's epsilon", ABOVE_ZERO)
    seed: int = key(1234, "initialisation and dropout seed", SEED)
    log_interval: int = key(10, "steps between two logged steps", POSITIVE)
    eval_interval: int = key(
        50, "steps between two validations; 0: never during training", COUNT_OR_NEVER
    )
    eval_iters: int = key(10, "micro-batches of a validation", POSITIVE)
    save_interval: int = key(0, "steps between two checkpoints; 0: only at the end", COUNT_OR_NEVER)
    peak_tflops: float | None = key(
        None, "the GPU's peak TFLOP/s for MFU; null: from the device table", ABOVE_ZERO
    )
    profile_steps: str | None = key(
        None,
        "cudaProfilerStart/Stop around steps A to B-1 (nsys --capture-range)",
        form="A:B with 0 <= A < B",
    )
    # A straggler you can dial: this rank's compute takes straggler_factor times as long (it
    # sleeps (factor - 1) x its measured forward and backward time each step).
    straggler_rank: int | None = key(None, "the rank made slow on purpose; null: none", RANK)
    straggler_factor: float = key(1.0, "how many times as long its compute takes", STRAGGLE)
    max_bad_steps: int = key(
        10, "skipped steps in a row (non-finite loss or gradient) that stop the run", POSITIVE
    )


@dataclass
class RunConfig:
    """Where the run writes, and whether it resumes."""

    dir: str = key("runs/tiny", "the run folder", form="a folder that can be made here")
    resume: Literal["auto", "none"] = key(
        "auto", "auto: from the run folder's latest checkpoint if any; none: start fresh"
    )
    overwrite: bool = key(
        False, "with resume none on a folder with checkpoints: move the old run aside"
    )
    save_failure: Literal["fail", "warn"] = key(
        "fail", "a checkpoint that cannot be written ends the run, or warns and goes on"
    )
    timeout_s: float = key(
        600.0, "seconds a collective may hang before the job aborts", ABOVE_ZERO, WEEK
    )
    startup_timeout_s: float = key(
        1800.0,
        "seconds start-up and step 1 may take (MPI, rendezvous, compiling) before the job ends",
        COUNT_OR_NEVER,
        WEEK,
    )
    tensorboard: bool = key(True, "write TensorBoard events")
    reshard: bool = key(False, "resume a checkpoint of another layout (t, p, v) by re-cutting it")
    allow_unverified: bool = key(
        False, "resume from a checkpoint without a manifest (format 1, or damaged), unchecked"
    )
    keep_checkpoints: int | None = key(None, "keep the newest N checkpoints; null: all", POSITIVE)


@dataclass
class Config:
    """A whole run's configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain nested dicts (what ``config.yaml`` holds). A blended
        run's holds no ``data.path``, which it does not read (given with the blend, a file is
        refused)."""
        raw = dataclasses.asdict(self)
        if self.data.blend is not None:
            del raw["data"]["path"]
        return raw

    def dump(self, path: Path) -> None:
        """Write the config as YAML, atomically."""
        atomic_write(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


@dataclass(frozen=True)
class Field:
    """One config key as its field declares it: what :func:`fields` returns."""

    section: str
    name: str
    type: Any  # the resolved annotation
    default: Any
    help: str
    choices: tuple[str, ...] | None  # a Literal field's values
    rules: tuple[Rule, ...]
    form: str | None  # what a value must look like, where a check reads its form
    family: str | None = None  # the family whose own model key it is; None: a shared key

    def rule_text(self) -> str:
        """Return what a value must be, as the docs say it."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        if self.rules:
            return "; ".join(rule.says for rule in self.rules)
        if self.form is not None:
            return self.form
        kind = self.type_text()
        if "bool" in kind:
            return "true, false or null" if "None" in kind else "true or false"
        return kind

    @property
    def key(self) -> str:
        """Return ``section.name``, as ``--set`` and the docs write it."""
        return f"{self.section}.{self.name}"

    def type_text(self) -> str:
        """Return the type as the docs and ``--help`` print it: ``int | None``, ``str``."""
        parts = (
            typing.get_args(self.type) if isinstance(self.type, types.UnionType) else (self.type,)
        )
        names = []
        for kind in parts:
            if kind is type(None):
                names.append("None")
            elif typing.get_origin(kind) is Literal:
                names.append("str")
            elif kind == BlendSources:
                names.append("list")
            elif typing.get_origin(kind) is list:
                names.append("list[int]")
            else:
                names.append(kind.__name__)
        return " | ".join(names)


def _choices_of(annotation: Any) -> tuple[str, ...] | None:
    parts = (
        typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    )
    for kind in parts:
        if typing.get_origin(kind) is Literal:
            return tuple(typing.get_args(kind))
    return None


def fields(of: Config | str | None = None) -> list[Field]:
    """Return the keys of config ``of`` (None: the default config), or of a config of the
    family ``of`` names, section by section in field order with their rules and help (the
    model section: the keys every family shares, then the family's own)."""
    cfg = Config(model=model_config(of)) if isinstance(of, str) else of
    cfg = Config() if cfg is None else cfg
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    out = []
    for section in dataclasses.fields(Config):
        owner = type(getattr(cfg, section.name))
        part = owner()  # the declared defaults, a factory's included
        hints = typing.get_type_hints(owner)
        for f in dataclasses.fields(part):
            own = section.name == "model" and f.name not in shared
            out.append(
                Field(
                    section.name,
                    f.name,
                    hints[f.name],
                    getattr(part, f.name),
                    f.metadata["help"],
                    _choices_of(hints[f.name]),
                    tuple(f.metadata["rules"]),
                    _form(f),
                    cfg.model.arch if own else None,
                )
            )
    return out


def _form(f: dataclasses.Field) -> str | None:
    """Return what a field's value must look like, where a check reads its form (else None)."""
    form = f.metadata["form"]
    return None if form is None else text_of(form)


def show_value(value: Any) -> str:
    """Return a value as YAML writes it in a line: ``null``, ``true``, ``6e-4``, ``[2, 2]``."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return str(value)


def choices(section: str, name: str) -> tuple[str, ...] | None:
    """Return the values ``section.name`` takes, when it is a choice (else None): a shared
    key's, or a registered family's own key's."""
    every = [f for arch in families.names() for f in fields(arch)]
    return next((f.choices for f in every if (f.section, f.name) == (section, name)), None)


def config_reference() -> str:
    """Return docs/config.md: every key with its type, default, rule and description, written
    from the fields (``python -m hpcllm.config > docs/config.md``; a test compares the two):
    the model section's shared keys, then each registered family's own."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Written by `python -m hpcllm.config > docs/config.md` from the fields of",
        "hpcllm/config.py and of each family's keys; tests/test_config.py fails when this page",
        "and the fields differ. -->",
        "",
        "A config is a YAML file of five sections; `--set section.key=value` overrides one key",
        "(the value read as YAML), and `hpcllm train --print-config` prints the resolved config.",
        "Values are read with YAML 1.2's rules: `on`, `off`, `yes`, `no` are words, not booleans.",
        "Checks across keys (and against the world size) are in `hpcllm.config.check` and",
        "`hpcllm.train.preflight`.",
    ]
    shared = fields()
    for section in dataclasses.fields(Config):
        lines += ["", f"## `{section.name}`", "", _doc(section.default_factory), ""]  # type: ignore[arg-type]
        lines += _table([f for f in shared if f.section == section.name and f.family is None])
        if section.name == "model":
            lines += _family_tables()
    return "\n".join(lines) + "\n"


def _family_tables() -> list[str]:
    """Return docs/config.md's tables of each registered family's own model keys."""
    keyless = []
    tables: list[str] = []
    for arch in families.names():
        own = [f for f in fields(arch) if f.family is not None]
        if not own:
            keyless.append(arch)
            continue
        tables += ["", f"### `model`: the {arch} family's own keys", ""]
        tables += [_doc(families.get(arch).keys), "", *_table(own)]  # type: ignore[arg-type]
    lines = [
        "",
        "Every family reads these keys; a family's own keys follow, read when `model.arch` names",
        "it. Another family's key is refused unless it is null or at that family's default.",
        f"Families with no keys of their own: {', '.join(keyless) or 'none'}.",
    ]
    return lines + tables


def _doc(owner: type) -> str:
    """Return a class's docstring as one paragraph of Markdown."""
    return " ".join((owner.__doc__ or "").split()).replace("``", "`")


def _table(rows: list[Field]) -> list[str]:
    """Return the Markdown table of ``rows``: key, type, default, rule, description."""
    lines = ["| key | type | default | rule | what it is |", "| --- | --- | --- | --- | --- |"]
    for f in rows:
        cells = (f.name, f.type_text(), show_value(f.default), f.rule_text(), f.help)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_yaml(cfg: Config) -> str:
    """Return ``cfg`` as YAML with each key's description as a comment: what
    ``hpcllm train --print-config`` prints (``load_config`` reads it back)."""
    lines = []
    described = {f.key: f.help for f in fields(cfg)}
    for section, values in cfg.to_dict().items():
        lines.append(f"{section}:")
        for name, value in values.items():
            text = yaml.safe_dump(value, default_flow_style=True, width=10**6)
            text = text.removesuffix("\n").removesuffix("\n...")
            lines.append(f"  {name}: {text}  # {described[f'{section}.{name}']}")
    return "\n".join(lines) + "\n"


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
        if kind == BlendSources:
            return blend_sources(f"{section}.{key}", value)
        if (
            typing.get_origin(kind) is list
            and isinstance(value, list)
            and all(
                isinstance(v, int) and not isinstance(v, bool) and -_INT_LIMIT <= v < _INT_LIMIT
                for v in value
            )
        ):
            return list(value)
        is_text = kind is str or typing.get_origin(kind) is Literal  # choices: checked later
        if is_text and isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
    names = " or ".join(
        "null"
        if k is type(None)
        else "a list of integers"
        if typing.get_origin(k) is list
        else "str"
        if typing.get_origin(k) is Literal
        else k.__name__
        for k in allowed
    )
    raise UserError(f"{section}.{key} must be {names}, got {_show(value)}")


def _nearest(word: Any, names: list[str], prefix: str = "") -> str:
    """Return " (did you mean PREFIX+NAME?)" for the name ``word`` most likely misspells."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _apply(cfg: Config, section: Any, key: Any, value: Any) -> None:
    sections = [f.name for f in dataclasses.fields(Config)]
    if not isinstance(section, str) or section not in sections:
        raise UserError(
            f"unknown config section {_name(section)}{_nearest(section, sections)}; sections: "
            f"{', '.join(sections)}"
        )
    part = getattr(cfg, section)
    names = [f.name for f in dataclasses.fields(part)]
    if section == "model" and isinstance(key, str) and key not in names:
        if _another_familys_key(cfg.model.arch, key, value):
            return
    if not isinstance(key, str) or key not in names:
        # A guess may be another family's key: its refusal then says which setting reads it.
        guesses = names + _every_model_key() if section == "model" else names
        raise UserError(
            f"unknown key {section}.{_name(key)}{_nearest(key, guesses, section + '.')}; "
            f"{section} keys: {', '.join(names)}"
        )
    value = _coerce(section, key, _expand_path(section, key, value, type(part)), type(part))
    # The arch was resolved before any key (_resolve_arch); in its place only its type counts.
    if (section, key) != ("model", "arch"):
        setattr(part, key, value)


def _every_model_key() -> list[str]:
    """Return the model keys of every registered family, each once."""
    every = [f.name for arch in families.names() for f in dataclasses.fields(model_config(arch))]
    return list(dict.fromkeys(every))


def _another_familys_key(arch: str, key: str, value: Any) -> bool:
    """Return whether ``model.key`` is another registered family's own key, which family
    ``arch`` drops when ``value`` is null or that family's default (a run folder's config.yaml
    from before the families owned their keys holds every family's); a UserError otherwise."""
    declaring = [
        own
        for name in families.names()
        if name != arch
        and (own := families.get(name).keys) is not None
        and key in {f.name for f in dataclasses.fields(own)}
    ]
    if not declaring:
        return False
    value = _coerce("model", key, _expand_path("model", key, value, declaring[0]), declaring[0])
    if value is not None and all(value != getattr(own(), key) for own in declaring):
        raise UserError(
            f"model.{key} is not a {arch} setting (the {arch} family reads none); set it null, "
            "or choose the family that reads it (model.arch)"
        )
    return True


def _expand_path(section: str, key: str, value: Any, owner: type) -> Any:
    """Return a path's value with ``~`` and ``$VARS`` expanded (the keys whose form is a
    folder or a file path), as a shell would; anything else as it is."""
    form = _form(next(f for f in dataclasses.fields(owner) if f.name == key))
    if not isinstance(value, str) or not form or "path" not in form and "folder" not in form:
        return value
    return os.path.expandvars(os.path.expanduser(value))


def _resolve_arch(cfg: Config, raw: Any, overrides: list[str]) -> None:
    """Give ``cfg`` the model section of the family that the file data ``raw`` and then the
    overrides choose (the last ``model.arch`` given), before any key is applied: a family's
    own keys may come before the arch, in a file or on the command line."""
    given = isinstance(raw, dict) and isinstance(raw.get("model"), dict) and "arch" in raw["model"]
    arch = raw["model"]["arch"] if given else None
    for text in overrides:
        try:
            section, name, value = parse_override(text)
        except UserError:
            continue  # refused in its turn, among the other overrides
        if (section, name) == ("model", "arch"):
            given, arch = True, value
    if not given:
        return
    arch = _coerce("model", "arch", arch, ModelConfig)
    if not FAMILY.passes(arch):
        raise UserError(f"model.arch {FAMILY.says}, got {_show(arch)}")
    cfg.model = model_config(arch)


def _apply_sections(cfg: Config, raw: Any, where: str) -> None:
    """Set every ``section: {key: value}`` of ``raw`` (a file's data) on ``cfg``."""
    if not isinstance(raw, dict):
        raise UserError(f"{where} must hold a mapping of sections, got {_show(raw)}")
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise UserError(f"{where}: section {_show(section)} must be a mapping")
        for name, value in values.items():
            _apply(cfg, section, name, value)


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
        if path.is_dir():
            inside = path / "config.yaml"
            hint = f"; {inside} is one (a run folder's)" if inside.is_file() else ""
            raise UserError(f"config file {path} is a folder, not a YAML file{hint}")
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
    except DuplicateKeyError as err:
        raise UserError(f"{path}: {err}; give each key once") from None
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
    raw = None if path is None else _read_yaml_file(Path(path))
    _resolve_arch(cfg, raw, overrides or [])
    if path is not None:
        _apply_sections(cfg, {} if raw is None else raw, str(path))
    for text in overrides or []:
        _apply(cfg, *parse_override(text))
    _fill_preset(cfg.model, _given_model_keys(raw, overrides or []))
    check(cfg)
    _one_data_source(cfg, raw, overrides or [], path)
    return cfg


def _one_data_source(cfg: Config, raw: Any, overrides: list[str], path: Any) -> None:
    """Refuse ``data.path`` and ``data.blend`` given in one place (the file, or the command
    line); where the command line gives one and the file the other, the command line's
    stands, as it does for any key (a blended run's config.yaml with ``--set data.path=D``
    reads D)."""
    folder, blend = (_given(None, overrides, "data", key) for key in ("path", "blend"))
    if folder and blend and cfg.data.blend is not None:
        raise UserError(
            "data.blend and data.path are both given on the command line; a run reads a blend "
            "or one folder: give one (a folder alone is a blend of one, [[PATH, 1]])"
        )
    if folder and not blend:
        cfg.data.blend = None  # the command line's folder in place of the file's blend
        return
    if blend:
        return  # the command line's blend (or null) over the file's folder
    if _given(raw, [], "data", "path") and cfg.data.blend is not None:
        raise UserError(
            f"data.blend and data.path are both given in {path}; a run reads a blend or one "
            "folder: give one (a folder alone is a blend of one, [[PATH, 1]])"
        )


def _given(raw: Any, overrides: list[str], section: str, name: str) -> bool:
    """Return whether the file data ``raw`` or an override sets ``section.name``."""
    if any(parse_override(text)[:2] == (section, name) for text in overrides):
        return True
    return isinstance(raw, dict) and isinstance(raw.get(section), dict) and name in raw[section]


def is_given(path: str | Path | None, overrides: list[str] | None, dotted: str) -> bool:
    """Return whether the key ``dotted`` (``section.key``) is set by the config file at
    ``path`` or by an override, rather than left at its default (the file is read again)."""
    section, name = dotted.split(".", 1)
    raw = None if path is None else _read_yaml_file(Path(path))
    return _given(raw, overrides or [], section, name)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Return a Config from nested dicts (a saved ``config.yaml``), validated."""
    cfg = Config()
    _resolve_arch(cfg, raw, [])
    _apply_sections(cfg, raw, "config.yaml")
    _fill_preset(cfg.model, _given_model_keys(raw, []))
    check(cfg)
    return cfg


def _given_model_keys(raw: Any, overrides: list[str]) -> set[str]:
    """Return the model keys the file data ``raw`` or the overrides set."""
    given = (
        set(raw["model"]) if isinstance(raw, dict) and isinstance(raw.get("model"), dict) else set()
    )
    for text in overrides:
        section, name, _ = parse_override(text)
        if section == "model":
            given.add(name)
    return given


def _fill_preset(model: ModelConfig, given: set[str]) -> None:
    """Fill from ``model.preset`` every key it gives that the user did not (``given``) or
    left null; a UserError for an unknown preset, another family's, or a size none gives."""
    if model.preset is not None:
        known = families.presets()
        if model.preset not in known:
            raise UserError(
                f"unknown model.preset {_show(model.preset)}; presets: "
                f"{', '.join(known)} (or null with every size given)"
            )
        owner = families.preset_family(model.preset)
        if owner != model.arch:
            raise UserError(
                f"model.preset {model.preset} is a {owner} preset and model.arch is "
                f"{model.arch}; set model.arch={owner}, or a {model.arch} preset"
            )
        # A key whose default is not null (Llama 3's rope_theta) is the preset's too.
        for name, value in known[model.preset].items():
            if name not in given or getattr(model, name) is None:
                setattr(model, name, value)
    missing = [k for k in ("n_layer", "n_head", "d_model", "seq_len") if getattr(model, k) is None]
    if missing:
        raise UserError(f"model.{missing[0]} is not set (no preset gives it)")


# Kernel file systems, where no run folder can be made.
_PSEUDO_FILE_SYSTEMS = ("/proc", "/sys")


def _check_fields(cfg: Config) -> None:
    """Raise a UserError for the first key outside its choices, then outside its bounds
    (rule by rule, in the order of :data:`RULES`, then :data:`FAMILY`)."""
    every = fields(cfg)
    for f in every:
        value = getattr(getattr(cfg, f.section), f.name)
        if f.choices is not None and value not in f.choices and value is not None:
            raise UserError(f"{f.key} must be one of {', '.join(f.choices)}, got {_show(value)}")
    for rule in (*RULES, FAMILY):
        for f in every:
            value = getattr(getattr(cfg, f.section), f.name)
            if any(r is rule for r in f.rules) and value is not None and not rule.passes(value):
                raise UserError(f"{f.key} {rule.says}, got {_show(value)}")


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


def _check_family(m: ModelConfig, tp: int) -> None:
    """Raise a UserError for a shape the family cannot run at tensor-parallel size ``tp``."""
    family = families.get(m.arch)
    if type(m) is not _model_class(m.arch, family.keys):
        # Setting model.arch on a section built for another family would lose keys silently.
        raise TypeError(f"a {m.arch} model section is built by model_config({m.arch!r})")
    if family.check is not None:
        family.check(m, tp)


def check(cfg: Config) -> None:
    """Raise a UserError for the first setting that cannot work (sizes known without MPI).

    Reads the file system (never writes it) only to see that ``run.dir`` can be a folder.
    """
    _check_fields(cfg)
    m, train, parallel = cfg.model, cfg.train, cfg.parallel
    # A head size the family's keys set (Qwen3's head_dim) frees d_model from the heads.
    if m.d_model % m.n_head and families.get(m.arch).head_dim(m) is None:
        raise UserError(f"model.d_model {m.d_model} is not divisible by model.n_head {m.n_head}")
    if m.n_head % parallel.tp:
        raise UserError(f"model.n_head {m.n_head} is not divisible by parallel.tp {parallel.tp}")
    _check_family(m, parallel.tp)
    _check_moe(m, parallel.tp)
    check_ep(cfg)
    check_cp(cfg)
    if parallel.sequence_parallel and parallel.tp > 1 and m.seq_len % parallel.tp:
        raise UserError(
            f"parallel.sequence_parallel splits model.seq_len {m.seq_len} over "
            f"parallel.tp {parallel.tp} ranks; use a seq_len divisible by {parallel.tp}"
        )
    if train.min_lr > train.lr:
        raise UserError(f"train.min_lr {train.min_lr} is above train.lr {train.lr}")
    if train.global_batch_size is not None and train.global_batch_size % train.micro_batch_size:
        raise UserError(
            f"train.global_batch_size {train.global_batch_size} is not a multiple of "
            f"train.micro_batch_size {train.micro_batch_size}"
        )
    if parallel.distributed_optimizer and parallel.dp_engine == "ps":
        raise UserError(
            "parallel.distributed_optimizer applies to the ddp and horovod engines; the ps "
            "baseline keeps the whole optimizer on its server"
        )
    if parallel.distributed_optimizer and parallel.dp_compression != "none":
        raise UserError(
            "parallel.distributed_optimizer reduce-scatters uncompressed gradients; set "
            "parallel.dp_compression: none"
        )
    if train.param_dtype == "bf16" and train.precision != "bf16":
        raise UserError(
            f"train.param_dtype: bf16 computes in bf16; set train.precision: bf16 (not "
            f"{train.precision})"
        )
    if train.param_dtype == "bf16" and not parallel.distributed_optimizer:
        raise UserError(
            "train.param_dtype: bf16 keeps its fp32 master weights in the distributed "
            "optimizer; set parallel.distributed_optimizer: true (at any d, 1 included)"
        )
    if parallel.dp_compression != "none" and parallel.dp_engine in ("ps", "ps-async", "local-sgd"):
        raise UserError(
            f"parallel.dp_compression applies to ddp and horovod, not {parallel.dp_engine}"
        )
    if parallel.dp_engine in ("ps-async", "local-sgd"):
        _check_async(cfg)
        if m.moe_experts and m.moe_router == "sigmoid" and m.moe_bias_rate:
            raise UserError(
                f"model.moe_router sigmoid moves its balancing bias by every rank's loads at "
                f"every step, which {parallel.dp_engine} has no step for; set "
                "model.moe_bias_rate: 0 or use ddp, horovod or ps"
            )
    if parallel.dp_compression == "bf16" and parallel.dp_engine == "horovod":
        raise UserError(
            "Horovod compresses to fp16 only; use parallel.dp_compression: fp16 or none"
        )
    if train.profile_steps is not None:
        parse_profile_steps(train.profile_steps)
    if not cfg.data.path or "\x00" in cfg.data.path:
        raise UserError(f"data.path must be a folder path, got {_show(cfg.data.path)}")
    if cfg.data.blend is not None and cfg.data.synthetic:
        raise UserError(
            "data.synthetic reads no folder, so it cannot blend data.blend's; set one of them"
        )
    if cfg.data.synthetic and (cfg.data.reset_attention_at_eos or cfg.data.mask_eod_loss):
        which = "reset_attention_at_eos" if cfg.data.reset_attention_at_eos else "mask_eod_loss"
        raise UserError(
            f"data.{which} acts at end-of-text tokens, which data.synthetic's random ids do not "
            "have; prepare data (hpcllm prepare) or set it false"
        )
    check_folder("run.dir", cfg.run.dir)


def check_ep(cfg: Config) -> None:
    """Refuse an expert-parallel size that cannot work, in one line (nothing at ep = 1)."""
    m, parallel = cfg.model, cfg.parallel
    if parallel.ep == 1:
        return
    if not m.moe_experts:
        raise UserError(
            f"parallel.ep {parallel.ep} splits the experts of MoE blocks, but model.moe_experts "
            "is 0 (every MLP dense); set parallel.ep: 1"
        )
    if m.moe_experts % parallel.ep:
        raise UserError(
            f"parallel.ep {parallel.ep} does not divide model.moe_experts {m.moe_experts}"
        )
    if parallel.dp is not None and parallel.dp % parallel.ep:
        raise UserError(
            f"parallel.ep {parallel.ep} must divide the data-parallel size d = {parallel.dp} "
            "(the expert-parallel ranks are carved out of d)"
        )
    if parallel.dp_engine in ("ps", "ps-async", "local-sgd"):
        raise UserError(
            f"parallel.dp_engine {parallel.dp_engine} averages every parameter over d, but at "
            f"parallel.ep {parallel.ep} the ranks of d hold different experts; use ddp or horovod"
        )


def check_cp(cfg: Config) -> None:
    """Refuse a context-parallel size that cannot work, in one line (nothing at cp = 1)."""
    m, parallel = cfg.model, cfg.parallel
    if parallel.cp == 1:
        return
    sp = parallel.sequence_parallel and parallel.tp > 1
    cut = 2 * parallel.cp * (parallel.tp if sp else 1)
    if m.seq_len % cut:
        how = f"2 x cp x t = {cut} parts" if sp else f"2 x cp = {cut} chunks"
        raise UserError(
            f"parallel.cp {parallel.cp} cuts model.seq_len {m.seq_len} into {how}; use a "
            f"seq_len divisible by {cut}"
        )
    if parallel.ep > 1:
        raise UserError(
            f"parallel.cp {parallel.cp} with parallel.ep {parallel.ep}: expert parallelism is "
            "not carved out of d x cp; set one of them to 1"
        )
    if m.moe_experts:
        raise UserError(
            f"parallel.cp {parallel.cp} with model.moe_experts {m.moe_experts}: the MoE blocks' "
            "balancing loss and capacity count one rank's tokens, not the sequence's; train "
            "mixtures of experts at parallel.cp: 1"
        )
    if parallel.dp_engine in ("ps-async", "local-sgd"):
        raise UserError(
            f"parallel.dp_engine {parallel.dp_engine} lets replicas step apart, but the "
            f"parallel.cp {parallel.cp} ranks of a sequence must step together; use ddp, "
            "horovod or ps"
        )


def _check_moe(m: ModelConfig, tp: int) -> None:
    """Refuse an MoE setting that cannot work, in one line (nothing when moe_experts is 0)."""
    if not m.moe_experts:
        return
    if m.moe_top_k > m.moe_experts:
        raise UserError(f"model.moe_top_k {m.moe_top_k} is above model.moe_experts {m.moe_experts}")
    if m.moe_top_k == 1 and m.moe_renormalize:
        raise UserError(
            "model.moe_renormalize with model.moe_top_k 1 weighs every token 1, so the router "
            "learns nothing; use moe_top_k >= 2 or moe_renormalize: false"
        )
    outside = [i for i in m.moe_dense_layers or () if not 0 <= i < m.n_layer]
    if outside:
        raise UserError(
            f"model.moe_dense_layers names block {outside[0]}; blocks are 0 to {m.n_layer - 1}"
        )
    if not moe_layers(m):
        raise UserError(
            f"model.moe_experts {m.moe_experts} but no block is MoE (moe_every {m.moe_every}, "
            f"moe_first_dense {m.moe_first_dense}, moe_dense_layers {m.moe_dense_layers}); "
            "set moe_experts: 0 for a dense model"
        )
    if m.moe_shared_gate and not m.moe_shared_ffn_size:
        raise UserError(
            "model.moe_shared_gate gates a shared expert; set model.moe_shared_ffn_size"
        )
    for name in ("moe_ffn_size", "moe_shared_ffn_size"):
        width = getattr(m, name)
        if width and width % tp:
            raise UserError(f"model.{name} {width} is not divisible by parallel.tp {tp}")


def _check_async(cfg: Config) -> None:
    """Refuse what ps-async and local-sgd do not do, in one line each."""
    train, parallel = cfg.train, cfg.parallel
    if parallel.tp > 1 or parallel.pp > 1:
        raise UserError(
            f"parallel.dp_engine: {parallel.dp_engine} runs data parallelism alone; set "
            f"parallel.tp and parallel.pp to 1 (got tp {parallel.tp}, pp {parallel.pp})"
        )
    if parallel.distributed_optimizer:
        raise UserError(
            f"parallel.distributed_optimizer applies to the ddp and horovod engines, not "
            f"{parallel.dp_engine}"
        )
    if parallel.dp_engine == "ps-async" and train.precision == "fp16":
        raise UserError(
            "parallel.dp_engine: ps-async has no loss scale shared by its workers; use "
            "train.precision bf16 or fp32"
        )
    if parallel.dp_engine == "local-sgd" and train.save_interval % parallel.local_sgd_steps:
        raise UserError(
            f"train.save_interval {train.save_interval} is not a multiple of "
            f"parallel.local_sgd_steps {parallel.local_sgd_steps}: a checkpoint averages the "
            "replicas, which must fall where the run averages anyway"
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


@dataclass(frozen=True)
class BatchPlan:
    """How a step's samples divide over ranks and micro-batches, computed in one place (what
    Megatron-LM's num-microbatches calculator does): ``global_batch = micro_batch_size x
    accumulation x dp``."""

    micro_batch_size: int  # samples of one micro-batch on one rank
    accumulation: int  # micro-batches per step on each rank
    dp: int  # data-parallel replicas

    @property
    def micro_step(self) -> int:
        """Return the samples of one micro-batch on every rank: micro_batch_size x dp."""
        return self.micro_batch_size * self.dp

    @property
    def samples_per_rank(self) -> int:
        """Return the samples one rank trains on per step: micro_batch_size x accumulation."""
        return self.micro_batch_size * self.accumulation

    @property
    def global_batch(self) -> int:
        """Return the samples of one step over every rank."""
        return self.micro_step * self.accumulation

    @staticmethod
    def divides(global_batch: int, micro_batch_size: int, dp: int) -> bool:
        """Return whether micro-batches of ``micro_batch_size`` on ``dp`` ranks make up
        ``global_batch`` samples (a whole number of them per rank)."""
        return global_batch % (micro_batch_size * dp) == 0

    @classmethod
    def of(
        cls,
        global_batch: int | None,
        micro_batch_size: int,
        dp: int,
        name: str = "train.global_batch_size",
        dp_name: str = "dp",
    ) -> BatchPlan:
        """Return the plan of ``global_batch`` samples a step (None: one micro-batch per rank,
        no accumulation); a UserError (naming them ``name`` and ``dp_name``) unless
        micro_batch_size x dp divides it."""
        one = cls(micro_batch_size, 1, dp)
        if global_batch is None:
            return one
        if not cls.divides(global_batch, micro_batch_size, dp):
            raise UserError(
                f"{name} {global_batch} is not a multiple "
                f"of micro_batch_size x {dp_name} = {micro_batch_size} x {dp}"
            )
        return cls(micro_batch_size, global_batch // one.micro_step, dp)


def batch_plan(train: TrainConfig, dp: int) -> BatchPlan:
    """Return the run's batch plan at data-parallel size ``dp``."""
    return BatchPlan.of(train.global_batch_size, train.micro_batch_size, dp)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """Return the vocabulary padded to a multiple of 128·t (Megatron's rule)."""
    multiple = 128 * tp
    return -(-vocab_size // multiple) * multiple


if __name__ == "__main__":
    print(config_reference(), end="")
