"""``hpcllm prepare``: corpus → tokenizer → HDF5 shards + manifest, on one rank or many.

Documents are numbered in source order (see :mod:`corpus`). Document ``i`` goes to the
validation split when ``floor((i+1)·f) > floor(i·f)`` for ``--val-fraction f``: exactly
``floor(n·f)`` documents, spread evenly through the corpus, decided from ``i`` alone. Within
its split a document goes to shard ``index_in_split mod shards``, and rank ``r`` writes the
shards whose global number (train first, then val) is ``r`` modulo the world size, so ranks
read, tokenize and write disjoint parts with no communication until the manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcllm import __version__
from hpcllm.datasets.corpus import Source, find_sources, iter_documents
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
from hpcllm.files import durable_replace, partial_path, sweep_partials

_ENCODE_BATCH = 64


@dataclass(frozen=True)
class PrepareOptions:
    """What ``hpcllm prepare`` was asked for."""

    out: Path
    inputs: tuple[str, ...] = ()
    corpus: str | None = None
    tokenizer: str = "bpe"
    vocab_size: int | None = None  # BPE only; None: 8192
    val_fraction: float = 0.01
    shards: int | None = None
    val_shards: int = 1
    jsonl_field: str = "text"

    def check(self) -> None:
        """Raise a UserError for options that cannot work."""
        if bool(self.inputs) == bool(self.corpus):
            raise UserError("give either --input PATH... or --corpus NAME")
        if self.vocab_size is not None:
            if self.tokenizer != "bpe":
                raise UserError("--vocab-size applies to --tokenizer bpe only")
            if self.vocab_size < 257:
                raise UserError(
                    f"--vocab-size must be at least 257 (256 bytes + EOS), got {self.vocab_size}"
                )
        if not 0 <= self.val_fraction < 1:
            raise UserError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.shards is not None and self.shards < 1:
            raise UserError(f"--shards must be positive, got {self.shards}")
        if self.val_shards < 1:
            raise UserError(f"--val-shards must be positive, got {self.val_shards}")


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


def _swap_in(stage: Path, out: Path) -> None:
    """Replace the dataset in ``out`` by the complete one in ``stage``, and remove ``stage``.

    The old manifest goes first (from then on no reader takes the old dataset), then its shards,
    then the new shards and tokenizer move in and the new manifest comes last: a reader sees
    the old dataset, no dataset, or the new one. Files of ``out`` that are not a dataset's stay.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    (out / CONFIG_FILE).unlink(missing_ok=True)  # an earlier tokenizer's; the new one's comes
    for pattern in ("train-*.h5", "val-*.h5"):
        for path in out.glob(pattern):
            path.unlink()
    for path in sorted(stage.iterdir()):
        if path.name != MANIFEST:
            durable_replace(path, out / path.name)
    durable_replace(stage / MANIFEST, out / MANIFEST)
    stage.rmdir()


def _make_tokenizer(opts: PrepareOptions, sources: list[Source], world: _World) -> Tokenizer:
    if opts.tokenizer == "byte":
        return byte_tokenizer()
    if opts.tokenizer != "bpe":
        return load_tokenizer(Path(opts.tokenizer))
    # Rank 0 trains on the training documents only, so validation text stays unseen. Its
    # error, if any, travels with the result so that every rank stops with it.
    spec, error = None, None
    if world.rank == 0:
        texts = (
            text
            for _, _, text in iter_documents(
                sources, lambda i: split_of(i, opts.val_fraction)[0] == "train", opts.jsonl_field
            )
        )
        try:
            spec = train_bpe(texts, opts.vocab_size or 8192).spec
        except UserError as err:
            error = str(err)
    spec, error = world.bcast((spec, error))
    if error:
        raise UserError(error)
    return Tokenizer(spec)


def _shard_plan(opts: PrepareOptions, world: _World) -> tuple[int, Callable[[int], bool]]:
    n_train = opts.shards or world.size
    owner = {"train": lambda s: s % world.size, "val": lambda s: (n_train + s) % world.size}
    n_shards = {"train": n_train, "val": opts.val_shards}

    def mine(doc_id: int) -> bool:
        split, index = split_of(doc_id, opts.val_fraction)
        return owner[split](index % n_shards[split]) == world.rank

    return n_train, mine


def prepare(opts: PrepareOptions, progress: bool = True) -> dict[str, Any]:
    """Tokenize the corpus into shards under ``opts.out``; return the manifest (on every rank)."""
    opts.check()
    world = _World()
    world.share_cores(rank0_trains=opts.tokenizer == "bpe")
    started = time.perf_counter()
    sources = find_sources(list(opts.inputs), opts.corpus)
    out = opts.out.absolute()  # `--out .` has a parent to stage in too
    # Everything that can refuse runs before anything is written: the tokenizer (a file that
    # must load, or a BPE to train) here, the corpus as it is read. The shards go to a staging
    # folder beside ``out`` and replace its dataset only when complete, so a refused, failed
    # or killed prepare leaves the dataset already there as it was.
    tokenizer = _make_tokenizer(opts, sources, world)
    stage, error = None, None
    if world.rank == 0:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            sweep_partials(out.parent)  # what a killed prepare left
            sweep_partials(out)
            stage = partial_path(out)
            stage.mkdir()
        except OSError as err:
            error = f"cannot write to {out}: {err.strerror}"
    stage, error = world.bcast((stage, error))
    if error:
        raise UserError(error)
    try:
        manifest = _prepare_into(stage, opts, sources, tokenizer, world, started, progress)
        if world.rank == 0:
            _swap_in(stage, out)
    finally:
        if world.rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
    return manifest


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
    mine: Callable[[int], bool],
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
    batch: list[tuple[int, int, str]] = []
    checked = []

    def flush() -> None:
        encoded = tokenizer.encode_batch([text for _, _, text in batch])
        if not checked and batch:
            checked.append(True)
            if tokenizer.decode(encoded[0]) != batch[0][2]:
                # A tokenizer.json with a normaliser (lower-casing, say) loses text.
                print(
                    f"hpcllm: warning (rank {world.rank}): the tokenizer does not give "
                    f"back document {batch[0][0]} exactly; decoded shards will differ from "
                    "the input text",
                    file=sys.stderr,
                    flush=True,
                )
        for (doc_id, source_index, text), ids in zip(batch, encoded, strict=True):
            split, index = split_of(doc_id, opts.val_fraction)
            key = (split, index % n_shards[split])
            if key not in writers:
                writers[key] = ShardWriter(
                    opts.out,
                    split,
                    key[1],
                    vocab_size=tokenizer.vocab_size,
                    eos_id=tokenizer.eos_id,
                    tokenizer_sha256=tokenizer.sha256,
                )
            size = len(text.encode("utf-8"))
            writers[key].append(doc_id, tokenizer.with_bos(ids), sources[source_index].label, size)
            bar.update(size)
        batch.clear()

    for item in iter_documents(sources, mine, opts.jsonl_field):
        batch.append(item)
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
    text_bytes = sum(e["text_bytes"] for split in SPLITS for e in splits[split])
    if text_bytes == 0:
        label = opts.corpus or ", ".join(opts.inputs)
        return None, f"the corpus {label} is empty: no document has any text"
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
        "val_fraction": opts.val_fraction,
        "sources": {"corpus": opts.corpus, "inputs": list(opts.inputs), "files": len(sources)},
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
