"""Small corpora made on the spot, and helpers to read shards back for the data tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hpcllm.datasets.prepare import PrepareOptions, prepare, split_of

TEXTS = [
    "def f(x):\n    return x * 2\n",
    "Ünïcödé tëxt — with “quotes”, emoji 🚀 and CJK 漢字.\n\nSecond paragraph.\n",
    "short",
    "\n\n  leading blank lines and trailing spaces   \n",
    "tabs\tand\r\nwindows line ends\r\n",
    "# " + "long line of text " * 400 + "\n",
    "x = [i ** 2 for i in range(10)]\nprint(x)\n",
    "The quick brown fox jumps over the lazy dog. " * 50,
    "a document may mention <|endoftext|> as text; it must stay text\n",
]
JSONL_TEXTS = ["first json document", "second one\nwith a newline", "third: ü ß ø"]


def make_corpus(root: Path) -> tuple[list[str], list[str]]:
    """Write a multi-file corpus (nested folder, JSONL); return (inputs, documents in order)."""
    (root / "a" / "nested").mkdir(parents=True)
    docs = []
    for i, text in enumerate(TEXTS):
        folder = root / "a" / "nested" if i % 3 == 0 else root / "a"
        (folder / f"doc{i:02d}.txt").write_bytes(text.encode("utf-8"))
    (root / "a" / "ignored.bin").write_bytes(b"\x00\xff")  # not a text suffix: skipped
    with open(root / "b.jsonl", "w", encoding="utf-8") as f:
        for text in JSONL_TEXTS:
            f.write(json.dumps({"id": 1, "text": text}) + "\n")
    # Folders are searched recursively and sorted; then inputs in the order given.
    files = sorted(p for p in (root / "a").rglob("*.txt"))
    docs = [p.read_bytes().decode("utf-8") for p in files] + JSONL_TEXTS
    return [str(root / "a"), str(root / "b.jsonl")], docs


def split_docs(docs: list[str], val_fraction: float) -> dict[str, list[str]]:
    """Return the documents of each split, in corpus order, as prepare assigns them."""
    out: dict[str, list[str]] = {"train": [], "val": []}
    for i, text in enumerate(docs):
        out[split_of(i, val_fraction)[0]].append(text)
    return out


def prepare_corpus(root: Path, out: Path, **options) -> tuple[dict, list[str]]:
    """Make the corpus under ``root`` and prepare it into ``out``; return (manifest, docs)."""
    inputs, docs = make_corpus(root)
    manifest = prepare(PrepareOptions(out=out, inputs=tuple(inputs), **options), progress=False)
    return manifest, docs


def full_stream(out: Path, split: str = "train") -> np.ndarray:
    """Return a split's whole token stream, read plainly with h5py, as the test oracle."""
    import h5py

    manifest = json.loads((out / "manifest.json").read_text())
    parts = []
    for shard in manifest["splits"][split]:
        with h5py.File(out / shard["file"], "r") as f:
            parts.append(f["tokens"][:])
    return np.concatenate(parts)


def letter_dataset(
    root: Path, letter: str, documents: int, tokenizer: str = "byte", val_fraction: float = 0.2
) -> Path:
    """Prepare ``root/letter``: ``documents`` documents of ``letter`` followed by the document's
    number, repeated (``A0007 A0007 ...``), so any 16-token window names its source by its one
    capital letter, and most windows differ. Return the prepared folder."""
    texts = root / f"{letter}-texts"
    texts.mkdir(parents=True)
    for i in range(documents):
        (texts / f"{i:04d}.txt").write_text(f"{letter}{i:04d} " * (3 + i % 7))
    out = root / letter.lower()
    options = PrepareOptions(
        out=out,
        inputs=(str(texts),),
        tokenizer=tokenizer,
        val_fraction=val_fraction,
        vocab_size=300 if tokenizer == "bpe" else None,
    )
    prepare(options, progress=False)
    return out


def source_letter(window: np.ndarray) -> str:
    """Return the capital letter a window of :func:`letter_dataset`'s tokens holds (byte ids)."""
    letters = {chr(t) for t in window.tolist() if 65 <= t <= 90}
    assert len(letters) == 1, letters
    return letters.pop()
