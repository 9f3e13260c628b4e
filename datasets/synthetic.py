"""Synthetic data (``data.synthetic: true``): random tokens in place of prepared shards.

A benchmark of the step needs no corpus: the tokens only have to be ids the model accepts. The
synthetic data is a :class:`~hpcllm.datasets.shards.Manifest` with no shards and no tokenizer
file; its token streams are uniform random ids over the model's vocabulary, a pure function of
``(data.seed, split, position)``, so every rank, every resume and every re-cut reads the same
tokens at the same position, as with real shards. The reader's order, epochs and resume
arithmetic are the real data's (``hpcllm.datasets.reader``); only the reads differ.

The streams are long enough for a benchmark (``TRAIN_TOKENS`` and ``VAL_TOKENS``) and no
longer, so the reader's epoch permutation stays cheap. A run trained on synthetic data records
it in its folder (``RUN_RECORD``: tokenizer ``synthetic`` and the vocabulary size); resuming it
on real data, or a real-data run on synthetic data, is refused (:func:`check_run_data`): the
weights of one have learnt nothing the other's ids mean.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpcllm.datasets.shards import Manifest, load_manifest, make_data_hint, token_dtype
from hpcllm.errors import UserError

SYNTHETIC = "synthetic"
# The vocabulary when model.vocab_size is null: GPT-2's BPE, the size benchmarks compare at.
DEFAULT_VOCAB = 50257
TRAIN_TOKENS = 1 << 27
VAL_TOKENS = 1 << 20
# Tokens drawn per generator: a window reads one or two blocks.
BLOCK = 1 << 12
# What a run folder trained on synthetic data holds in place of tokenizer.json.
RUN_RECORD = "synthetic-data.json"
_SPLIT_KEYS = {"train": 0, "val": 1}


class SyntheticManifest(Manifest):
    """The manifest of synthetic data: ``vocab_size`` random ids, ``seed``, no files."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        raw = {
            "format": SYNTHETIC,
            "tokenizer": {
                "kind": SYNTHETIC,
                "file": None,
                "sha256": SYNTHETIC,
                "vocab_size": vocab_size,
                "eos_id": None,
            },
            "seed": seed,
        }
        super().__init__(Path(SYNTHETIC), raw, {"train": [], "val": []})

    @property
    def synthetic(self) -> bool:
        return True

    @property
    def seed(self) -> int:
        """Return the seed the tokens are drawn from."""
        return int(self.raw["seed"])

    def n_tokens(self, split: str) -> int:
        """Return the tokens of ``split``."""
        return TRAIN_TOKENS if split == "train" else VAL_TOKENS

    def n_documents(self, split: str) -> int:
        """Return 0: synthetic tokens have no documents."""
        return 0

    def check_same_tokenizer(self, tokenizer: Path, owner: str) -> None:
        """Raise a UserError when ``owner`` has a tokenizer (it was trained on real data)."""
        if tokenizer.is_file():
            raise UserError(
                f"{owner} was trained on data tokenized with {tokenizer}, and data.synthetic "
                "has no tokenizer: resume it with its data.path (data.synthetic=false), or "
                "start another run (run.dir)"
            )


def synthetic_manifest(vocab_size: int | None, seed: int) -> SyntheticManifest:
    """Return the synthetic data of ``vocab_size`` ids (null: :data:`DEFAULT_VOCAB`)."""
    return SyntheticManifest(vocab_size or DEFAULT_VOCAB, seed)


def load_data(synthetic: bool, path: str | Path, vocab_size: int | None, seed: int) -> Manifest:
    """Return the data a run reads: synthetic (``data.synthetic``) or the prepared folder."""
    if synthetic:
        return synthetic_manifest(vocab_size, seed)
    if not Path(path).exists():
        raise UserError(
            f"data path {path} does not exist; {make_data_hint(path)}, or set "
            "data.synthetic=true for random tokens"
        )
    return load_manifest(path)


def record_run(run_dir: Path, manifest: SyntheticManifest) -> None:
    """Write what a run trained on synthetic data records: tokenizer and vocabulary size."""
    from hpcllm.files import atomic_write

    record = {"tokenizer": SYNTHETIC, "vocab_size": manifest.vocab_size, "seed": manifest.seed}
    atomic_write(run_dir / RUN_RECORD, json.dumps(record, indent=2) + "\n")


def trained_on_synthetic(run_dir: Path) -> bool:
    """Return whether the run in ``run_dir`` was trained on synthetic data."""
    return (Path(run_dir) / RUN_RECORD).is_file()


def check_run_data(run_dir: Path, manifest: Manifest, owner: str) -> None:
    """Raise a UserError unless ``manifest``'s data means what the run in ``run_dir`` learnt:
    the same tokenizer (:meth:`Manifest.check_same_tokenizer`), and synthetic data only for a
    run trained on it."""
    run_dir = Path(run_dir)
    if trained_on_synthetic(run_dir) and not manifest.synthetic:
        raise UserError(
            f"{owner} was trained on synthetic data (data.synthetic: true), so its weights "
            f"learnt no tokenizer and {manifest.root} means nothing to it: resume it with "
            "data.synthetic=true, or start another run (run.dir)"
        )
    manifest.check_same_tokenizer(run_dir / "tokenizer.json", owner)


class SyntheticStream:
    """The token stream of one split of synthetic data (``TokenStream``'s reads)."""

    def __init__(self, manifest: SyntheticManifest, split: str) -> None:
        if split not in _SPLIT_KEYS:
            raise UserError(f"unknown split {split!r}; choose train or val")
        self.manifest, self.split = manifest, split
        self.n_tokens = manifest.n_tokens(split)
        self.vocab_size = manifest.vocab_size
        self._key = (manifest.seed, _SPLIT_KEYS[split])
        self._dtype = token_dtype(self.vocab_size)
        self._cached: tuple[int, np.ndarray] | None = None

    def block(self, index: int) -> np.ndarray:
        """Return block ``index``'s :data:`BLOCK` tokens (the last one read is kept)."""
        if self._cached is None or self._cached[0] != index:
            rng = np.random.default_rng([*self._key, index])
            self._cached = (index, rng.integers(0, self.vocab_size, BLOCK, dtype=self._dtype))
        return self._cached[1]

    def read_into(self, out: np.ndarray, start: int) -> None:
        """Fill the 1-D array ``out`` with the tokens at ``[start, start + len(out))``."""
        if start < 0 or start + out.size > self.n_tokens:
            raise IndexError(start)
        done = 0
        while done < out.size:
            index, offset = divmod(start + done, BLOCK)
            take = min(out.size - done, BLOCK - offset)
            out[done : done + take] = self.block(index)[offset : offset + take]
            done += take

    def close(self) -> None:
        """Nothing is open."""
