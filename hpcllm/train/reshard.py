"""Checkpoints of any layout, read whole or re-cut for another (t, p, v, d).

A checkpoint holds one file per (tp, pp) rank. Pipeline rank r's file holds its v chunks
(chunk c is stage c·p + r, keys ``c.blocks.7.…``; with p = 1 the whole GPT's keys), each
tensor-parallel rank's slice of the split weights, and the Adam moments of those slices,
numbered as that rank's optimizer numbered its parameters (:func:`rank_parameters`).
Re-cutting goes through the names of the whole model:

1. the stage cut of the saved layout says which files hold a name (a block's stage, the
   embedding on the first stage with its tied copy on the last, the final LayerNorm on the
   last), and only those files are read, memory-mapped, so the Adam moments are not even
   read when only weights are wanted;
2. the tp slices of a name (a parameter, or a persistent buffer, split as its family's rule
   says) are merged with the partition its layer declares (``stride`` 3 for the fused q|k|v
   projection), and the embedding's vocabulary padding is dropped;
3. for the new layout each rank's names are listed in its chunks' state order, cut
   again (the vocabulary padded to 128·t with zeros), and its parameters numbered as
   :func:`hpcllm.train.optim.build_optimizer` numbers them.

The optimizer step, loss scale, data position, skipped-step count and the random states
carry over, and so does every other named part of the checkpoint (the same on every rank:
tp rank 0, pp rank 0's). Expert parallelism needs none either: a checkpoint holds every
expert whole (:mod:`hpcllm.parallel.data.experts`). Data parallelism needs no re-cut: the d
replicas hold the same state (dp rank 0 saved it), and a run resumed at another d reads the
same global batches as long as the global batch is the same.

Why not ``torch.distributed.checkpoint``: its planners re-cut tensors that are contiguous
chunks of a global tensor (DTensor, ShardedTensor). Ours are not: the q|k|v projection's
slice on a tp rank is three separate row blocks, the embedding's row count depends on t
(padding), the tied embedding lives on two stages, and the optimizer state is keyed by
per-rank indices. Describing those to its planners would take more code than merging them,
and the checkpoint format keeps its manifest and checksums (:mod:`hpcllm.train.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from hpcllm import families
from hpcllm.config import (
    BatchPlan,
    Config,
    ModelConfig,
    check_cp,
    check_ep,
    config_from_dict,
    load_yaml,
    padded_vocab,
)
from hpcllm.errors import UserError
from hpcllm.files import new_folder
from hpcllm.model import build
from hpcllm.model.stages import split_layers
from hpcllm.parallel.roles import replicas, role
from hpcllm.parallel.tensor.layers import merge_shards, shard_of
from hpcllm.train import checkpoint
from hpcllm.train import run_dir as run_folder
from hpcllm.train.parallelize import check_pipeline


@dataclass(frozen=True)
class Cut:
    """How a model is cut: tensor-parallel size, pipeline ranks, chunks per rank, stage cut."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    pipeline_layers: tuple[int, ...] | None = None

    @classmethod
    def of(cls, cfg: Config) -> Cut:
        """Return the layout a config asks for."""
        parallel = cfg.parallel
        layers = tuple(parallel.pipeline_layers) if parallel.pipeline_layers else None
        return cls(
            parallel.tp,
            parallel.pp,
            parallel.vpp if parallel.pp > 1 else 1,
            layers if parallel.pp > 1 else None,
        )

    def stages(self, n_layer: int) -> list[range]:
        """Return each stage's block indices (stage c·p + r is chunk c of pipeline rank r)."""
        try:
            return split_layers(n_layer, self.pp * self.vpp, self.pipeline_layers)
        except ValueError as err:
            raise UserError(str(err)) from None

    def same_as(self, other: Cut, n_layer: int) -> bool:
        """Return whether every rank of ``other`` holds what the same rank here holds."""
        return (self.tp, self.pp, self.vpp) == (other.tp, other.pp, other.vpp) and self.stages(
            n_layer
        ) == other.stages(n_layer)

    def __str__(self) -> str:
        text = f"tp={self.tp}, pp={self.pp}"
        if self.vpp > 1:
            text += f", vpp={self.vpp}"
        if self.pipeline_layers:
            text += f", pipeline_layers={list(self.pipeline_layers)}"
        return text


@dataclass(frozen=True)
class Param:
    """One parameter of the whole model: its rank and how tensor parallelism slices it."""

    name: str
    dim: int
    partition: tuple[int, int] | None  # (dim, stride) of the tp slices; None: whole on every rank
    padded: bool = False  # vocabulary rows, padded to a multiple of 128·t
    grad: str = "local"  # its rule's gradient kind: "kv-replicas" is kept on t / heads ranks
    kv_heads: int = 1  # the model's key/value heads
    buffer: bool = False  # a persistent buffer: saved and re-cut like a weight, not optimized

    def replicas(self, tp: int) -> int:
        """Return how many tp ranks of ``tp`` hold each slice (1 but for kv heads)."""
        return replicas(self.grad, tp, self.kv_heads)


def _stage(cfg: ModelConfig, layers: range, pre: bool, post: bool) -> list[Param]:
    # The model's own constructor on the meta device: names, order and partitions without
    # a byte of weights, and no second copy of the rules that place them.
    with torch.device("meta"):
        stage = build(cfg, 1, layers=layers, pre=pre, post=post)
    family = families.get(cfg.arch)
    kv = families.shape(cfg, 1).kv_heads or cfg.n_head
    weights = dict(stage.named_parameters())
    params = []
    # In state_dict order: the parameters, and the persistent buffers a state_dict holds too
    # (a buffer's split is its rule's: buffers carry no role, which a move would drop).
    for name, tensor in stage.state_dict(keep_vars=True).items():
        rule = family.rule(name)
        if name in weights:
            part = role(tensor)
            params.append(Param(name, tensor.dim(), part.split, part.padded, rule.grad, kv))
        else:
            params.append(Param(name, tensor.dim(), rule.split, rule.padded, rule.grad, kv, True))
    return params


def rank_parameters(cfg: ModelConfig, layout: Cut, pp_rank: int) -> list[list[Param]]:
    """Return a pipeline rank's parameters, one list per chunk, in the chunks' module order.

    The optimizer numbers them as :func:`optimizer_order` gives.
    """
    stages = layout.stages(cfg.n_layer)
    last = len(stages) - 1
    return [
        _stage(cfg, stages[stage], stage == 0, stage == last)
        for stage in range(pp_rank, len(stages), layout.pp)
    ]


def optimizer_order(chunks: list[list[Param]]) -> list[tuple[int, Param]]:
    """Return (chunk, parameter) in the optimizer's index order: matrices, then the rest
    (buffers, which no optimizer holds, left out)."""
    flat = [(c, param) for c, params in enumerate(chunks) for param in params if not param.buffer]
    return [item for item in flat if item[1].dim >= 2] + [item for item in flat if item[1].dim < 2]


def _key(layout: Cut, chunk: int, name: str) -> str:
    # As hpcllm.model.stages.chunks_state_dict keys them.
    return name if layout.pp == 1 else f"{chunk}.{name}"


def checkpoint_config(folder: Path) -> Config:
    """Return the config a checkpoint was saved with (its own config.yaml)."""
    path = Path(folder) / "config.yaml"
    try:
        return config_from_dict(load_yaml(path.read_text()))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        # A read that fails on one rank only (a file system hiccup) must still be told.
        raise UserError(f"{path} is unreadable ({err})", same_on_all_ranks=False) from None
    except UserError as err:
        raise UserError(f"{path} (the checkpoint's config): {err}") from None


def saved_layout(folder: Path) -> Cut:
    """Return the layout a checkpoint was saved in."""
    meta = checkpoint.read_meta(folder)
    saved = Cut.of(checkpoint_config(folder))
    # meta.json is what the files are cut by; the config says how the stages were split.
    pp = meta["pp"]
    return replace(
        saved,
        tp=meta["tp"],
        pp=pp,
        vpp=saved.vpp if pp > 1 else 1,
        pipeline_layers=saved.pipeline_layers if pp > 1 else None,
    )


class SavedState:
    """A checkpoint's state by whole-model parameter name, read file by file on demand."""

    def __init__(self, folder: Path, *, verified: bool = False, optimizer: bool = True) -> None:
        self.folder = Path(folder)
        self.verified = verified  # every file already checked against the manifest
        # False: the optimizer state is never read (weights only; has_optimizer says False).
        self.skip = () if optimizer else ("optimizer",)
        self.meta = checkpoint.read_meta(self.folder)
        self.cfg = checkpoint_config(self.folder)
        self.layout = saved_layout(self.folder)
        self.vocab = self.meta.get("vocab_size") or self.cfg.model.vocab_size
        if not self.vocab:
            raise UserError(f"{self.folder / 'meta.json'} lacks vocab_size")
        self._where: dict[str, tuple[int, int]] = {}  # name -> (pp rank, chunk), first stage
        self._index: dict[int, dict[str, int]] = {}  # pp rank -> name -> optimizer index
        self.params: dict[str, Param] = {}
        first: dict[str, int] = {}  # name -> the earliest stage holding it
        for rank in range(self.layout.pp):
            chunks = rank_parameters(self.cfg.model, self.layout, rank)
            for chunk, params in enumerate(chunks):
                stage = chunk * self.layout.pp + rank
                for param in params:
                    self.params.setdefault(param.name, param)
                    if stage < first.get(param.name, stage + 1):
                        first[param.name] = stage
                        self._where[param.name] = (rank, chunk)
            self._index[rank] = {
                param.name: i for i, (_, param) in enumerate(optimizer_order(chunks))
            }
        self._files: dict[tuple[int, int], dict[str, Any]] = {}

    def shard(self, tp_rank: int, pp_rank: int) -> dict[str, Any]:
        """Return one saved file's contents (memory-mapped, read once)."""
        if (tp_rank, pp_rank) not in self._files:
            self._files[tp_rank, pp_rank] = checkpoint.read_shard(
                self.folder,
                tp_rank,
                pp_rank,
                self.meta,
                mmap=True,
                check=not self.verified,
                skip=self.skip,
            )
        return self._files[tp_rank, pp_rank]

    def rng_source(self, layout: Cut, pp_rank: int) -> int | None:
        """Return the saved pipeline rank whose random states ``pp_rank`` of ``layout`` takes.

        The saved rank whose first stage starts where this rank's first stage starts:
        pipeline stages draw from different streams, so where several new ranks come from
        one saved rank, only the one that starts where it started continues its streams
        (None: the rest keep their fresh seeds). Only a saved rank's *first* stage counts: an
        interleaved rank's later chunks start elsewhere, and a new rank starting at one of
        them would otherwise share that rank's streams with the new rank starting at its
        first.
        """
        start = layout.stages(self.cfg.model.n_layer)[pp_rank].start
        saved_firsts = self.layout.stages(self.cfg.model.n_layer)[: self.layout.pp]
        for rank, layers in enumerate(saved_firsts):
            if layers.start == start:
                return rank
        return None

    def _slices(self, name: str, pick: Any) -> list[Any]:
        rank, chunk = self._where[name]
        key = _key(self.layout, chunk, name)
        return [pick(self.shard(t, rank), key, rank) for t in range(self.layout.tp)]

    def _merge(self, name: str, slices: list[torch.Tensor]) -> torch.Tensor:
        param = self.params[name]
        partition = param.partition
        # Replicated key/value heads: one slice per head (the first rank holding each).
        slices = slices[:: param.replicas(self.layout.tp)]
        whole = merge_shards(slices, *partition[:2]) if partition else slices[0]
        return whole[: self.vocab] if self.params[name].padded else whole

    def weight(self, name: str) -> torch.Tensor:
        """Return a parameter whole, without the embedding's padding rows."""
        return self._merge(name, self._slices(name, lambda shard, key, _: shard["model"][key]))

    def has_optimizer(self) -> bool:
        """Return whether the checkpoint holds optimizer state (a converted HF model has none)."""
        return self.shard(0, 0).get("optimizer") is not None

    def moments(self, name: str) -> dict[str, Any] | None:
        """Return a parameter's optimizer state, its tensors whole; None if it has none."""

        def pick(shard: dict[str, Any], _key: str, rank: int) -> Any:
            return shard["optimizer"]["state"].get(self._index[rank][name])

        states = self._slices(name, pick)
        if states[0] is None:
            return None
        return {
            key: self._merge(name, [s[key] for s in states])
            if torch.is_tensor(value) and value.dim() > 0
            else value
            for key, value in states[0].items()
        }

    def param_groups(self) -> list[dict[str, Any]]:
        """Return the optimizer's groups' settings (decay, then no decay), without indices."""
        groups = self.shard(0, 0)["optimizer"]["param_groups"]
        return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def _cut(param: Param, whole: torch.Tensor, vocab: int, tp_rank: int, tp: int) -> torch.Tensor:
    if param.padded:
        rows = padded_vocab(vocab, tp)
        whole = torch.cat([whole, whole.new_zeros(rows - vocab, *whole.shape[1:])])
    if param.partition:
        rep = param.replicas(tp)
        part = shard_of(whole, *param.partition[:2], tp_rank // rep, tp // rep)
    else:
        part = whole
    return part.clone()  # owns its memory: the file it came from may be unmapped


def _owned(value: Any) -> Any:
    """Return ``value`` with every tensor in it copied out of the memory-mapped file."""
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _owned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_owned(v) for v in value)
    return value


def cut_shard(
    saved: SavedState, layout: Cut, tp_rank: int, pp_rank: int, *, optimizer: bool = True
) -> dict[str, Any]:
    """Return what rank (tp_rank, pp_rank) of ``layout`` would have saved at this step."""
    if saved.cfg.model.n_head % layout.tp:
        raise UserError(f"model.n_head {saved.cfg.model.n_head} is not divisible by tp {layout.tp}")
    chunks = rank_parameters(saved.cfg.model, layout, pp_rank)
    vocab = saved.vocab
    model = {
        _key(layout, chunk, param.name): _cut(
            param, saved.weight(param.name), vocab, tp_rank, layout.tp
        )
        for chunk, params in enumerate(chunks)
        for param in params
    }
    shard: dict[str, Any] = {"model": model, "optimizer": None}
    # The loss scale is the same on every saved rank. The default random stream is the same on
    # every tp rank of a stage (replicated regions need equal dropout masks): tp rank 0's.
    first = saved.shard(0, 0)
    if "scaler" in first:
        shard["scaler"] = _owned(first["scaler"])
    source = saved.rng_source(layout, pp_rank)
    if source is not None and "rng" in saved.shard(0, source):
        rng = dict(_owned(saved.shard(0, source)["rng"]))
        # The tensor-parallel stream is each tp rank's own (different masks on each shard):
        # tp rank r continues saved tp rank r's, and a tp rank the saved run had not keeps
        # its fresh seed, so no two tp ranks ever share one.
        rng.pop("tp_stream", None)
        if tp_rank < saved.layout.tp:
            own = saved.shard(tp_rank, source).get("rng", {}).get("tp_stream")
            if own is not None:
                rng["tp_stream"] = _owned(own)
        shard["rng"] = rng
    # Any other named part (checkpointer.track) is the same on every rank: tp 0, pp 0's.
    for name, value in first.items():
        if name not in shard and name not in ("scaler", "rng"):
            shard[name] = _owned(value)
    if optimizer and saved.has_optimizer():
        order = optimizer_order(chunks)
        state = {}
        for index, (_, param) in enumerate(order):
            moments = saved.moments(param.name)
            if moments is not None:
                state[index] = {
                    key: _cut(param, value, vocab, tp_rank, layout.tp)
                    if torch.is_tensor(value) and value.dim() > 0
                    else _owned(value)
                    for key, value in moments.items()
                }
        matrices = sum(1 for _, param in order if param.dim >= 2)
        decay, no_decay = saved.param_groups()
        shard["optimizer"] = {
            "state": state,
            "param_groups": [
                {**decay, "params": list(range(matrices))},
                {**no_decay, "params": list(range(matrices, len(order)))},
            ],
        }
    return shard


def whole_model_state(
    folder: Path, *, verified: bool = False
) -> tuple[Config, int, dict[str, torch.Tensor]]:
    """Return (the checkpoint's config, vocabulary, the whole GPT's weights) from any layout.

    Merged in memory on one process; the optimizer state is never read. ``verified``: the
    folder's files were checked against its manifest already (by :func:`select`), so they
    are not read a second time for that.
    """
    saved = SavedState(folder, verified=verified, optimizer=False)
    shard = cut_shard(saved, Cut(), 0, 0, optimizer=False)
    return saved.cfg, saved.vocab, shard["model"]


def check_resumable(folder: Path, cfg: Config) -> Cut | None:
    """Return the checkpoint's layout if resuming ``cfg`` from it needs a re-cut, else None.

    Raises one line naming both layouts and the two ways out when it does and
    ``run.reshard`` is off.
    """
    saved = saved_layout(folder)
    mine = Cut.of(cfg)
    n_layer = cfg.model.n_layer
    if saved.same_as(mine, n_layer):
        return None
    if not cfg.run.reshard:
        raise UserError(
            f"{folder} was saved with {saved} and this run has {mine}; set "
            "run.reshard=true to re-cut it on load, or write a re-cut copy with hpcllm convert "
            f"--checkpoint {folder.parent.parent} --out NEW_RUN --tp {mine.tp} --pp {mine.pp}"
            + (f" --vpp {mine.vpp}" if mine.pp > 1 else "")
            + (" (which cuts the stages evenly)" if mine.pipeline_layers else "")
        )
    return saved


def _target_config(
    cfg: Config,
    meta: dict[str, Any],
    *,
    tp: int | None,
    pp: int | None,
    vpp: int | None,
    dp: int | None,
    schedule: str | None,
    ep: int | None = None,
) -> Config:
    """Return the saved config with the new layout, the rest (batch, data) kept."""
    parallel = cfg.parallel
    if ep is not None:
        parallel.ep = ep
    old_stages = parallel.pp * parallel.vpp
    parallel.tp = tp or parallel.tp
    new_pp = pp or parallel.pp
    if vpp is None:
        vpp = parallel.vpp if new_pp > 1 else 1
    if new_pp == 1 and vpp > 1:
        raise UserError(f"--vpp {vpp} needs a pipeline (--pp > 1)")
    parallel.pp, parallel.vpp = new_pp, vpp
    if schedule is not None:
        parallel.schedule = schedule
    elif vpp > 1:
        parallel.schedule = "interleaved"
    elif parallel.schedule == "interleaved":
        parallel.schedule = "1f1b"
    if parallel.pp * parallel.vpp != old_stages:
        parallel.pipeline_layers = None  # a cut for another number of stages: split evenly again
    if cfg.model.n_head % parallel.tp:
        raise UserError(f"model.n_head {cfg.model.n_head} is not divisible by --tp {parallel.tp}")
    batch = meta.get("global_batch") or cfg.train.global_batch_size
    accumulation = None
    if dp is not None and batch:
        plan = BatchPlan.of(
            batch, cfg.train.micro_batch_size, dp, "the run's global batch", dp_name="--dp"
        )
        accumulation = plan.accumulation
    # The run keeps its global batch whatever d becomes, or its data position would slip.
    cfg.train.global_batch_size = batch
    parallel.dp = dp
    check_ep(cfg)  # the new ep (or the saved one) against the experts, the new d, the engine
    check_cp(cfg)  # the saved cp against the new t (its sequence cut into 2·cp·t parts)
    check_pipeline(cfg, accumulation)  # the schedule, v and the stage cut; m once d is known
    return cfg


def convert(
    run_dir: Path,
    out_dir: Path,
    *,
    tp: int | None = None,
    pp: int | None = None,
    vpp: int | None = None,
    dp: int | None = None,
    schedule: str | None = None,
    step: int | None = None,
    allow_unverified: bool = False,
    ep: int | None = None,
) -> Path:
    """Write a run's checkpoint (the latest, or ``step``) re-cut for another layout; return it.

    The new run folder holds the config with the new layout, the tokenizer and one checkpoint
    (weights, optimizer state, data position, random states), so ``hpcllm train --config
    OUT/config.yaml`` resumes it where the original stopped. It appears whole or not at all.
    """
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if out_dir.resolve() == run_dir.resolve():
        raise UserError("--out must be a new run folder, not the one converted")
    folder = select(run_dir, step, allow_unverified)
    saved = SavedState(folder, verified=True)
    cfg = _target_config(
        checkpoint_config(folder),
        saved.meta,
        tp=tp,
        pp=pp,
        vpp=vpp,
        dp=dp,
        schedule=schedule,
        ep=ep,
    )
    layout = Cut.of(cfg)
    cfg.run.dir = str(out_dir.resolve())  # resumes from wherever training starts
    # A converted checkpoint's files are cut by t and p only; its dp is --dp, and no cp is
    # kept (the run's config still says which cp it trains at).
    written_anew = ("tp", "pp", "dp", "ep", "cp", "step", "format_version")
    meta = {k: v for k, v in saved.meta.items() if k not in written_anew}
    try:
        with new_folder(out_dir) as partial:
            shards = {
                (t, r): cut_shard(saved, layout, t, r)
                for r in range(layout.pp)
                for t in range(layout.tp)
            }
            cfg.dump(partial / "config.yaml")
            run_folder.copy_meaning_files(run_dir, partial)
            checkpoint.write_offline(
                partial,
                saved.meta["step"],
                shards,
                meta,
                yaml.safe_dump(cfg.to_dict(), sort_keys=False),
                tp=layout.tp,
                pp=layout.pp,
                dp=dp,
            )
    except OSError as err:
        raise UserError(f"writing {out_dir} failed: {err}") from None
    return out_dir


UNVERIFIED_FLAG = "give --allow-unverified (hpcllm.load_model: allow_unverified=True)"


def select(run_dir: Path, step: int | None = None, allow_unverified: bool = False) -> Path:
    """Return a run's checkpoint folder that verifies: the one of ``step``, or the newest.

    One without a manifest is refused unless ``allow_unverified``.
    """
    run_dir = Path(run_dir)
    folders = checkpoint.checkpoints(run_dir)
    if not folders:
        raise UserError(f"{run_dir} has no checkpoint (no checkpoints/step_*)")
    if step is None:
        folder = checkpoint.resumable(
            run_dir, checkpoint.stderr_warning, allow_unverified, UNVERIFIED_FLAG, "reading"
        )
        assert folder is not None  # there are folders: resumable returns one or raises
        return folder
    named = [f for f in folders if checkpoint.step_of(f) == step]
    if not named:
        steps = ", ".join(str(checkpoint.step_of(f)) for f in reversed(folders))
        raise UserError(f"{run_dir} has no checkpoint of step {step} (it has steps {steps})")
    verdict = checkpoint.verify(named[0])
    if verdict.status == "bad":
        raise UserError(f"checkpoint {named[0]} is damaged: {verdict.reason}")
    if verdict.status == "unverified" and not allow_unverified:
        raise checkpoint.refuse_unverified(named[0], UNVERIFIED_FLAG)
    return named[0]
