"""``hpcllm prepare``: corpus → tokenizer → HDF5 shards + manifest, on one rank or many.

Documents are numbered in source order, training inputs first (see :mod:`corpus`). With
``--val-input`` the validation split is exactly those inputs' documents and the train split
every other. Otherwise document ``i`` goes to the validation split when ``floor((i+1)·f) >
floor(i·f)`` for ``--val-fraction f``: exactly ``floor(n·f)`` documents, spread evenly through
the corpus, decided from ``i`` alone. Within its split a document goes to shard ``index mod
shards``, its index being the count of its split's documents before it, and rank ``r`` writes
the shards whose global number (train first, then val) is ``r`` modulo the world size, so
ranks read, tokenize and write disjoint parts with no communication until the manifest.

Rank 0 holds ``--out``'s lock (:mod:`hpcllm.folder_lock`) from before the tokenizer is made to
the end, so a second prepare on the same folder is refused naming the first. The dataset is
written into a staging folder beside ``--out`` and swapped in by :func:`_swap_in`, whose one
commit point is the manifest: a prepare refused, failed or killed at any instant leaves the
whole earlier dataset or the whole new one.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcllm import __version__
from hpcllm.datasets.corpus import Document, Source, find_sources, iter_documents, text_cut
from hpcllm.datasets.shards import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    SPLITS,
    TOKENIZER_FILE,
    ShardWriter,
    token_dtype,
    write_manifest,
)
from hpcllm.datasets.tokenizer import (
    CONFIG_FILE,
    Tokenizer,
    byte_tokenizer,
    load_tokenizer,
    train_bpe,
)
from hpcllm.errors import UserError
from hpcllm.files import atomic_write, durable_replace, fsync_path, partial_path, sweep_partials
from hpcllm.folder_lock import FolderLock, Wording, take

_ENCODE_BATCH = 64
DEFAULT_VAL_FRACTION = 0.01


@dataclass(frozen=True)
class PrepareOptions:
    """What ``hpcllm prepare`` was asked for."""

    out: Path
    inputs: tuple[str, ...] = ()
    corpus: str | None = None
    tokenizer: str = "bpe"
    vocab_size: int | None = None  # BPE only; None: 8192
    val_fraction: float | None = None  # None: DEFAULT_VAL_FRACTION, or none with val_inputs
    shards: int | None = None
    val_shards: int = 1
    text_field: str = "text"  # a JSONL record's field, or a Parquet file's column
    val_inputs: tuple[str, ...] = ()  # the validation split's documents, all of them
    split_on: str | None = None  # a regular expression that cuts text files into documents
    chunk_chars: int | None = None  # or the characters of each piece of a text file

    @property
    def fraction_held_out(self) -> float:
        """Return the fraction of documents held out for validation document by document:
        none where ``val_inputs`` are the validation split."""
        if self.val_inputs:
            return 0.0
        return DEFAULT_VAL_FRACTION if self.val_fraction is None else self.val_fraction

    def check(self) -> None:
        """Raise a UserError for options that cannot work."""
        if bool(self.inputs) == bool(self.corpus):
            raise UserError("give either --input PATH... or --corpus NAME")
        if self.val_inputs and self.val_fraction is not None:
            raise UserError(
                "give --val-input or --val-fraction, not both: each chooses the validation split"
            )
        if self.vocab_size is not None:
            if self.tokenizer != "bpe":
                raise UserError("--vocab-size applies to --tokenizer bpe only")
            if self.vocab_size < 257:
                raise UserError(
                    f"--vocab-size must be at least 257 (256 bytes + EOS), got {self.vocab_size}"
                )
        if not 0 <= self.fraction_held_out < 1:
            raise UserError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.shards is not None and self.shards < 1:
            raise UserError(f"--shards must be positive, got {self.shards}")
        if self.val_shards < 1:
            raise UserError(f"--val-shards must be positive, got {self.val_shards}")
        text_cut(self.split_on, self.chunk_chars)  # a bad regular expression, before any read


class _World:
    """The MPI world when launched by mpirun/srun, or a single process without MPI."""

    def __init__(self) -> None:
        from hpcllm.launcher import detect_launcher, start_mpi

        launch = detect_launcher()
        self.comm = start_mpi().COMM_WORLD if launch.world_size > 1 else None
        self.rank = launch.rank
        self.size = launch.world_size
        self.local_size = launch.local_size

    def share_cores(self, rank0_trains: bool) -> None:
        """Give the tokenizers library's thread pool this rank's share of the node's cores.

        It starts a thread per core by default; ranks x cores threads would fight. Rank 0 keeps
        every core when it trains the BPE, since the other ranks sleep until it is done.
        """
        if rank0_trains and self.rank == 0:
            return
        cores = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        )
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, cores // self.local_size)))

    def _idle_until_all_arrive(self) -> None:
        # Open MPI spins in a blocking collective, taking a core from the rank still working
        # (rank 0 training the tokenizer, a rank with a larger part); poll gently instead.
        request = self.comm.Ibarrier()
        while not request.Test():
            time.sleep(0.005)

    def bcast(self, value: Any) -> Any:
        if self.comm is None:
            return value
        self._idle_until_all_arrive()
        return self.comm.bcast(value, root=0)

    def gather(self, value: Any) -> list[Any] | None:
        if self.comm is None:
            return [value]
        self._idle_until_all_arrive()
        return self.comm.gather(value, root=0)

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.Barrier()


def split_of(doc_id: int, val_fraction: float) -> tuple[str, int]:
    """Return ``(split, index within split)`` of document ``doc_id``."""
    val_before = math.floor(doc_id * val_fraction)
    if math.floor((doc_id + 1) * val_fraction) > val_before:
        return "val", val_before
    return "train", doc_id - val_before


def _split_rule(opts: PrepareOptions) -> Callable[[int, Source], str]:
    """Return the rule that gives a document's split: its source's (``--input`` or
    ``--val-input``), else its id's (:func:`split_of`)."""
    fraction = opts.fraction_held_out
    return lambda doc_id, source: source.split or split_of(doc_id, fraction)[0]


def _documents(
    opts: PrepareOptions, sources: list[Source], wanted: Callable[[str, int], bool]
) -> Iterator[Document]:
    """Yield the documents whose ``(split, index)`` ``wanted`` accepts, as ``opts`` cut them."""
    yield from iter_documents(
        sources,
        _split_rule(opts),
        wanted,
        opts.text_field,
        text_cut(opts.split_on, opts.chunk_chars),
    )


# The files a prepare writes into --out beside the manifest, under their own names
# (train-00000.h5, tokenizer.json) or a generation's (train-00000.g1.h5, tokenizer.g1.json):
# those of them that the manifest does not name are removed (see _swap_in).
_DATASET_FILE = re.compile(
    rf"^(?:(?:{'|'.join(SPLITS)})-\d+(?:\.g\d+)?\.h5"
    rf"|(?:{re.escape(Path(TOKENIZER_FILE).stem)}|{re.escape(Path(CONFIG_FILE).stem)})"
    r"(?:\.g\d+)?\.json)$"
)
_WORDING = Wording(
    writer="prepare", folder="data folder", instead="give this prepare another --out"
)


def _warn(message: str) -> None:
    print(f"hpcllm: warning: {message}", file=sys.stderr, flush=True)


def _say_removed(out: Path, removed: list[Path]) -> None:
    """Say, in one line, which dataset files no manifest named were removed from ``out``."""
    if removed:
        names = ", ".join(p.name for p in removed[:4]) + (", …" if len(removed) > 4 else "")
        print(
            f"hpcllm: removed {len(removed)} file(s) of {out} that its manifest does not name, "
            f"left by a prepare that was killed ({names})",
            file=sys.stderr,
            flush=True,
        )


def _files_of(manifest: dict[str, Any]) -> list[str]:
    """Return the files a manifest names: its tokenizer (and config), then its shards."""
    tokenizer = manifest["tokenizer"]
    names = [tokenizer["file"]] + (
        [tokenizer["config_file"]] if tokenizer.get("config_file") else []
    )
    return names + [
        entry["file"] for split in SPLITS for entry in manifest["splits"].get(split, [])
    ]


def _named_in(folder: Path) -> set[str] | None:
    """Return the files the manifest in ``folder`` names: none where it has no manifest, None
    where its manifest cannot be read."""
    if not (folder / MANIFEST).exists():
        return set()
    try:
        return set(_files_of(json.loads((folder / MANIFEST).read_text())))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _remove_unnamed(out: Path, keep: set[str]) -> list[Path]:
    """Remove the dataset files in ``out`` that are not in ``keep``; return them.

    Those are an earlier dataset's, or a swap's that was killed: no manifest names them. Other
    files (anything not named like a shard or a tokenizer) stay.
    """
    removed = []
    for path in sorted(out.iterdir()):
        if _DATASET_FILE.match(path.name) and path.name not in keep and path.is_file():
            path.unlink()
            removed.append(path)
    return removed


def _with_names(manifest: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Return ``manifest`` with each file it names renamed by ``names``."""
    renamed = copy.deepcopy(manifest)
    tokenizer = renamed["tokenizer"]
    for key in ("file", "config_file"):
        if tokenizer.get(key):
            tokenizer[key] = names[tokenizer[key]]
    for split in SPLITS:
        for entry in renamed["splits"].get(split, []):
            entry["file"] = names[entry["file"]]
    return renamed


def _generation_names(out: Path, files: list[str], taken: set[str]) -> dict[str, str]:
    """Return a name for each of ``files`` that is neither in ``taken`` nor in ``out``:
    ``train-00000.gN.h5`` for ``train-00000.h5``, with the smallest such N."""
    generation = 1
    while True:
        names = {f: f"{Path(f).stem}.g{generation}{Path(f).suffix}" for f in files}
        if not any(n in taken or (out / n).exists() for n in names.values()):
            return names
        generation += 1


def _swap_in(stage: Path, out: Path) -> dict[str, Any]:
    """Replace the dataset in ``out`` by the complete one in ``stage``; return the manifest
    now in ``out``, and remove ``stage``.

    The manifest is the one commit point: whatever instant this is killed at, the manifest in
    ``out`` names files that are all there and all of one dataset (a reader opens only what it
    names), the earlier one or the new one. The new files move in under names the earlier
    dataset does not use: their own where they are free, else a generation's
    (``train-00000.g1.h5``); then the new manifest replaces the old in one rename, and the
    earlier dataset's files go. A generation's files are then hard-linked to their own names
    and a second manifest names those, so a dataset keeps the names it always had; a file
    system without hard links keeps the generation's. Dataset files no manifest names (an
    interrupted swap's) are removed; other files of ``out`` stay.
    """
    new = json.loads((stage / MANIFEST).read_text())
    files = _files_of(new)
    old = _named_in(out) or set()  # a manifest that cannot be read names no dataset
    _remove_unnamed(out, keep=old)
    names = {f: f for f in files}
    if old & set(files):
        names = _generation_names(out, files, old)
    for name in files:
        durable_replace(stage / name, out / names[name])
    if names == {f: f for f in files}:
        durable_replace(stage / MANIFEST, out / MANIFEST)
        _remove_unnamed(out, keep=set(files))
        stage.rmdir()
        return new
    committed = _with_names(new, names)
    atomic_write(out / MANIFEST, json.dumps(committed, indent=2) + "\n")
    _remove_unnamed(out, keep=set(names.values()))  # the earlier dataset goes
    try:
        for name in files:
            os.link(out / names[name], out / name)
        fsync_path(out)
    except OSError:
        # No hard links here (or no room for one): the dataset keeps its generation's names,
        # and the links already made, which no manifest names, go.
        _remove_unnamed(out, keep=set(names.values()))
        return committed
    durable_replace(stage / MANIFEST, out / MANIFEST)
    _remove_unnamed(out, keep=set(files))
    stage.rmdir()
    return new


def _make_tokenizer(opts: PrepareOptions, sources: list[Source], world: _World) -> Tokenizer:
    if opts.tokenizer == "byte":
        return byte_tokenizer()
    if opts.tokenizer != "bpe":
        return load_tokenizer(Path(opts.tokenizer))
    # Rank 0 trains on the training documents only, so validation text stays unseen. Its
    # error, if any, travels with the result so that every rank stops with it.
    spec, error = None, None
    if world.rank == 0:
        # --val-input's sources come last and hold no training document: not even read.
        train_sources = [source for source in sources if source.split != "val"]
        texts = (doc.text for doc in _documents(opts, train_sources, lambda s, _: s == "train"))
        try:
            spec = train_bpe(texts, opts.vocab_size or 8192).spec
        except UserError as err:
            error = str(err)
    spec, error = world.bcast((spec, error))
    if error:
        raise UserError(error)
    return Tokenizer(spec)


def _shard_plan(opts: PrepareOptions, world: _World) -> tuple[int, Callable[[str, int], bool]]:
    n_train = opts.shards or world.size
    owner = {"train": lambda s: s % world.size, "val": lambda s: (n_train + s) % world.size}
    n_shards = {"train": n_train, "val": opts.val_shards}

    def mine(split: str, index: int) -> bool:
        return owner[split](index % n_shards[split]) == world.rank

    return n_train, mine


def prepare(opts: PrepareOptions, progress: bool = True) -> dict[str, Any]:
    """Tokenize the corpus into shards under ``opts.out``; return the manifest (on every rank)."""
    opts.check()
    world = _World()
    world.share_cores(rank0_trains=opts.tokenizer == "bpe")
    started = time.perf_counter()
    sources = find_sources(list(opts.inputs), opts.corpus, list(opts.val_inputs))
    out = opts.out.absolute()  # `--out .` has a parent to stage in too
    held = _lock(out, world)
    try:
        return _prepare_locked(opts, out, sources, world, started, progress)
    finally:
        if held is not None:
            held.release()


def _lock(out: Path, world: _World) -> FolderLock | None:
    """Take ``out``'s lock on rank 0 (None on the others); a refusal is raised on every rank."""
    held, error = None, None
    if world.rank == 0:
        try:
            held = take(out, _warn, _WORDING)
        except UserError as err:
            error = str(err)
    error = world.bcast(error)
    if error:
        raise UserError(error)
    return held


def _prepare_locked(
    opts: PrepareOptions,
    out: Path,
    sources: list[Source],
    world: _World,
    started: float,
    progress: bool,
) -> dict[str, Any]:
    """:func:`prepare` once rank 0 holds ``out``'s lock."""
    # Everything that can refuse runs before anything is written: the tokenizer (a file that
    # must load, or a BPE to train) here, the corpus as it is read. The shards go to a staging
    # folder beside ``out`` and replace its dataset only when complete, so a refused, failed
    # or killed prepare leaves the dataset already there as it was.
    tokenizer = _make_tokenizer(opts, sources, world)
    stage, error = None, None
    if world.rank == 0:
        try:
            sweep_partials(out.parent)  # what a killed prepare left
            sweep_partials(out)
            named = _named_in(out)
            if named is not None:  # else the swap removes them, once the new dataset is whole
                _say_removed(out, _remove_unnamed(out, keep=named))
            stage = partial_path(out)
            stage.mkdir()
        except OSError as err:
            error = f"cannot write to {out}: {err.strerror}"
    stage, error = world.bcast((stage, error))
    if error:
        raise UserError(error)
    try:
        _prepare_into(stage, opts, sources, tokenizer, world, started, progress)
        committed, error = None, None
        if world.rank == 0:
            try:
                committed = _swap_in(stage, out)
            except OSError as err:
                error = f"cannot replace the dataset in {out}: {err.strerror or err}"
        committed, error = world.bcast((committed, error))
        if error:
            raise UserError(error)
    finally:
        if world.rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
    return committed


def _prepare_into(
    stage: Path,
    opts: PrepareOptions,
    sources: list[Source],
    tokenizer: Tokenizer,
    world: _World,
    started: float,
    progress: bool,
) -> dict[str, Any]:
    """Write the tokenizer, every rank's shards and the manifest into ``stage``; return the
    manifest (on every rank)."""
    if world.rank == 0:
        tokenizer.save(stage / TOKENIZER_FILE)
    tokenizer_ready = time.perf_counter()
    n_train, mine = _shard_plan(opts, world)
    n_shards = {"train": n_train, "val": opts.val_shards}

    writers: dict[tuple[str, int], ShardWriter] = {}
    staged = dataclasses.replace(opts, out=stage)
    try:
        _tokenize_into(writers, staged, sources, tokenizer, mine, n_shards, world, progress)
        entries = [(split, index, w.commit()) for (split, index), w in sorted(writers.items())]
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    gathered = world.gather(entries)

    manifest, error = None, None
    if world.rank == 0:
        timing = {
            "setup_s": tokenizer_ready - started,
            "tokenize_s": time.perf_counter() - tokenizer_ready,
        }
        manifest, error = _manifest(opts, sources, tokenizer, gathered, started, timing)
        if manifest is not None:
            write_manifest(stage, manifest)
    manifest, error = world.bcast((manifest, error))
    if error:
        raise UserError(error)
    return manifest


def _tokenize_into(
    writers: dict[tuple[str, int], ShardWriter],
    opts: PrepareOptions,
    sources: list[Source],
    tokenizer: Tokenizer,
    mine: Callable[[str, int], bool],
    n_shards: dict[str, int],
    world: _World,
    progress: bool,
) -> None:
    from tqdm import tqdm

    bar = tqdm(
        desc=f"tokenizing ({world.size} ranks)",
        unit="B",
        unit_scale=True,
        disable=not progress or world.rank != 0 or None,
        leave=False,
    )
    batch: list[Document] = []
    checked = []

    def flush() -> None:
        encoded = tokenizer.encode_batch([doc.text for doc in batch])
        if not checked and batch:
            checked.append(True)
            if tokenizer.decode(encoded[0]) != batch[0].text:
                # A tokenizer.json with a normaliser (lower-casing, say) loses text.
                print(
                    f"hpcllm: warning (rank {world.rank}): the tokenizer does not give "
                    f"back document {batch[0].doc_id} exactly; decoded shards will differ from "
                    "the input text",
                    file=sys.stderr,
                    flush=True,
                )
        for doc, ids in zip(batch, encoded, strict=True):
            key = (doc.split, doc.index % n_shards[doc.split])
            if key not in writers:
                writers[key] = ShardWriter(
                    opts.out,
                    doc.split,
                    key[1],
                    vocab_size=tokenizer.vocab_size,
                    eos_id=tokenizer.eos_id,
                    tokenizer_sha256=tokenizer.sha256,
                )
            size = len(doc.text.encode("utf-8"))
            writers[key].append(
                doc.doc_id, tokenizer.with_bos(ids), sources[doc.source].label, size
            )
            bar.update(size)
        batch.clear()

    for doc in _documents(opts, sources, mine):
        batch.append(doc)
        if len(batch) == _ENCODE_BATCH:
            flush()
    flush()
    bar.close()


def _manifest(
    opts: PrepareOptions,
    sources: list[Source],
    tokenizer: Tokenizer,
    gathered: list[Any],
    started: float,
    timing: dict[str, float],
) -> tuple[dict | None, str | None]:
    splits: dict[str, list[dict[str, Any]]] = {split: [] for split in SPLITS}
    for split, _, entry in sorted(
        (e for rank_entries in gathered for e in rank_entries), key=lambda e: (e[0], e[1])
    ):
        splits[split].append(entry)
    split_bytes = {split: sum(e["text_bytes"] for e in splits[split]) for split in SPLITS}
    text_bytes = sum(split_bytes.values())
    label = opts.corpus or ", ".join(opts.inputs)
    if text_bytes == 0:
        return None, f"the corpus {label} is empty: no document has any text"
    if opts.val_inputs and split_bytes["train"] == 0:
        return None, f"the training input {label} is empty: no document has any text"
    if opts.val_inputs and split_bytes["val"] == 0:
        return None, (
            f"the validation input {', '.join(opts.val_inputs)} is empty: no document has any text"
        )
    if not splits["train"]:
        return None, "no document went to the train split; lower --val-fraction"
    seconds = time.perf_counter() - started
    kind = opts.tokenizer if opts.tokenizer in ("bpe", "byte") else "file"
    if kind == "file" and Path(opts.tokenizer).is_dir():
        kind = "folder"
    config = {}
    if tokenizer.config is not None:  # a Hugging Face folder's: its BOS and EOS
        config = {
            "config_file": CONFIG_FILE,
            "config_sha256": hashlib.sha256(tokenizer.config.encode()).hexdigest(),
        }
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_by": f"hpcllm {__version__}",
        "tokenizer": {
            "file": TOKENIZER_FILE,
            "kind": kind,
            "sha256": tokenizer.sha256,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "bos_id": tokenizer.bos_id,
            **config,
        },
        "token_dtype": token_dtype(tokenizer.vocab_size).name,
        "val_fraction": None if opts.val_inputs else opts.fraction_held_out,
        "sources": {
            "corpus": opts.corpus,
            "inputs": list(opts.inputs),
            "val_inputs": list(opts.val_inputs),
            "files": len(sources),
            "split_on": opts.split_on,
            "chunk_chars": opts.chunk_chars,
        },
        "splits": splits,
        "n_documents": {s: sum(e["n_documents"] for e in splits[s]) for s in SPLITS},
        "n_tokens": {s: sum(e["n_tokens"] for e in splits[s]) for s in SPLITS},
        "text_bytes": text_bytes,
        # Throughput of the whole prepare, and of tokenizing + writing alone (after the
        # tokenizer is trained or loaded), which is the part that scales with ranks.
        "prepare": {
            "ranks": len(gathered),
            "seconds": round(seconds, 3),
            "mb_per_s": round(text_bytes / 1e6 / seconds, 3),
            "setup_seconds": round(timing["setup_s"], 3),
            "tokenize_seconds": round(timing["tokenize_s"], 3),
            "tokenize_mb_per_s": round(text_bytes / 1e6 / timing["tokenize_s"], 3),
        },
    }
    return manifest, None
