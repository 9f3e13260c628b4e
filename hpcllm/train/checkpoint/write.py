"""Writing a checkpoint: every rank its files into a hidden folder, then a manifest and a rename.

:func:`save` is a collective; :func:`write_offline` writes a whole checkpoint from one process
(the conversion tools); :func:`prune` removes older checkpoints once a newer one verifies.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hpcllm import watchdog
from hpcllm.errors import UserError
from hpcllm.files import atomic_write, durable_replace, fsync_path
from hpcllm.parallel.data.optimizer_parts import is_shard_state
from hpcllm.train.checkpoint.find import checkpoints, step_of, verify
from hpcllm.train.checkpoint.format import (
    EXPERTS,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    MODEL,
    OPTIMIZER,
    REPLICAS_FORMAT,
    SHARDS_FORMAT,
    Layout,
    Warn,
    describe,
    gather,
    grid_ranks,
    partial_folder,
    stderr_warning,
    step_name,
)


class _ChecksummedFile:
    """A binary file that counts and checksums what is written to it.

    It keeps the first OSError it raised: torch.save reports a failed write of its own as a
    RuntimeError without the errno, and "no space left on device" must reach the user.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "wb")  # noqa: SIM115 - closed in finish()
        self.size = 0
        self.crc = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        watchdog.progress()  # a long write is progress, not a hang
        try:
            written = self._file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        self.crc = zlib.crc32(view, self.crc)
        return written

    def flush(self) -> None:
        self._file.flush()

    def finish(self) -> dict[str, Any]:
        """Flush the file to disk and close it; return its manifest entry."""
        try:
            self._file.flush()
            fsync_path(self.path)
        finally:
            self._file.close()
        return {"bytes": self.size, "crc32": f"{self.crc:08x}"}

    def abandon(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass


def _write(path: Path, write: Callable[[_ChecksummedFile], None]) -> dict[str, Any]:
    """Write ``path`` through ``write`` and flush it to disk; return its manifest entry.

    Raises OSError naming ``path`` when the disk refuses it.
    """
    out = _ChecksummedFile(path)
    try:
        write(out)
        return out.finish()
    except (OSError, RuntimeError) as err:
        out.abandon()
        cause = out.error or err
        if not isinstance(cause, OSError):
            raise
        cause.filename = cause.filename or str(path)
        raise cause from None


def _write_shard(path: Path, shard: dict[str, Any]) -> dict[str, Any]:
    return _write(path, lambda out: torch.save(shard, out))


def _write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    return _write(path, lambda out: out.write(data))


def _agreed(grid: Any, work: Callable[[], Any] | None) -> tuple[list[str], list[Any]]:
    """Run ``work`` on this rank (if any); return every rank's errors and results.

    A collective: all ranks learn of a failure on any one, so all take the same next step.
    """
    error, result = None, None
    if work is not None:
        try:
            result = work()
        except OSError as err:
            error = describe(err)
    gathered = gather(grid, (error, result))
    return [e for e, _ in gathered if e], [r for _, r in gathered if r is not None]


def save(
    run_dir: Path,
    step: int,
    grid: Any,
    shard: dict[str, Any],
    meta: dict[str, Any],
    config_yaml: str,
    *,
    on_failure: str = "fail",
    warn: Warn = stderr_warning,
    per_replica: bool = False,
    by_ep: dict[str, Any] | None = None,
) -> Path | None:
    """Write the checkpoint of ``step`` (a collective: every rank calls it); return its path.

    ``shard``: this rank's named parts (``model``, ``optimizer``, ``scaler``, ``rng`` and any
    other the checkpointer tracks), each a ``state_dict``. They go into the model file of
    this rank's (tp, pp), written by its first data-parallel replica; an optimizer state that
    differs by dp rank (the distributed optimizer's part, or each replica's own with
    ``per_replica``: local SGD, which :func:`~hpcllm.train.checkpoint.read.read_shard` gives
    back to the same dp rank) goes into a file of its own that every dp rank writes.
    ``by_ep`` (ep > 1): what of the named parts differs by ep rank (this rank's experts,
    nested as in the parts, each tensor's experts along dim 0), which ``shard`` then lacks;
    it goes into the experts file of this rank's (tp, pp, ep), written by expert-dp rank 0.

    If a write fails on any rank, rank 0 removes the partial folder (earlier checkpoints are
    untouched), then with ``on_failure="fail"`` every rank raises the same one-line
    :class:`UserError`; with ``"warn"`` rank 0 passes that line to ``warn`` and every rank
    returns None.
    """
    if on_failure not in ("fail", "warn"):
        raise ValueError(f"on_failure must be fail or warn, not {on_failure!r}")
    root = Path(run_dir) / "checkpoints"
    tmp = partial_folder(root, step)
    optimizer = shard.get("optimizer")
    by_dp = is_shard_state(optimizer) or per_replica
    layout = Layout.of_grid(grid, optimizer_by_dp=by_dp)
    ranks = grid_ranks(grid)
    contents = {MODEL: shard}
    if by_dp:
        # The model file names what the optimizer files hold; each dp rank writes its own.
        kind = (
            {"format": REPLICAS_FORMAT, "replicas": grid.dp}
            if per_replica
            else {"format": SHARDS_FORMAT, "shards": grid.dp}
        )
        contents = {MODEL: {**shard, "optimizer": kind}, OPTIMIZER: optimizer}
    if EXPERTS in layout.files:
        if by_ep is None:
            raise ValueError("a save at ep > 1 takes by_ep, what differs by ep rank")
        contents[EXPERTS] = by_ep
    mine = {kind: state for kind, state in contents.items() if layout.writes(kind, ranks)}
    files: dict[str, Any] = {}

    def make_partial() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def write_files() -> dict[str, Any]:
        written = {}
        for kind, state in mine.items():
            name = layout.name(kind, **ranks)
            written[name] = _write_shard(tmp / name, state)
        return written

    def publish() -> None:
        full_meta = {**meta, "step": step, "tp": grid.tp, "pp": grid.pp, "dp": grid.dp}
        if grid.cp > 1:  # dp counts the d·cp ranks holding the same weights (Grid.replicas)
            full_meta["cp"] = grid.cp
        if EXPERTS in layout.files:
            full_meta["ep"] = layout.sizes["ep"]
        if by_dp:
            full_meta["optimizer_replicas" if per_replica else "optimizer_shards"] = grid.dp
        _publish(root, step, full_meta, config_yaml, files, layout, list(shard))

    # Each phase ends in an all-gather of every rank's error: all ranks stop at the same one.
    errors, _ = _agreed(grid, make_partial if grid.rank == 0 else None)
    if not errors:
        errors, written = _agreed(grid, write_files if mine else None)
        for part in written:
            files.update(part)
    if not errors:
        errors, _ = _agreed(grid, publish if grid.rank == 0 else None)
    if not errors:
        return root / step_name(step)
    if grid.rank == 0:  # every rank is past its writes: nothing else touches the folder
        shutil.rmtree(tmp, ignore_errors=True)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    # The checkpoint folder is shared by every rank that writes into it: each sees the same.
    kept = checkpoints(Path(run_dir))
    message = f"saving the checkpoint of step {step} failed: {errors[0]}{more}; " + (
        f"the {len(kept)} earlier checkpoint{'s are' if len(kept) > 1 else ' is'} intact"
        if kept
        else "there is no earlier checkpoint"
    )
    if on_failure == "warn":
        if grid.rank == 0:
            warn(message + "; training goes on")
        return None
    raise UserError(message)


def _publish(
    root: Path,
    step: int,
    meta: dict[str, Any],
    config_yaml: str,
    files: dict[str, Any],
    layout: Layout,
    parts: list[str],
) -> None:
    """Complete the hidden folder of ``step`` and its manifest, rename it, point `latest` at it."""
    tmp, final = partial_folder(root, step), root / step_name(step)
    meta = {**meta, "format_version": FORMAT_VERSION}
    files = {
        **files,
        "meta.json": _write_bytes(tmp / "meta.json", json.dumps(meta, indent=2).encode()),
        "config.yaml": _write_bytes(tmp / "config.yaml", config_yaml.encode()),
    }
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "checksum": "crc32",
        "layout": layout.to_json(),
        "parts": parts,
        "files": dict(sorted(files.items())),
    }
    # Last: the manifest vouches for files that are already on disk.
    atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    durable_replace(tmp, final)
    atomic_write(root / LATEST, step_name(step) + "\n")


def write_offline(
    run_dir: Path,
    step: int,
    shards: Mapping[tuple[int, int], dict[str, Any]],
    meta: dict[str, Any],
    config_yaml: str,
    *,
    tp: int,
    pp: int,
    dp: int | None,
) -> Path:
    """Write a whole checkpoint from one process (conversion tools); return its folder.

    ``shards``: each (tp rank, pp rank)'s named parts, the optimizer's plain state among them.
    """
    root = Path(run_dir) / "checkpoints"
    tmp = partial_folder(root, step)
    layout = Layout({"tp": tp, "pp": pp, "dp": dp or 1}, {MODEL: ("tp", "pp")})
    parts = list(next(iter(shards.values()))) if shards else []
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = {}
        for (t, p), shard in shards.items():
            name = layout.name(MODEL, tp=t, pp=p)
            files[name] = _write_shard(tmp / name, shard)
        # One process writes plain optimizer state into each shard: no dp parts.
        meta = {
            k: v for k, v in meta.items() if k not in ("optimizer_shards", "optimizer_replicas")
        }
        meta = {**meta, "step": step, "tp": tp, "pp": pp, "dp": dp}
        _publish(root, step, meta, config_yaml, files, layout, parts)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"saving the checkpoint of step {step} failed: {describe(err)}") from None
    return root / step_name(step)


def prune(newest: Path, keep: int, warn: Warn = stderr_warning) -> list[Path]:
    """Delete the checkpoints older than ``newest`` beyond the newest ``keep``; return them.

    Only once ``newest`` verifies: until then an older checkpoint may be the one a resume
    needs. Each is renamed to a hidden name before it is removed, so a crash halfway through
    leaves nothing that looks like a checkpoint. Folders of later steps (another attempt's,
    after a resume from an earlier checkpoint) are left alone.
    """
    newest = Path(newest)
    root = newest.parent
    for leftover in root.glob(".step_*.deleting"):  # a deletion a crash interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    verdict = verify(newest)
    if verdict.status != "ok":
        warn(f"kept every older checkpoint: {newest} does not verify ({verdict.reason})")
        return []
    step = step_of(newest)
    older = [f for f in checkpoints(newest.parent.parent) if step_of(f) < step]
    doomed = older[max(0, keep - 1) :]
    for folder in doomed:
        hidden = folder.parent / f".{folder.name}.deleting"
        try:
            folder.rename(hidden)
            shutil.rmtree(hidden)
        except OSError as err:
            warn(f"could not delete the old checkpoint {folder}: {describe(err)}")
    return doomed
