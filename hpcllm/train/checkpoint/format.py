"""What a checkpoint folder is made of: names, the layout of its files, its manifest and meta.

The other modules of the package write (:mod:`.write`), find and verify (:mod:`.find`) and read
(:mod:`.read`) through these definitions.
"""

from __future__ import annotations

import errno
import json
import re
import sys
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpcllm.errors import UserError

LATEST = "latest"
MANIFEST = "manifest.json"
# 1: no manifest, RNG states pickled as numpy/python objects; 2: manifest, weights_only-safe;
# 3: the manifest records the layout (which axes cut which files) and the named parts.
FORMAT_VERSION = 3
CHUNK = 8 << 20
STEP_FOLDER = re.compile(r"step_(\d+)")

# What a model file holds as its optimizer when each dp rank saved its part apart.
SHARDS_FORMAT = "hpcllm-distributed-optimizer-parts-1"
# local-sgd's replicas step their own optimizers: each dp rank saves its whole state.
REPLICAS_FORMAT = "hpcllm-optimizer-replicas-1"

# The axes that may cut a checkpoint's files, in the order their numbers appear in a file
# name, with the digits of each number. A new axis is one more entry here (and its size and
# rank on the grid: ``grid.<axis>``, ``grid.<axis>_rank``). ep is the fast-varying part of dp
# (dp rank = ep rank + ep · expert-dp rank), so its files' replicas are the expert-dp ranks.
AXES: dict[str, int] = {"tp": 2, "pp": 2, "dp": 3, "ep": 2}
# The kinds of file: the model file holds every named part of a (tp, pp) shard, the same on
# its data-parallel replicas; the optimizer file holds one dp rank's optimizer state where it
# differs by dp rank (the distributed optimizer's part, local SGD's replica); at ep > 1 the
# experts file holds what differs by ep rank: its routed experts' weights and their Adam
# moments (the model file holds the rest of those parts).
MODEL, OPTIMIZER, EXPERTS = "model", "optimizer", "experts"
# The named parts of every checkpoint before format 3, which all lived in the model file.
FORMAT_2_PARTS = ("model", "optimizer", "scaler", "rng")

Warn = Callable[[str], None]


def step_name(step: int) -> str:
    """Return a checkpoint folder's name (200 -> ``step_00000200``)."""
    return f"step_{step:08d}"


def partial_folder(root: Path, step: int) -> Path:
    """Return the hidden folder a checkpoint is written into before its rename.

    One name for every rank (each writes its files into it), unlike files.partial_path.
    """
    return root / f".{step_name(step)}.partial"


@dataclass(frozen=True)
class Layout:
    """Which axes cut which file of a checkpoint, and their sizes.

    ``sizes``: each axis's size (``{"tp": 2, "pp": 2, "dp": 4}``); ``files``: each kind of
    file (:data:`MODEL`, :data:`OPTIMIZER`) and the axes that cut it, in :data:`AXES`'s order.
    One file per combination of its axes' ranks, written by the rank that holds it whose rank
    on every other axis is 0 (the first of the replicas that hold the same file).
    """

    sizes: Mapping[str, int]
    files: Mapping[str, tuple[str, ...]]

    @classmethod
    def of_grid(cls, grid: Any, *, optimizer_by_dp: bool) -> Layout:
        """Return the layout a grid saves: the model file cut by tp and pp, the optimizer's
        own files (``optimizer_by_dp``) by dp as well, the experts' files (ep > 1) by ep."""
        sizes = {axis: int(getattr(grid, axis, 1)) for axis in AXES}
        files = {MODEL: ("tp", "pp")}
        if optimizer_by_dp:
            files[OPTIMIZER] = ("tp", "pp", "dp")
        if sizes["ep"] > 1:
            files[EXPERTS] = ("tp", "pp", "ep")
        else:
            del sizes["ep"]  # a layout names the axes that cut something
        return cls(sizes, files)

    @classmethod
    def of_meta(cls, meta: Mapping[str, Any]) -> Layout:
        """Return the layout of a checkpoint written before format 3, from its meta.json."""
        sizes = {"tp": meta["tp"], "pp": meta["pp"], "dp": meta.get("dp") or 1}
        files = {MODEL: ("tp", "pp")}
        per_dp = meta.get("optimizer_shards") or meta.get("optimizer_replicas")
        if per_dp:
            sizes["dp"] = per_dp
            files[OPTIMIZER] = ("tp", "pp", "dp")
        return cls(sizes, files)

    @classmethod
    def from_json(cls, data: Any) -> Layout:
        """Return the layout a manifest records; ValueError if it is not one."""
        try:
            sizes = {str(k): int(v) for k, v in data["axes"].items()}
            files = {str(k): tuple(str(a) for a in v) for k, v in data["files"].items()}
        except (TypeError, KeyError, AttributeError, ValueError):
            raise ValueError(f"{MANIFEST}'s layout is not a layout") from None
        if MODEL not in files or any(a not in sizes for axes in files.values() for a in axes):
            raise ValueError(f"{MANIFEST}'s layout names an axis without a size")
        return cls(sizes, files)

    def to_json(self) -> dict[str, Any]:
        return {"axes": dict(self.sizes), "files": {k: list(v) for k, v in self.files.items()}}

    def name(self, kind: str, **ranks: int) -> str:
        """Return the file of ``kind`` held by the ranks given (one per axis that cuts it)."""
        numbers = "_".join(f"{a}{ranks[a]:0{AXES.get(a, 2)}d}" for a in self.files[kind])
        return f"{kind}_{numbers}.pt"

    def names(self) -> set[str]:
        """Return every file this layout holds."""
        found: set[str] = set()
        for kind, axes in self.files.items():
            combos: list[dict[str, int]] = [{}]
            for axis in axes:
                combos = [{**c, axis: r} for c in combos for r in range(self.sizes[axis])]
            found |= {self.name(kind, **c) for c in combos}
        return found

    def writes(self, kind: str, ranks: Mapping[str, int]) -> bool:
        """Return whether the rank at ``ranks`` (its rank on every axis) writes its ``kind``
        file: it is the first of the replicas holding it."""
        if kind not in self.files:
            return False
        others = {axis: rank for axis, rank in ranks.items() if axis not in self.files[kind]}
        # ep is the fast-varying part of dp: a file cut by dp is cut by ep too, and the
        # replicas of a file cut by ep are the expert-dp ranks (dp rank // ep).
        if "dp" in self.files[kind]:
            others.pop("ep", None)
        elif "ep" in self.files[kind] and "dp" in others:
            others["dp"] //= self.sizes["ep"]
        return all(rank == 0 for rank in others.values())


def grid_ranks(grid: Any) -> dict[str, int]:
    """Return a grid's rank on every axis of :data:`AXES` (0 on an axis it lacks)."""
    return {axis: int(getattr(grid, f"{axis}_rank", 0)) for axis in AXES}


def stderr_warning(message: str) -> None:
    print(f"hpcllm: warning: {message}", file=sys.stderr, flush=True)


def describe(err: OSError) -> str:
    """Return one line naming the file and what went wrong."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "no space left on device"
        if err.errno == errno.EDQUOT:
            reason += " (disk quota exceeded)"
    else:
        reason = err.strerror or str(err)
    return f"{err.filename}: {reason}" if err.filename else reason


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def gather(grid: Any, item: Any) -> list[Any]:
    """Return every rank's ``item`` in rank order (on the host through MPI where it exists)."""
    if grid.world_size == 1:
        return [item]
    if grid.groups.world_comm is not None:
        return grid.groups.world_comm.allgather(item)
    items: list[Any] = [None] * grid.world_size
    dist.all_gather_object(items, item)
    return items


def checksum(path: Path) -> tuple[int, str]:
    """Return a file's size and CRC-32 (hex), reading it in chunks."""
    size, crc = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return size, f"{crc:08x}"


def file_problem(path: Path, entry: Any) -> str | None:
    """Return why ``path`` does not match its manifest entry, or None."""
    if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int)):
        return f"{MANIFEST} has no valid entry for {path.name}"
    try:
        if path.stat().st_size != entry["bytes"]:
            return (
                f"{path.name} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
            )
        _, crc = checksum(path)
    except FileNotFoundError:
        return f"{path.name} is missing"
    except OSError as err:
        return f"{path.name} is unreadable ({err.strerror or err})"
    if crc != entry.get("crc32"):
        return f"{path.name} is corrupt (CRC-32 {crc}, the manifest says {entry.get('crc32')})"
    return None


def read_json(path: Path) -> Any:
    """Return a JSON file's data; raise ValueError with a short reason if it is not JSON."""
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path.name} is not valid JSON ({err})") from None


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """Return a checkpoint's manifest, None if it has none; ValueError if it is unreadable."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    manifest = read_json(path)
    if not (
        isinstance(manifest, dict)
        and isinstance(manifest.get("files"), dict)
        and isinstance(manifest.get("format_version"), int)
    ):
        raise ValueError(f"{MANIFEST} lacks format_version or files")
    if manifest["format_version"] > FORMAT_VERSION:
        raise ValueError(
            f"{MANIFEST} has format {manifest['format_version']}, newer than this hpcllm's "
            f"{FORMAT_VERSION}"
        )
    if manifest["format_version"] >= 3:
        Layout.from_json(manifest.get("layout"))  # a ValueError here, not in a reader
    return manifest


def layout_of(manifest: Mapping[str, Any] | None, meta: Mapping[str, Any]) -> Layout:
    """Return a checkpoint's layout: its manifest's (format 3), else what meta.json implies."""
    if manifest is not None and manifest.get("format_version", 0) >= 3:
        return Layout.from_json(manifest["layout"])
    return Layout.of_meta(meta)


def parts_of(manifest: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Return the named parts a checkpoint holds (the four of every one before format 3)."""
    if manifest is not None and manifest.get("format_version", 0) >= 3:
        return tuple(manifest.get("parts") or ())
    return FORMAT_2_PARTS


def checked_meta(path: Path, meta: Any) -> dict[str, Any]:
    if not (
        isinstance(meta, dict) and all(isinstance(meta.get(k), int) for k in ("step", "tp", "pp"))
    ):
        raise UserError(f"{path} lacks step, tp or pp; the checkpoint is damaged")
    return meta


def read_meta(folder: Path) -> dict[str, Any]:
    """Return a checkpoint's meta.json; one-line :class:`UserError` if it is missing or corrupt."""
    path = Path(folder) / "meta.json"
    try:
        meta = read_json(path)
    except FileNotFoundError:
        raise UserError(f"{path} is missing; the checkpoint is incomplete") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable: {err}") from None
    return checked_meta(path, meta)
