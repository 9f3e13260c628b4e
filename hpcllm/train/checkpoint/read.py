"""Reading a checkpoint: this rank's shard (its named parts, the optimizer's dp parts merged),
and the check that a checkpoint holds the model a run is about to resume."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from hpcllm import families
from hpcllm.config import Config, config_from_dict, load_yaml, moe_layers
from hpcllm.errors import UserError
from hpcllm.parallel.data.optimizer_parts import merge_shards
from hpcllm.train.checkpoint.format import (
    EXPERTS,
    MANIFEST,
    MODEL,
    OPTIMIZER,
    REPLICAS_FORMAT,
    SHARDS_FORMAT,
    Layout,
    file_problem,
    first_line,
    layout_of,
    read_manifest,
    read_meta,
)
from hpcllm.train.checkpoint.rng import numpy_state


def _format_1_globals() -> list[Any]:
    """Return what unpickling numpy's RNG state tuple (an ndarray of uint32) needs."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    # A shard written under numpy 1.x names the function by its old module.
    return [
        np.ndarray,
        np.dtype,
        np.dtypes.UInt32DType,
        _reconstruct,
        (_reconstruct, "numpy.core.multiarray._reconstruct"),
        (_reconstruct, "numpy._core.multiarray._reconstruct"),
    ]


def load_shard(
    folder: Path,
    tp_rank: int,
    pp_rank: int,
    tp: int,
    pp: int,
    dp_rank: int = 0,
    *,
    ep: int = 1,
    ep_rank: int = 0,
) -> dict[str, Any]:
    """Return this rank's shard of a checkpoint, after checking its grid and its checksum.

    The routed experts come cut for rank ``ep_rank`` of ``ep``, whatever ep saved them.

    Reads with ``weights_only=True``. Raises a one-line :class:`UserError` naming the file if
    it is missing, does not match the manifest, or cannot be unpickled.
    """
    folder = Path(folder)
    meta = read_meta(folder)
    if (meta["tp"], meta["pp"]) != (tp, pp):
        raise UserError(
            f"{folder} was saved with tp={meta['tp']}, pp={meta['pp']} and this "
            f"run has tp={tp}, pp={pp}; set run.reshard=true to re-cut it on load, or "
            "re-cut a copy with hpcllm convert --tp T --pp P"
        )
    return read_shard(folder, tp_rank, pp_rank, meta, dp_rank=dp_rank, ep=ep, ep_rank=ep_rank)


def read_shard(
    folder: Path,
    tp_rank: int,
    pp_rank: int,
    meta: dict[str, Any] | None = None,
    *,
    mmap: bool = False,
    check: bool = True,
    dp_rank: int = 0,
    ep: int = 1,
    ep_rank: int = 0,
    skip: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Return the (tp_rank, pp_rank) shard of a checkpoint (its named parts but those named in
    ``skip``), after checking its checksum.

    ``dp_rank`` picks the optimizer state of that replica where each saved its own. Experts
    saved per ep rank (their own files) come back cut for rank ``ep_rank`` of ``ep``: whole by
    default, as every reader but a resumed run wants them; only the files that hold those
    experts are read. Joining experts saved by several ep ranks copies them (mapped or not):
    a reader that wants weights only skips ``optimizer``, whose moments are then never read.
    ``mmap`` maps the file instead of reading it: tensors that are never touched (the Adam
    moments, when only weights are wanted) are never copied into memory. ``check`` False
    skips the checksum, for a folder :func:`~hpcllm.train.checkpoint.find.verify` has just
    passed.
    """
    folder = Path(folder)
    meta = read_meta(folder) if meta is None else meta
    layout = _layout(folder, meta)
    ranks = {"tp": tp_rank, "pp": pp_rank}
    shard = _read_file(folder, layout.name(MODEL, **ranks), meta, mmap=mmap, check=check)
    for name in skip:
        shard.pop(name, None)
    rng = shard.get("rng")
    if rng is not None and isinstance(rng.get("numpy"), tuple):  # format 1: as format 2 holds it
        rng["numpy"] = numpy_state(rng["numpy"])
    optimizer = shard.get("optimizer")
    if isinstance(optimizer, dict) and optimizer.get("format") == SHARDS_FORMAT:
        # The distributed optimizer's parts, one per dp rank: merged into the plain state,
        # which every reader (and an optimizer at any d) takes.
        parts = [
            _read_file(folder, layout.name(OPTIMIZER, **ranks, dp=r), meta, mmap=mmap, check=check)
            for r in range(optimizer["shards"])
        ]
        shard["optimizer"] = merge_shards(parts)
    elif isinstance(optimizer, dict) and optimizer.get("format") == REPLICAS_FORMAT:
        # Each replica's own state, back to the same dp rank; a rank the saved run did not
        # have (resumed at a larger d) takes dp rank 0's.
        mine = dp_rank if dp_rank < optimizer["replicas"] else 0
        shard["optimizer"] = _read_file(
            folder, layout.name(OPTIMIZER, **ranks, dp=mine), meta, mmap=mmap, check=check
        )
    if EXPERTS in layout.files:
        saved = layout.sizes["ep"]
        files = {
            j: _read_file(folder, layout.name(EXPERTS, **ranks, ep=j), meta, mmap=mmap, check=check)
            for j in experts_files(saved, ep, ep_rank)
        }
        for name in skip:
            for part in files.values():
                part.pop(name, None)
        merge_experts(shard, files, saved, ep, ep_rank)
    return shard


def experts_files(saved: int, ep: int, ep_rank: int) -> range:
    """Return the saved ep ranks (of ``saved``) whose experts rank ``ep_rank`` of ``ep``
    holds: saved rank j holds the fraction [j/saved, (j+1)/saved) of every expert tensor."""
    first = ep_rank * saved // ep
    last = -(-(ep_rank + 1) * saved // ep)  # ceil
    return range(first, last)


def merge_experts(
    shard: dict[str, Any], files: dict[int, Any], saved: int, ep: int, ep_rank: int
) -> None:
    """Put the experts of ``files`` (saved ep rank -> its experts file, the consecutive ones
    :func:`experts_files` names) into ``shard``'s parts, cut for rank ``ep_rank`` of ``ep``:
    each tensor's saved parts joined along dim 0, then this rank's 1/ep taken."""
    first = min(files)

    def cut(parts: list[Any]) -> Any:
        if isinstance(parts[0], dict):
            return {key: cut([p[key] for p in parts]) for key in parts[0]}
        per = parts[0].shape[0]  # experts per saved rank
        whole = per * saved
        if whole % ep:
            raise UserError(f"{whole} experts do not split over ep {ep}")
        start = ep_rank * (whole // ep) - first * per
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        return joined[start : start + whole // ep]

    def put(into: dict[Any, Any], new: dict[Any, Any]) -> None:
        for key, value in new.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict):
                put(into[key], value)
            else:
                into[key] = value

    ordered = [files[j] for j in sorted(files)]
    put(shard, cut(ordered))


def _layout(folder: Path, meta: dict[str, Any]) -> Layout:
    """Return the layout of a checkpoint's files; a one-line UserError if its manifest is bad."""
    try:
        return layout_of(read_manifest(folder), meta)
    except (OSError, ValueError) as err:
        hint = f"hpcllm inspect --verify {folder.parent.parent} checks every checkpoint"
        raise UserError(f"{folder / MANIFEST}: {err}; {hint}", same_on_all_ranks=False) from None


def _read_file(
    folder: Path, name: str, meta: dict[str, Any], *, mmap: bool, check: bool
) -> dict[str, Any]:
    """Return one shard file's contents, after checking it against the manifest."""
    path = folder / name
    hint = f"hpcllm inspect --verify {folder.parent.parent} checks every checkpoint"
    if not path.is_file():
        raise UserError(f"checkpoint shard {path} is missing", same_on_all_ranks=False)
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as err:
        raise UserError(f"{folder / MANIFEST}: {err}; {hint}", same_on_all_ranks=False) from None
    allowed: list[Any] = []
    if manifest is not None:
        problem = file_problem(path, manifest["files"].get(path.name)) if check else None
        if problem:
            raise UserError(f"checkpoint {folder}: {problem}; {hint}", same_on_all_ranks=False)
    elif "format_version" in meta:
        raise UserError(f"checkpoint {folder} has no {MANIFEST}; {hint}", same_on_all_ranks=False)
    else:
        allowed = _format_1_globals()
    try:
        with torch.serialization.safe_globals(allowed):
            shard = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, ValueError) as err:
        raise UserError(
            f"checkpoint shard {path} is unreadable ({first_line(err)}); {hint}",
            same_on_all_ranks=False,
        ) from None
    return shard


# The MoE keys that shape the weights (model.moe_top_k, the losses and capacity do not).
_MOE_WEIGHT_KEYS = (
    "moe_ffn_size",
    "moe_shared_ffn_size",
    "moe_shared_gate",
)


def _moe_differences(saved: Any, mine: Any) -> list[str]:
    """Return how two model sections' mixtures of experts differ in their weights: dense
    against MoE, the MoE blocks, the experts, their widths, the router's balancing bias."""
    theirs, ours = moe_layers(saved), moe_layers(mine)
    if bool(theirs) != bool(ours):
        return [
            f"{'MoE' if theirs else 'dense'} (model.moe_experts {saved.moe_experts}) vs "
            f"{'MoE' if ours else 'dense'} (model.moe_experts {mine.moe_experts})"
        ]
    if not theirs:
        return []
    different = []
    if theirs != ours:
        different.append(f"MoE blocks {theirs} vs {ours}")
    if saved.moe_experts != mine.moe_experts:
        different.append(f"moe_experts {saved.moe_experts} vs {mine.moe_experts}")
    for key in _MOE_WEIGHT_KEYS:
        if getattr(saved, key) != getattr(mine, key):
            different.append(f"{key} {getattr(saved, key)} vs {getattr(mine, key)}")
    if (saved.moe_router == "sigmoid") != (mine.moe_router == "sigmoid"):
        different.append(f"moe_router {saved.moe_router} vs {mine.moe_router}")
    return different


def check_same_model(folder: Path, cfg: Config, vocab_size: int) -> None:
    """Refuse, in one line, to resume ``cfg`` from a checkpoint of another model.

    Another layout of the same model (t, p, v, the stage cut) is :mod:`hpcllm.train.reshard`'s
    question, not this one.
    """
    path = Path(folder) / "config.yaml"
    try:
        raw = load_yaml(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UserError(f"{path} is unreadable ({first_line(err)})") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} is not a config (not a YAML mapping)")
    try:
        saved_cfg = config_from_dict(raw)
    except UserError as err:  # an older version's rules, or a path of another machine
        raise UserError(f"{path} (the checkpoint's config): {err}") from None
    saved, mine = saved_cfg.model, cfg.model
    meta = read_meta(folder)
    if saved.arch != mine.arch:
        different = [f"family {saved.arch} vs {mine.arch}"]
    else:
        # The sizes every family has, and the family's own (kv heads, MLP width, tying).
        theirs, ours = families.shape(saved, 0).__dict__, families.shape(mine, 0).__dict__
        names = {"layers": "n_layer", "hidden": "d_model", "heads": "n_head", "seq": "seq_len"}
        # Rotary positions hold no weights: a model that has read no data yet (an import)
        # may train at another length than it was saved with.
        free = {"vocab"}
        if not families.get(saved.arch).seq_in_weights and not meta.get("consumed_samples"):
            free.add("seq")
        different = [
            f"{names.get(k, k)} {theirs[k]} vs {ours[k]}"
            for k in theirs
            if k not in free and theirs[k] != ours[k]
        ]
        different += _moe_differences(saved, mine)
    saved_vocab = meta.get("vocab_size")
    if saved_vocab not in (None, vocab_size):
        different.append(f"vocabulary {saved_vocab} vs {vocab_size}")
    if different:
        run_dir = Path(folder).parent.parent
        raise UserError(
            f"{folder} holds another model ({', '.join(different)}); train "
            f"with --config {folder / 'config.yaml'} (and your data.path), name another "
            f"run.dir, or start over here with --set run.resume=none --set run.overwrite=true "
            f"(which moves {run_dir} aside, whole)"
        )
