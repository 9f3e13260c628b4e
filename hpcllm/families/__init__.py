"""Model families: the one seam through which the trainer, re-cut, convert, FLOPs, the planner
and generation reach a model, selected by ``model.arch``.

A family is two halves. Its **spec** (a :class:`Family`, in a module of this package) is
torch-free, so the config layer and the planner import it without torch: its own config
keys (:attr:`Family.keys`) and its presets, FLOPs per step (forward, backward,
recomputation), parameter count, activation memory per layer, the GEMMs of one layer, the
partition rule of every tensor (:class:`TensorRule`: the dimension split over t or
replicated, how its gradient is reduced, which pipeline stage holds it) and its Hugging Face
names. Its **torch half** is a module class named by :attr:`Family.module`
(``"package.module:Class"``), imported on first use (:func:`model_class`); it builds one
pipeline stage (``layers``, ``pre``, ``post``) and generates. Nothing outside
``hpcllm.model`` and this package names a family's modules.

Built in: ``gpt2`` (:mod:`hpcllm.families.gpt2`) and ``llama``
(:mod:`hpcllm.families.llama`). A family defined elsewhere registers itself with
:func:`register` when its module is imported; the modules named in the ``HPCLLM_FAMILIES``
environment variable (comma-separated) and the ``hpcllm.families`` entry points are imported
on the first lookup, in every rank alike.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpcllm.user_error import UserError

# The model.seq_len a model imported from Hugging Face trains at when its positions hold no
# weights (rotary) and its config.json gives a longer context (Llama 3.1's 131,072), one
# sample of which would not fit a small corpus: transformers' default LlamaConfig
# max_position_embeddings, Llama 1's context. --set model.seq_len=N, before the first step,
# trains it at another length; the export writes the longer context back.
IMPORTED_SEQ_LEN = 2048

# The split of a tensor over the tensor-parallel ranks: (dimension, stride); None: replicated.
Split = tuple[int, int] | None


@dataclass(frozen=True)
class TensorRule:
    """Where the tensors whose whole-model names match ``pattern`` live, and how.

    ``split``: the dimension cut over t and its stride (3 for a fused q|k|v), or None for a
    tensor every tp rank holds whole. ``grad``: how its gradient becomes whole across the tp
    group: ``"local"`` (each rank's slice is its own), ``"tp-sum-if-sequence-parallel"`` (a
    replicated tensor that sees 1/t of the tokens under sequence parallelism),
    ``"kv-replicas"`` (split by head, or, with fewer heads than ranks, each head on the ranks
    that use it: their gradients summed, the copies counted once), ``"tp-sum"`` (whole on
    every rank, which applies it to its own heads: summed over t). ``stage``:
    ``"first"``, ``"last"``, ``"first+last"`` (tied: a copy on each, gradients summed) or
    ``"block"`` (the stage holding the block of the name's index). ``padded``: its rows are
    the vocabulary, padded with zero rows to a multiple of 128·t (dropped when merged whole).
    ``experts``: its first dimension indexes the routed experts, which expert parallelism
    splits over the ep ranks in contiguous blocks (rank r holds experts r·E/ep to (r+1)·E/ep−1).
    """

    pattern: str
    split: Split
    grad: str  # "local", "tp-sum-if-sequence-parallel", "kv-replicas", "tp-sum" (docstring)
    stage: str
    padded: bool = False
    experts: bool = False  # dim 0 is the expert: split over the ep ranks in contiguous blocks

    def matches(self, name: str) -> bool:
        """Return whether ``name`` (a whole-model parameter name) is one of these tensors."""
        return re.fullmatch(self.pattern, name) is not None


@dataclass(frozen=True)
class HFTensor:
    """One tensor's Hugging Face name: ``ours`` and ``theirs`` with ``{i}`` for the block index;
    ``transpose`` where they store the transpose of ours (GPT-2's Conv1D).

    ``{e}`` in ``theirs``: they store one tensor per routed expert where ours stacks them
    along dim 0 (Mixtral's ``experts.{e}.w1``). ``part`` (dim, index, count): theirs fuses
    ``count`` of ours along ``dim``, ours being chunk ``index`` (transformers' stacked
    ``gate_up_proj``). ``alternative``: another form of a tensor named before it, read where a
    checkpoint lacks the first form's tensors and never written. ``one_expert``: ours holds
    theirs as the one expert of a stack (a shared expert: (1, rows, cols) against theirs'
    (rows, cols)). ``kinds``: the config.json model_types whose checkpoints name the tensor so
    (Mixtral's ``block_sparse_moe`` against Qwen-MoE's ``mlp``); empty: every kind the family
    reads.
    """

    ours: str
    theirs: str
    transpose: bool = False
    part: tuple[int, int, int] | None = None
    alternative: bool = False
    one_expert: bool = False
    kinds: tuple[str, ...] = ()

    @property
    def per_expert(self) -> bool:
        """Return whether ours stacks theirs along dim 0 (one per routed expert, or one)."""
        return "{e}" in self.theirs or self.one_expert


@dataclass(frozen=True)
class HFSize:
    """A size of a Hugging Face config.json beside what the checkpoint's tensors say it is, so
    that an import whose config.json disagrees with its weights names the key to fix.

    ``given`` is config.json's value (``absent``: it has none, and ``given`` is what
    transformers assumes); ``implied`` the tensors' value; ``evidence`` says which tensor says
    so and how ("model.embed_tokens.weight has 64 columns").
    """

    key: str
    given: Any
    implied: int
    evidence: str
    absent: bool = False

    def disagreement(self, where: str) -> str | None:
        """Return the one line that says ``where`` (config.json's path) is wrong, or None."""
        if self.given == self.implied:
            return None
        said = (
            f"gives no {self.key} (so {self.given}, as transformers assumes)"
            if self.absent
            else f"gives {self.key} {self.given}"
        )
        return f"{where} {said} but {self.evidence}; set {self.key}: {self.implied} in config.json"


@dataclass(frozen=True)
class Shape:
    """What the torch-free formulas need of a model: its sizes."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    kv_heads: int | None = None  # None: as many as heads
    ffn: int | None = None  # the MLP's width; None: 4·hidden
    tied: bool = True  # the output layer is the token embedding
    head_dim: int | None = None  # each head's width; None: hidden / heads
    qkv_bias: bool = False  # biases on the query, key and value projections
    qk_norm: bool = False  # a norm (head_dim weights) over each head's queries and keys

    @property
    def head_size(self) -> int:
        """Return each attention head's width."""
        return self.head_dim or self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """Return the queries' width, heads × head size (hidden, unless head_dim is free)."""
        return self.heads * self.head_size


@dataclass(frozen=True)
class Family:
    """A model family's torch-free spec (see the module docstring)."""

    name: str
    module: str  # "package.module:Class", the torch half
    presets: Mapping[str, Mapping[str, Any]]
    # FLOPs of one step on ``batch`` sequences: (batch, shape, recompute) -> FLOPs.
    step_flops: Callable[[int, Shape, str], float]
    parameters: Callable[[Shape], int]
    # One layer's parameters: (split over t, whole on every tp rank).
    layer_parameters: Callable[[Shape], tuple[int, int]]
    # The first stage's parameters outside the layers on one rank at t (embeddings), and the
    # last's (what follows the layers; a tied output layer is the embedding, counted once).
    first_parameters: Callable[[Shape, int], float]
    last_parameters: Callable[[Shape, int], float]
    # Bytes of activations one layer keeps per token and per (2-byte) hidden value, as
    # Korthikanti et al. count them: (shape, t, sequence_parallel, flash) -> factor of s·b·h.
    activation_factor: Callable[[Shape, int, bool, bool], float]
    # One layer's GEMMs for ``rows`` tokens at t: (rows, shape, t) -> [(M, N, K), ...].
    layer_gemms: Callable[[int, Shape, int], list[tuple[int, int, int]]]
    tensors: tuple[TensorRule, ...]
    # The weight matrices of the dense MLP (GeLU's 2, SwiGLU's 3): what one token's pass
    # through an MLP of width f costs, 2·h·f FLOPs each, which MoE blocks count per expert.
    mlp_matrices: int = 2
    hf_tensors: tuple[HFTensor, ...] = ()
    hf_model_type: str | None = None  # config.json's model_type
    # Further model_types the family reads (Llama: Mixtral, Qwen2, Qwen3 and their MoEs).
    hf_model_types_also: tuple[str, ...] = ()
    # The model_type a model config is exported as, its tensors named as that kind's
    # checkpoints name them (HFTensor.kinds): (model config) -> model_type. None: hf_model_type.
    hf_model_type_of: Callable[[Any], str] | None = None
    # Hugging Face config.json out: (model config, vocabulary, {"bos_token_id": ...,
    # "eos_token_id": ...}) -> dict; and in: (config.json as a dict, its path for messages)
    # -> model.* keys (a UserError where the family cannot hold that model; a KeyError names
    # a key config.json lacks).
    hf_config: Callable[[Any, int, dict[str, Any]], dict] | None = None
    model_keys_of_hf: Callable[[dict, str], dict[str, Any]] | None = None
    # The config.json sizes that a checkpoint's tensors give: (config.json, the shape of every
    # tensor by its Hugging Face name) -> [HFSize], in the order to compare them (a wrong
    # hidden size makes the sizes derived from it meaningless, so it comes first).
    hf_sizes: Callable[[dict, Mapping[str, tuple[int, ...]]], list[HFSize]] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Whether a weight's shape depends on model.seq_len (GPT-2's learned positions do;
    # rotary positions do not, so such a model may train at another length).
    seq_in_weights: bool = True
    # The planner's pointwise traffic of one layer besides its norms and residual adds:
    # values read and written per token by the ops split over t (the MLP's activation, and
    # Llama's rotation of q and k), at tensor-parallel size t: (shape, t) -> values.
    split_pointwise_values: Callable[[Shape, int], float] = lambda shape, t: 8 * shape.hidden / t
    # Whether the linear layers have biases (their gradients: a reduction in the backward).
    biases: bool = True
    # Whether the output layer is tied to the embedding, by the model config (the rules'
    # ``first+last`` tensors are tied only then).
    ties: Callable[[Any], bool] = lambda _model: True
    # Checks of a model config at tensor-parallel size t: (model config, t) -> None, a
    # UserError where the family cannot run it.
    check: Callable[[Any, int], None] | None = None
    # The Shape fields beyond the common sizes, from a model config (kv_heads, ffn, tied).
    shape_extra: Callable[[Any], dict[str, Any]] = lambda _model: {}
    # Each attention head's width where the model config sets one other than d_model /
    # n_head (Qwen3's head_dim), else None: (model config) -> int | None.
    head_dim: Callable[[Any], int | None] = lambda _model: None
    # The inverse: the family's own model.* keys that give a Shape's extra fields, so that a
    # planned shape is written as a config (``hpcllm plan --write-config``): (shape) -> keys.
    keys_of_shape: Callable[[Shape], dict[str, Any]] = lambda _shape: {}
    # The family's own model.* keys: a dataclass whose fields are declared as every config
    # key is (``hpcllm.keys.key``: default, description, rules); the model section is the
    # keys every family shares plus these (``hpcllm.config.model_config``). None: the shared
    # keys only.
    keys: type | None = None
    # A plain PyTorch model of the family, "package.module:Class", the baseline ``hpcllm
    # bench step`` measures hpcllm against: built as Class(model config, vocabulary, seed=)
    # and called as (ids, labels) -> mean loss. None: the family registers no baseline.
    reference: str | None = None
    # ``--set`` items the bench's smoke shape adds for this family (Llama: 2 key/value heads).
    bench_keys: tuple[str, ...] = ()

    def hf_kind(self, model: Any) -> str | None:
        """Return the config.json model_type ``model`` (a model config) is written as."""
        return self.hf_model_type if self.hf_model_type_of is None else self.hf_model_type_of(model)

    def rule(self, name: str) -> TensorRule:
        """Return the rule of a whole-model parameter name (the MoE part's, every family's
        alike, then the family's own); a ValueError where none matches."""
        for rule in (*MOE_TENSORS, *self.tensors):
            if rule.matches(name):
                return rule
        raise ValueError(f"family {self.name}: no tensor rule matches {name}")


# The MoE MLP part (hpcllm.model.moe) of any family's block: stacked experts (E, rows, cols)
# split over t as the dense MLP's matrices are (the routed ones over ep as well, by expert),
# the router, the shared expert's gate, the proj biases (added on the token's own rank) and
# the sigmoid router's balancing bias (a buffer) whole on every rank.
_MOE = r"blocks\.\d+\.mlp\."
MOE_TENSORS = (
    TensorRule(_MOE + r"experts\.(gate|up|fc|fc_bias)", (1, 1), "local", "block", experts=True),
    TensorRule(_MOE + r"experts\.proj", (2, 1), "local", "block", experts=True),
    TensorRule(_MOE + r"shared\.(gate|up|fc|fc_bias)", (1, 1), "local", "block"),
    TensorRule(_MOE + r"shared\.proj", (2, 1), "local", "block"),
    TensorRule(
        _MOE + r"((experts|shared)\.proj_bias|router\.weight|shared_gate\.weight)",
        None,
        "tp-sum-if-sequence-parallel",
        "block",
    ),
    TensorRule(_MOE + r"bias", None, "local", "block"),
)


def hf_layer_count(shapes: Mapping[str, Any], prefix: str) -> int | None:
    """Return how many blocks a checkpoint's tensor names hold (``prefix`` + index + "."),
    None where it holds none or their indices are not 0 to n - 1."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = {int(m.group(1)) for name in shapes if (m := pattern.match(name))}
    return len(found) if found and found == set(range(len(found))) else None


_REGISTRY: dict[str, Family] = {}
_PLUGINS_LOADED = False


def register(family: Family) -> Family:
    """Add ``family`` to the registry under its name (again: replaced) and return it."""
    _REGISTRY[family.name] = family
    return family


def _load_plugins() -> None:
    """Import the built-in families, then those of HPCLLM_FAMILIES and the entry points."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    importlib.import_module("hpcllm.families.gpt2")
    importlib.import_module("hpcllm.families.llama")
    names = [n.strip() for n in os.environ.get("HPCLLM_FAMILIES", "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise UserError(f"HPCLLM_FAMILIES names {name}, which does not import: {err}") from None
    from importlib.metadata import entry_points

    for point in entry_points(group="hpcllm.families"):
        point.load()


def names() -> list[str]:
    """Return the registered families' names."""
    _load_plugins()
    return sorted(_REGISTRY)


def get(arch: str) -> Family:
    """Return the family ``model.arch`` names; a UserError naming the known ones otherwise."""
    _load_plugins()
    if arch not in _REGISTRY:
        raise UserError(
            f"model.arch {arch!r} is not a model family; known: {', '.join(sorted(_REGISTRY))} "
            "(a family defined elsewhere is registered by naming its module in HPCLLM_FAMILIES)"
        )
    return _REGISTRY[arch]


def presets() -> dict[str, dict[str, Any]]:
    """Return every family's presets, by name (a name is one family's)."""
    _load_plugins()
    found: dict[str, dict[str, Any]] = {}
    for family in _REGISTRY.values():
        for name, sizes in family.presets.items():
            found[name] = dict(sizes)
    return found


def preset_family(preset: str) -> str | None:
    """Return the name of the family whose preset ``preset`` is (None: no family's)."""
    _load_plugins()
    return next((f.name for f in _REGISTRY.values() if preset in f.presets), None)


def by_hf_model_type() -> dict[str, Family]:
    """Return the families that read Hugging Face checkpoints, by config.json's model_type."""
    _load_plugins()
    found = {}
    for family in _REGISTRY.values():
        if family.hf_model_type:
            for kind in (family.hf_model_type, *family.hf_model_types_also):
                found[kind] = family
    return found


def shape(model: Any, vocab: int) -> Shape:
    """Return the sizes of a model config (``cfg.model``) with vocabulary ``vocab``."""
    family = get(model.arch)
    base = Shape(model.n_layer, model.d_model, model.n_head, model.seq_len, vocab)
    extra = family.shape_extra(model)
    return Shape(**{**base.__dict__, **extra}) if extra else base


def _import(spec: str) -> Any:
    """Return the object a "package.module:Name" string names, imported now."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def model_class(arch: str) -> type:
    """Return the torch half of family ``arch``: its module class, imported now."""
    return _import(get(arch).module)


def reference_class(arch: str) -> type:
    """Return family ``arch``'s plain PyTorch model (the bench's baseline), imported now; a
    UserError where the family registers none."""
    family = get(arch)
    if family.reference is None:
        raise UserError(
            f"model family {arch} registers no plain PyTorch model to measure against "
            "(Family.reference); bench step compares a family with its own baseline only"
        )
    return _import(family.reference)
