"""Checkpoints: one file per (tp, pp) rank and a manifest of checksums, published by a rename.

```
RUN_DIR/checkpoints/
  step_00000200/
    model_tp00_pp00.pt         model, optimizer, scaler, RNG states of that model shard
    optimizer_tp00_pp00_dp000.pt   with parallel.distributed_optimizer: dp rank 0's part of
                                   that shard's optimizer state (one file per dp rank);
                                   with local-sgd: dp rank 0's own optimizer state
    meta.json                  step, consumed samples, grid sizes, format_version
    config.yaml                the run's resolved config
    manifest.json              size and CRC-32 of every file above, written last
  latest                       "step_00000200", replaced last (for people and tools)
```

Data-parallel replicas hold the same shard, so only dp rank 0 of each (tp, pp) writes (under
the distributed optimizer every dp rank also writes its part of the optimizer state, which
:func:`read_shard` merges back into the plain state, so a checkpoint resumes at any d). Every
file goes into a hidden ``.step_….partial`` folder; each writing rank computes its shard's
checksum while writing it and the ranks gather those to rank 0, which writes meta.json,
config.yaml, then manifest.json, and renames the folder. A checkpoint is therefore a folder
whose manifest vouches for every file in it; one without a valid manifest does not exist.

manifest.json::

    {"format_version": 2, "step": 200, "checksum": "crc32",
     "files": {"config.yaml": {"bytes": 1834, "crc32": "5f1c09aa"}, ...}}

The checksum is zlib's CRC-32, streamed in 8 MiB chunks. The threat is a torn, truncated or
bit-flipped file, not an attacker (who could rewrite the manifest too; ``weights_only``
loading is the defence against malicious pickles): CRC-32 catches every burst of up to 32
flipped bits and misses random damage once in 4·10⁹, the size check catches truncation, and
it runs at about 3 GB/s on one core against 0.8 for BLAKE2b, which matters because resuming
reads the whole newest checkpoint on rank 0 (:func:`resumable`).

Resuming never trusts ``latest``: :func:`resumable` walks the step folders newest first and
takes the first that verifies. A folder without manifest.json whose meta.json has no
``format_version`` may be format 1 (written before manifests, when the rename alone made a
folder complete), or a damaged folder that lost both: the two cannot be told apart, so it is
refused in one line naming the opt-in (``run.allow_unverified``, ``--allow-unverified``), and
with it loaded unchecked with a warning. With format 2 a missing manifest means damage.

Shards are read with ``torch.load(weights_only=True)``, which unpickles only tensors and
plain containers. RNG states are stored in that vocabulary (numpy's keys as an int64 tensor).
Format-1 shards hold numpy's state tuple with an ndarray: they are read by allowing numpy's
array reconstruction and nothing more (:func:`_format_1_globals`), and their RNG state is
converted to format 2's on load, so a converted or resumed run writes format 2 only.

A save that fails on any rank (disk full, quota) is agreed by all ranks before anyone moves
on: each phase ends with an all-gather of every rank's error, so no rank waits in a
collective that another skipped. The partial folder is removed, earlier checkpoints are
untouched, and every rank raises the same one-line :class:`UserError` (or warns, with
``on_failure="warn"``, and training goes on).
"""

from __future__ import annotations

import errno
import json
import pickle
import random
import re
import shutil
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from hpcllm import families, watchdog
from hpcllm.config import Config, config_from_dict, load_yaml
from hpcllm.errors import UserError
from hpcllm.files import atomic_write, durable_replace, fsync_path
from hpcllm.parallel.data.distributed_optimizer import is_shard_state, merge_shards
from hpcllm.parallel.random import set_tp_stream_state, tp_stream_state

LATEST = "latest"
MANIFEST = "manifest.json"
# 1: no manifest, RNG states pickled as numpy/python objects; 2: manifest, weights_only-safe.
FORMAT_VERSION = 2
_CHUNK = 8 << 20
_STEP_FOLDER = re.compile(r"step_(\d+)")

Warn = Callable[[str], None]


def _name(step: int) -> str:
    return f"step_{step:08d}"


def _partial(root: Path, step: int) -> Path:
    # One name for every rank (each writes its shard into it), unlike files.partial_path.
    return root / f".{_name(step)}.partial"


# What a model shard holds as its optimizer when each dp rank saved its part apart.
SHARDS_FORMAT = "hpcllm-distributed-optimizer-parts-1"
# local-sgd's replicas step their own optimizers: each dp rank saves its whole state.
REPLICAS_FORMAT = "hpcllm-optimizer-replicas-1"


def shard_file(tp_rank: int, pp_rank: int) -> str:
    """Return the file name of a (tp, pp) model shard."""
    return f"model_tp{tp_rank:02d}_pp{pp_rank:02d}.pt"


def optimizer_file(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    """Return the file name of a dp rank's part of a (tp, pp) shard's distributed optimizer."""
    return f"optimizer_tp{tp_rank:02d}_pp{pp_rank:02d}_dp{dp_rank:03d}.pt"


def _expected_files(meta: dict[str, Any]) -> set[str]:
    """Return the shard files a checkpoint of ``meta``'s grid holds."""
    files = {shard_file(t, p) for t in range(meta["tp"]) for p in range(meta["pp"])}
    for d in range(meta.get("optimizer_shards") or meta.get("optimizer_replicas") or 0):
        files |= {optimizer_file(t, p, d) for t in range(meta["tp"]) for p in range(meta["pp"])}
    return files


def stderr_warning(message: str) -> None:
    print(f"hpcllm: warning: {message}", file=sys.stderr, flush=True)


# -- RNG states ------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict[str, Any]:
    """Return every RNG state a step may draw from, in types ``weights_only`` loading reads.

    Python's state is a tuple of ints (and None or a float), which it reads as is; numpy's
    tuple holds an ndarray, so its parts are stored by name, the keys as an int64 tensor.
    """
    state = {
        "torch": torch.get_rng_state(),
        "numpy": _numpy_state(np.random.get_state()),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    tp_cpu, tp_cuda = tp_stream_state()
    if tp_cpu is not None:  # this tp rank's own stream (dropout in split regions)
        state["tp_stream"] = {"torch": tp_cpu}
        if tp_cuda is not None:
            state["tp_stream"]["cuda"] = tp_cuda
    return state


def _numpy_state(state: tuple[Any, ...]) -> dict[str, Any]:
    bit_generator, keys, pos, has_gauss, cached_gaussian = state
    return {
        "bit_generator": bit_generator,
        "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    np.random.set_state(
        (
            saved["bit_generator"],
            saved["keys"].numpy().astype(np.uint32),
            saved["pos"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
    )
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    stream = state.get("tp_stream")
    if stream is not None:  # else (older checkpoints) the stream keeps its fresh seed
        _, tp_cuda = tp_stream_state()
        if device.type == "cuda" and stream.get("cuda") is not None:
            tp_cuda = stream["cuda"]
        set_tp_stream_state((stream["torch"], tp_cuda))


# -- writing ---------------------------------------------------------------------------------


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


def _describe(err: OSError) -> str:
    """Return one line naming the file and what went wrong."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = "no space left on device"
        if err.errno == errno.EDQUOT:
            reason += " (disk quota exceeded)"
    else:
        reason = err.strerror or str(err)
    return f"{err.filename}: {reason}" if err.filename else reason


def _gather(grid: Any, item: Any) -> list[Any]:
    """Return every rank's ``item`` in rank order (on the host through MPI where it exists)."""
    if grid.world_size == 1:
        return [item]
    if grid.groups.world_comm is not None:
        return grid.groups.world_comm.allgather(item)
    items: list[Any] = [None] * grid.world_size
    dist.all_gather_object(items, item)
    return items


def _agreed(grid: Any, work: Callable[[], Any] | None) -> tuple[list[str], list[Any]]:
    """Run ``work`` on this rank (if any); return every rank's errors and results.

    A collective: all ranks learn of a failure on any one, so all take the same next step.
    """
    error, result = None, None
    if work is not None:
        try:
            result = work()
        except OSError as err:
            error = _describe(err)
    gathered = _gather(grid, (error, result))
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
) -> Path | None:
    """Write the checkpoint of ``step`` (a collective: every rank calls it); return its path.

    ``per_replica``: every dp rank writes its own optimizer state (local SGD's replicas step
    their own), which :func:`read_shard` gives back to the same dp rank.

    If a write fails on any rank, rank 0 removes the partial folder (earlier checkpoints are
    untouched), then with ``on_failure="fail"`` every rank raises the same one-line
    :class:`UserError`; with ``"warn"`` rank 0 passes that line to ``warn`` and every rank
    returns None.
    """
    if on_failure not in ("fail", "warn"):
        raise ValueError(f"on_failure must be fail or warn, not {on_failure!r}")
    root = Path(run_dir) / "checkpoints"
    tmp = _partial(root, step)
    name = shard_file(grid.tp_rank, grid.pp_rank)
    files: dict[str, Any] = {}
    # The distributed optimizer's state differs on every dp rank: each writes its part.
    optimizer = shard.get("optimizer")
    sharded = is_shard_state(optimizer) or per_replica
    if sharded:
        kind = (
            {"format": REPLICAS_FORMAT, "replicas": grid.dp}
            if per_replica
            else {
                "format": SHARDS_FORMAT,
                "shards": grid.dp,
            }
        )
        shard = {**shard, "optimizer": kind}
        optimizer_name = optimizer_file(grid.tp_rank, grid.pp_rank, grid.dp_rank)

    def make_partial() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()

    def write_shard() -> dict[str, Any]:
        written = {}
        if grid.dp_rank == 0:
            written[name] = _write_shard(tmp / name, shard)
        if sharded:
            written[optimizer_name] = _write_shard(tmp / optimizer_name, optimizer)
        return written

    def publish() -> None:
        full_meta = {**meta, "step": step, "tp": grid.tp, "pp": grid.pp, "dp": grid.dp}
        if sharded:
            full_meta["optimizer_replicas" if per_replica else "optimizer_shards"] = grid.dp
        _publish(root, step, full_meta, config_yaml, files)

    # Each phase ends in an all-gather of every rank's error: all ranks stop at the same one.
    errors, _ = _agreed(grid, make_partial if grid.rank == 0 else None)
    if not errors:
        writes = grid.dp_rank == 0 or sharded
        errors, written = _agreed(grid, write_shard if writes else None)
        for part in written:
            files.update(part)
    if not errors:
        errors, _ = _agreed(grid, publish if grid.rank == 0 else None)
    if not errors:
        return root / _name(step)
    if grid.rank == 0:  # every rank is past its writes: nothing else touches the folder
        shutil.rmtree(tmp, ignore_errors=True)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = (
        f"saving the checkpoint of step {step} failed: {errors[0]}{more}; earlier "
        "checkpoints are intact"
    )
    if on_failure == "warn":
        if grid.rank == 0:
            warn(message + "; training goes on")
        return None
    raise UserError(message)


def _publish(
    root: Path, step: int, meta: dict[str, Any], config_yaml: str, files: dict[str, Any]
) -> None:
    """Complete the hidden folder of ``step`` and its manifest, rename it, point `latest` at it."""
    tmp, final = _partial(root, step), root / _name(step)
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
        "files": dict(sorted(files.items())),
    }
    # Last: the manifest vouches for files that are already on disk.
    atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    durable_replace(tmp, final)
    atomic_write(root / LATEST, _name(step) + "\n")


def write_offline(
    run_dir: Path,
    step: int,
    shards: dict[tuple[int, int], dict[str, Any]],
    meta: dict[str, Any],
    config_yaml: str,
    *,
    tp: int,
    pp: int,
    dp: int | None,
) -> Path:
    """Write a whole checkpoint from one process (conversion tools); return its folder."""
    root = Path(run_dir) / "checkpoints"
    tmp = _partial(root, step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = {
            shard_file(*ranks): _write_shard(tmp / shard_file(*ranks), shard)
            for ranks, shard in shards.items()
        }
        # One process writes plain optimizer state into each shard: no dp parts.
        meta = {
            k: v for k, v in meta.items() if k not in ("optimizer_shards", "optimizer_replicas")
        }
        meta = {**meta, "step": step, "tp": tp, "pp": pp, "dp": dp}
        _publish(root, step, meta, config_yaml, files)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"saving the checkpoint of step {step} failed: {_describe(err)}") from None
    return root / _name(step)


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
            warn(f"could not delete the old checkpoint {folder}: {_describe(err)}")
    return doomed


# -- finding and verifying -------------------------------------------------------------------


def step_of(folder: Path) -> int:
    """Return the step a checkpoint folder's name gives (``step_00000200`` -> 200)."""
    match = _STEP_FOLDER.fullmatch(Path(folder).name)
    if not match:
        raise ValueError(f"{folder} is not a checkpoint folder")
    return int(match.group(1))


def checkpoints(run_dir: Path) -> list[Path]:
    """Return the run's checkpoint folders, newest step first (partial folders left out)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _STEP_FOLDER.fullmatch(path.name)) and path.is_dir()
    ]
    return [path for _, path in sorted(found, reverse=True)]


@dataclass(frozen=True)
class Verdict:
    """What :func:`verify` found in one checkpoint folder.

    ``status`` is "ok", "bad", or "unverified" (format 1: no manifest to check against).
    """

    folder: Path
    step: int
    files: int
    bytes: int
    status: str
    reason: str = ""


def checksum(path: Path) -> tuple[int, str]:
    """Return a file's size and CRC-32 (hex), reading it in chunks."""
    size, crc = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return size, f"{crc:08x}"


def _file_problem(path: Path, entry: Any) -> str | None:
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


def _read_json(path: Path) -> Any:
    """Return a JSON file's data; raise ValueError with a short reason if it is not JSON."""
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path.name} is not valid JSON ({err})") from None


def _manifest(folder: Path) -> dict[str, Any] | None:
    """Return a checkpoint's manifest, None if it has none; ValueError if it is unreadable."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    manifest = _read_json(path)
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
    return manifest


def verify(folder: Path) -> Verdict:
    """Return whether every file of a checkpoint folder matches its manifest, and if not why."""
    folder = Path(folder)
    match = _STEP_FOLDER.fullmatch(folder.name)
    step = int(match.group(1)) if match else -1

    def bad(reason: str, files: int = 0, size: int = 0) -> Verdict:
        return Verdict(folder, step, files, size, "bad", reason)

    try:
        manifest = _manifest(folder)
    except (OSError, ValueError) as err:
        return bad(str(err))
    if manifest is None:
        on_disk = [p for p in folder.iterdir() if p.is_file()]
        size = sum(p.stat().st_size for p in on_disk)
        try:
            meta = _read_json(folder / "meta.json")
        except (OSError, ValueError) as err:
            return bad(f"{MANIFEST} is missing and meta.json is unreadable ({err})", len(on_disk))
        if isinstance(meta, dict) and "format_version" not in meta:
            return Verdict(
                folder,
                step,
                len(on_disk),
                size,
                "unverified",
                "format 1 (before manifests): files not checked",
            )
        return bad(f"{MANIFEST} is missing", len(on_disk), size)
    files = manifest["files"]
    size = sum(e.get("bytes", 0) for e in files.values() if isinstance(e, dict))
    problems = [p for name, e in files.items() if (p := _file_problem(folder / name, e))]
    if not problems:
        try:
            meta = _checked_meta(folder / "meta.json", _read_json(folder / "meta.json"))
        except (OSError, ValueError, UserError) as err:
            return bad(str(err), len(files), size)
        expected = {"meta.json", "config.yaml"} | _expected_files(meta)
        problems = [f"{name} is not in {MANIFEST}" for name in sorted(expected - set(files))]
        if meta["step"] != step or manifest.get("step") != step:
            problems.append(f"meta.json says step {meta['step']}, the folder step {step}")
    if problems:
        return bad("; ".join(problems), len(files), size)
    return Verdict(folder, step, len(files), size, "ok")


def _latest_name(root: Path) -> str | None:
    """Return the name `latest` holds, None if there is no `latest`; ValueError if garbage."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_bytes().decode().strip()
    except UnicodeDecodeError:
        name = ""
    if not _STEP_FOLDER.fullmatch(name):
        raise ValueError(f"{pointer} holds no checkpoint name")
    return name


def refuse_unverified(folder: Path, opt_in: str) -> UserError:
    """Return the refusal of a checkpoint without a manifest, naming how to load it anyway."""
    return UserError(
        f"checkpoint {folder} has no manifest.json, so hpcllm cannot check it: it was saved "
        "before manifests (format 1) or its manifest was lost with whatever else; to load it "
        f"unchecked, {opt_in}"
    )


def resumable(
    run_dir: Path,
    warn: Warn,
    allow_unverified: bool = False,
    opt_in: str = "set run.allow_unverified=true",
    acting: str = "resuming from",
) -> Path | None:
    """Return the newest checkpoint folder that verifies, None if the run has no checkpoint.

    ``acting`` says what the caller does with it in the warnings ("resuming from"; "reading"
    for the commands that only read a run).

    The newest checkpoint without a manifest is refused (:func:`refuse_unverified`, naming
    ``opt_in``) unless ``allow_unverified``; then it is taken, with a warning.

    Every checkpoint passed over is reported through ``warn`` with the file and the reason.
    Reads every file of the checkpoints it checks; run it on one rank and share the answer
    (:func:`agreed_resumable`). Raises :class:`UserError` if there are checkpoints and none
    verifies: starting again from step 0 would throw the run away without a word.
    """
    folders = checkpoints(run_dir)
    root = Path(run_dir) / "checkpoints"
    verdicts = []
    for folder in folders:
        verdict = verify(folder)
        verdicts.append(verdict)
        if verdict.status == "bad":
            warn(f"checkpoint {folder} is damaged, skipping it: {verdict.reason}")
            continue
        if verdict.status == "unverified":
            if not allow_unverified:
                raise refuse_unverified(folder, opt_in)
            warn(f"checkpoint {folder} has no manifest; {acting} it unchecked, as asked")
        try:
            pointed = _latest_name(root)
        except ValueError as err:
            warn(f"{err}; {acting} the newest checkpoint that verifies, {folder.name}")
        else:
            if pointed not in (None, folder.name):
                warn(f"{root / LATEST} names {pointed}; {acting} {folder.name}")
        return folder
    if folders:
        raise UserError(
            f"none of the {len(folders)} checkpoints in {root} verifies (newest, "
            f"{folders[0].name}: {verdicts[0].reason}); hpcllm inspect --verify {run_dir} "
            "lists them, run.resume=none starts over"
        )
    return None


def agreed_resumable(
    run_dir: Path, grid: Any, warn: Warn, allow_unverified: bool = False
) -> Path | None:
    """Return :func:`resumable`'s answer on rank 0 to every rank (a collective).

    Rank 0 alone reads and warns; a :class:`UserError` there is raised on every rank.
    """
    answer = None
    if grid.rank == 0:
        try:
            answer = (resumable(run_dir, warn, allow_unverified), None)
        except UserError as err:
            answer = (None, str(err))
    folder, error = _gather(grid, answer)[0]
    if error is not None:
        raise UserError(error)
    return folder


def latest(run_dir: Path) -> Path | None:
    """Return the checkpoint folder `latest` names, or None if the run has none."""
    root = Path(run_dir) / "checkpoints"
    try:
        name = _latest_name(root)
    except ValueError as err:
        raise UserError(f"{err}; hpcllm inspect --verify {run_dir} lists the checkpoints") from None
    if name is None:
        return None
    folder = root / name
    if not (folder / "meta.json").is_file():
        raise UserError(f"{root / LATEST} names {folder.name}, which is missing or incomplete")
    return folder


# -- reading ---------------------------------------------------------------------------------


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _checked_meta(path: Path, meta: Any) -> dict[str, Any]:
    if not (
        isinstance(meta, dict) and all(isinstance(meta.get(k), int) for k in ("step", "tp", "pp"))
    ):
        raise UserError(f"{path} lacks step, tp or pp; the checkpoint is damaged")
    return meta


def read_meta(folder: Path) -> dict[str, Any]:
    """Return a checkpoint's meta.json; one-line :class:`UserError` if it is missing or corrupt."""
    path = Path(folder) / "meta.json"
    try:
        meta = _read_json(path)
    except FileNotFoundError:
        raise UserError(f"{path} is missing; the checkpoint is incomplete") from None
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable: {err}") from None
    return _checked_meta(path, meta)


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
    folder: Path, tp_rank: int, pp_rank: int, tp: int, pp: int, dp_rank: int = 0
) -> dict[str, Any]:
    """Return this rank's shard of a checkpoint, after checking its grid and its checksum.

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
    return read_shard(folder, tp_rank, pp_rank, meta, dp_rank=dp_rank)


def read_shard(
    folder: Path,
    tp_rank: int,
    pp_rank: int,
    meta: dict[str, Any] | None = None,
    *,
    mmap: bool = False,
    check: bool = True,
    dp_rank: int = 0,
) -> dict[str, Any]:
    """Return the (tp_rank, pp_rank) shard of a checkpoint, after checking its checksum.

    ``dp_rank`` picks the optimizer state of that replica where each saved its own.
    ``mmap`` maps the file instead of reading it: tensors that are never touched (the Adam
    moments, when only weights are wanted) are never copied into memory. ``check`` False
    skips the checksum, for a folder :func:`verify` has just passed.
    """
    folder = Path(folder)
    meta = read_meta(folder) if meta is None else meta
    shard = _read_file(folder, shard_file(tp_rank, pp_rank), meta, mmap=mmap, check=check)
    rng = shard.get("rng")
    if rng is not None and isinstance(rng.get("numpy"), tuple):  # format 1: as format 2 holds it
        rng["numpy"] = _numpy_state(rng["numpy"])
    optimizer = shard.get("optimizer")
    if isinstance(optimizer, dict) and optimizer.get("format") == SHARDS_FORMAT:
        # The distributed optimizer's parts, one per dp rank: merged into the plain state,
        # which every reader (and an optimizer at any d) takes.
        parts = [
            _read_file(folder, optimizer_file(tp_rank, pp_rank, r), meta, mmap=mmap, check=check)
            for r in range(optimizer["shards"])
        ]
        shard["optimizer"] = merge_shards(parts)
    elif isinstance(optimizer, dict) and optimizer.get("format") == REPLICAS_FORMAT:
        # Each replica's own state, back to the same dp rank; a rank the saved run did not
        # have (resumed at a larger d) takes dp rank 0's.
        mine = dp_rank if dp_rank < optimizer["replicas"] else 0
        shard["optimizer"] = _read_file(
            folder, optimizer_file(tp_rank, pp_rank, mine), meta, mmap=mmap, check=check
        )
    return shard


def _read_file(
    folder: Path, name: str, meta: dict[str, Any], *, mmap: bool, check: bool
) -> dict[str, Any]:
    """Return one shard file's contents, after checking it against the manifest."""
    path = folder / name
    hint = f"hpcllm inspect --verify {folder.parent.parent} checks every checkpoint"
    if not path.is_file():
        raise UserError(f"checkpoint shard {path} is missing", same_on_all_ranks=False)
    try:
        manifest = _manifest(folder)
    except (OSError, ValueError) as err:
        raise UserError(f"{folder / MANIFEST}: {err}; {hint}", same_on_all_ranks=False) from None
    allowed: list[Any] = []
    if manifest is not None:
        problem = _file_problem(path, manifest["files"].get(path.name)) if check else None
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
            f"checkpoint shard {path} is unreadable ({_first_line(err)}); {hint}",
            same_on_all_ranks=False,
        ) from None
    return shard


def check_same_model(folder: Path, cfg: Config, vocab_size: int) -> None:
    """Refuse, in one line, to resume ``cfg`` from a checkpoint of another model.

    Another layout of the same model (t, p, v, the stage cut) is :mod:`hpcllm.train.reshard`'s
    question, not this one.
    """
    path = Path(folder) / "config.yaml"
    try:
        raw = load_yaml(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise UserError(f"{path} is unreadable ({_first_line(err)})") from None
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
