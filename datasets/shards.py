"""The HDF5 shard format: writing shards atomically, the manifest, and checking both.

The format is documented in ``datasets/README.md``; ``FORMAT_VERSION`` changes with it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcllm.errors import UserError
from hpcllm.files import atomic_write, durable_replace, partial_path

FORMAT = "hpcllm-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
# Tokens per HDF5 chunk: each chunk carries its own fletcher32 checksum. 64 Ki tokens is 128 KiB
# at uint16: large enough for fast sequential reads, small enough that a random 1 Ki-token
# sample does not drag in much more than it needs when the chunk cache misses.
CHUNK_TOKENS = 1 << 16
# Buffered tokens before an append to the HDF5 dataset.
_FLUSH_TOKENS = 1 << 22


def token_dtype(vocab_size: int) -> np.dtype:
    """Return uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def shard_name(split: str, index: int) -> str:
    """Return the file name of shard ``index`` of ``split``."""
    return f"{split}-{index:05d}.h5"


class ShardWriter:
    """Writes one shard: documents are appended, each followed by EOS, then committed.

    Data goes to a hidden partial file; :meth:`commit` renames it to its final name only when
    the file is complete and closed, so a crash never leaves a shard that looks finished.
    """

    def __init__(
        self,
        out_dir: Path,
        split: str,
        index: int,
        *,
        vocab_size: int,
        eos_id: int,
        tokenizer_sha256: str,
    ) -> None:
        import h5py

        self.path = out_dir / shard_name(split, index)
        self._partial = partial_path(self.path)
        self._dtype = token_dtype(vocab_size)
        self._eos = eos_id
        self._file = h5py.File(self._partial, "w")
        self._file.attrs.update(
            format=FORMAT,
            format_version=FORMAT_VERSION,
            split=split,
            shard_index=index,
            tokenizer_sha256=tokenizer_sha256,
            vocab_size=vocab_size,
            eos_id=eos_id,
        )
        self._tokens = self._file.create_dataset(
            "tokens",
            shape=(0,),
            maxshape=(None,),
            dtype=self._dtype,
            chunks=(CHUNK_TOKENS,),
            fletcher32=True,
        )
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._written = 0
        self._offsets = [0]
        self._doc_ids: list[int] = []
        self._sources: dict[str, None] = {}
        self.text_bytes = 0

    @property
    def n_documents(self) -> int:
        """Return the number of documents appended so far."""
        return len(self._doc_ids)

    def append(self, doc_id: int, ids: list[int], source: str, text_bytes: int) -> None:
        """Add one document's token ids (EOS is appended here)."""
        array = np.empty(len(ids) + 1, dtype=self._dtype)
        array[:-1] = ids
        array[-1] = self._eos
        self._buffer.append(array)
        self._buffered += array.size
        self._offsets.append(self._offsets[-1] + array.size)
        self._doc_ids.append(doc_id)
        self._sources.setdefault(source, None)
        self.text_bytes += text_bytes
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        block = np.concatenate(self._buffer)
        self._tokens.resize((self._written + block.size,))
        self._tokens[self._written :] = block
        self._written += block.size
        self._buffer, self._buffered = [], 0

    def commit(self) -> dict[str, Any]:
        """Finish the file, give it its final name, and return its manifest entry."""
        self._flush()
        n_tokens = self._written
        for name, values in (("doc_offsets", self._offsets), ("doc_ids", self._doc_ids)):
            self._file.create_dataset(
                name,
                data=np.asarray(values, dtype=np.int64),
                fletcher32=True,
                chunks=True if values else None,
            )
        self._file.attrs.update(
            n_documents=self.n_documents,
            n_tokens=n_tokens,
            text_bytes=self.text_bytes,
            sources=json.dumps(list(self._sources)),
        )
        self._file.close()
        durable_replace(self._partial, self.path)
        return {
            "file": self.path.name,
            "n_documents": self.n_documents,
            "n_tokens": n_tokens,
            "text_bytes": self.text_bytes,
        }

    def discard(self) -> None:
        """Drop the partial file (after an error)."""
        if self._file.id.valid:
            self._file.close()
        self._partial.unlink(missing_ok=True)


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` atomically; it is the last file prepare writes."""
    path = out_dir / MANIFEST
    atomic_write(path, json.dumps(manifest, indent=2) + "\n")
    return path


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the manifest lists it."""

    path: Path
    n_documents: int
    n_tokens: int
    text_bytes: int


@dataclass(frozen=True)
class Manifest:
    """A prepared data folder: its shards per split and the tokenizer they were made with."""

    root: Path
    raw: dict[str, Any]
    shards: dict[str, list[ShardInfo]]

    @property
    def synthetic(self) -> bool:
        """Return whether this is synthetic data (``hpcllm.datasets.synthetic``): no files."""
        return False

    @property
    def tokenizer_path(self) -> Path:
        """Return the tokenizer file saved beside the shards."""
        return self.root / self.raw["tokenizer"]["file"]

    @property
    def tokenizer_config_path(self) -> Path | None:
        """Return the tokenizer_config.json saved beside the shards (None: none was)."""
        name = self.raw["tokenizer"].get("config_file")
        return self.root / name if name else None

    def load_tokenizer(self) -> Any:
        """Return the tokenizer this data was made with (a
        :class:`hpcllm.datasets.tokenizer.Tokenizer`), with the BOS and EOS it used."""
        from hpcllm.datasets.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer_path, self.tokenizer_config_path)

    @property
    def tokenizer_sha256(self) -> str:
        """Return the hash every shard must carry."""
        return self.raw["tokenizer"]["sha256"]

    @property
    def vocab_size(self) -> int:
        """Return the tokenizer's vocabulary size."""
        return int(self.raw["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        """Return the id that ends each document."""
        return int(self.raw["tokenizer"]["eos_id"])

    @property
    def bos_id(self) -> int | None:
        """Return the id that starts each document (None: none does)."""
        bos = self.raw["tokenizer"].get("bos_id")
        return None if bos is None else int(bos)

    def check_same_tokenizer(self, tokenizer: Path, owner: str) -> None:
        """Raise a UserError when the file ``tokenizer`` (``owner``'s: a run folder's
        tokenizer.json) is not the tokenizer this data was made with; a missing file passes.

        Two tokenizers with the same vocabulary size give the same token ids different
        meanings, so the vocabulary check alone cannot catch this.
        """
        if not tokenizer.is_file():
            return
        theirs = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
        if theirs != self.tokenizer_sha256:
            raise UserError(
                f"{self.root} was tokenized with another tokenizer than {owner}: sha256 "
                f"{self.tokenizer_sha256[:12]}… against {theirs[:12]}… ({tokenizer}); prepare "
                "the data with that tokenizer (hpcllm prepare --tokenizer FILE)"
            )

    def n_tokens(self, split: str) -> int:
        """Return the tokens of ``split``, EOS included."""
        return sum(s.n_tokens for s in self.shards[split])

    def n_documents(self, split: str) -> int:
        """Return the documents of ``split``."""
        return sum(s.n_documents for s in self.shards[split])


def make_data_hint(path: str | Path) -> str:
    """Return how to make a prepared folder at ``path``, for the errors that find none."""
    return (
        f"`hpcllm prepare --out {path}` makes it (`--corpus python-stdlib` for the built-in "
        "corpus; `hpcllm prepare --help` lists the inputs)"
    )


def load_manifest(path: str | Path) -> Manifest:
    """Return the manifest of a prepared folder (or of its manifest.json), checked for sense.

    Checks what is cheap: the file exists and parses, its version is known, every shard and
    the tokenizer exist, and the tokenizer file hashes to what the manifest says. Shard
    contents are checked when opened (:func:`check_shard_header`) or by ``--verify``.
    """
    path = Path(path)
    manifest_path = path / MANIFEST if path.is_dir() else path
    if not manifest_path.is_file():
        if path.is_dir():
            raise UserError(
                f"{path} has no {MANIFEST}; {make_data_hint(path)} "
                "(a prepare that did not finish writes no manifest)"
            )
        raise UserError(f"data path {path} does not exist; {make_data_hint(path)}")
    try:
        raw = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{manifest_path} is not valid JSON: {err}") from None
    if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"{manifest_path}: format {raw.get('format')!r} version "
            f"{raw.get('format_version')!r} is not {FORMAT} v{FORMAT_VERSION}"
        )
    root = manifest_path.parent
    shards = {
        split: [
            ShardInfo(
                root / s["file"],
                int(s["n_documents"]),
                int(s["n_tokens"]),
                int(s.get("text_bytes", 0)),
            )
            for s in raw["splits"].get(split, [])
        ]
        for split in SPLITS
    }
    manifest = Manifest(root, raw, shards)
    if not manifest.tokenizer_path.is_file():
        raise UserError(f"tokenizer {manifest.tokenizer_path} named by {manifest_path} is missing")
    digest = hashlib.sha256(manifest.tokenizer_path.read_bytes()).hexdigest()
    if digest != manifest.tokenizer_sha256:
        raise UserError(
            f"{manifest.tokenizer_path} does not match {manifest_path} "
            f"(sha256 {digest[:12]}… vs {manifest.tokenizer_sha256[:12]}…)"
        )
    config = manifest.tokenizer_config_path
    if config is not None:
        if not config.is_file():
            raise UserError(f"tokenizer config {config} named by {manifest_path} is missing")
        digest = hashlib.sha256(config.read_bytes()).hexdigest()
        if digest != manifest.raw["tokenizer"].get("config_sha256"):
            raise UserError(f"{config} does not match {manifest_path} (sha256 {digest[:12]}…)")
    for shard in (s for split in SPLITS for s in shards[split]):
        if not shard.path.is_file():
            raise UserError(f"shard {shard.path} named by {manifest_path} is missing")
    return manifest


def check_shard_header(manifest: Manifest, shard: ShardInfo, handle: Any) -> None:
    """Raise a UserError if an open shard's attributes disagree with the manifest."""
    attrs = handle.attrs
    problems = []
    if attrs.get("format") != FORMAT or attrs.get("format_version") != FORMAT_VERSION:
        problems.append(f"format {attrs.get('format')!r} v{attrs.get('format_version')!r}")
    if attrs.get("tokenizer_sha256") != manifest.tokenizer_sha256:
        problems.append("made with another tokenizer")
    if (
        int(attrs.get("n_tokens", -1)) != shard.n_tokens
        or handle["tokens"].shape[0] != shard.n_tokens
    ):
        problems.append(f"{handle['tokens'].shape[0]} tokens, manifest says {shard.n_tokens}")
    if int(attrs.get("n_documents", -1)) != shard.n_documents:
        problems.append(f"{attrs.get('n_documents')} documents, manifest says {shard.n_documents}")
    if problems:
        raise UserError(
            f"shard {shard.path} does not match {manifest.root / MANIFEST}: " + "; ".join(problems)
        )


def open_shard(manifest: Manifest, shard: ShardInfo, cache_bytes: int = 64 << 20) -> Any:
    """Return the open h5py file of ``shard`` after checking its header."""
    import h5py

    try:
        handle = h5py.File(shard.path, "r", rdcc_nbytes=cache_bytes, rdcc_nslots=10007)
    except OSError as err:
        raise UserError(
            f"shard {shard.path} is not a readable HDF5 file ({err})", same_on_all_ranks=False
        ) from None
    try:
        check_shard_header(manifest, shard, handle)
    except (UserError, KeyError) as err:
        handle.close()
        if isinstance(err, KeyError):
            raise UserError(f"shard {shard.path} lacks dataset {err}") from None
        raise
    return handle


def corrupt(shard_path: Path, what: str, err: Exception) -> UserError:
    """Return the error for a shard whose checksum (or structure) failed on read."""
    return UserError(
        f"shard {shard_path} is corrupt: {what} failed its checksum ({err})",
        same_on_all_ranks=False,
    )


def verify_shard(manifest: Manifest, shard: ShardInfo) -> None:
    """Read every chunk of a shard (checking fletcher32) and its counts; raise if bad."""
    handle = open_shard(manifest, shard)
    try:
        tokens = handle["tokens"]
        for start in range(0, tokens.shape[0], CHUNK_TOKENS * 16):
            try:
                block = tokens[start : start + CHUNK_TOKENS * 16]
            except OSError as err:
                raise corrupt(shard.path, f"tokens[{start}:]", err) from None
            if block.size and int(block.max()) >= manifest.vocab_size:
                raise UserError(
                    f"shard {shard.path} is corrupt: token id {int(block.max())} "
                    f">= vocab size {manifest.vocab_size}"
                )
        try:
            offsets = handle["doc_offsets"][:]
            doc_ids = handle["doc_ids"][:]
        except OSError as err:
            raise corrupt(shard.path, "document index", err) from None
        ok = (
            offsets.size == shard.n_documents + 1
            and doc_ids.size == shard.n_documents
            and offsets[0] == 0
            and offsets[-1] == shard.n_tokens
            and bool(np.all(np.diff(offsets) >= 1))
        )
        if not ok:
            raise UserError(
                f"shard {shard.path} is corrupt: document offsets do not add up "
                f"to {shard.n_documents} documents of {shard.n_tokens} tokens"
            )
        if shard.n_documents and not np.all(tokens[offsets[1:] - 1] == manifest.eos_id):
            raise UserError(f"shard {shard.path} is corrupt: a document does not end with EOS")
    finally:
        handle.close()
