"""``hpcllm bench prepare``: how fast ``hpcllm prepare`` runs at several rank counts.

Runs prepare for each tokenizer at each rank count in one go and prints its throughput side by
side: MB of text per second, split into making the tokenizer (rank 0 alone) and tokenizing +
writing shards (all ranks), and tokens per second per rank. Then the shard reader reads one of
the folders it wrote (``hpcllm bench data``'s measurement, in this process), and each row says
how many prepare ranks make tokens as fast as that one reader takes them.

The corpus is the built-in one, the user's files, or a synthetic corpus of any size that
:func:`synthetic_corpus` writes first, so that prepare can be timed at scale without a download.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcllm.errors import UserError
from hpcllm.launcher import mpirun_command, mpirun_env
from hpcllm.observe import CaseProgress

# --- the synthetic corpus ---------------------------------------------------------------------

# Bumped whenever the generator's output changes, so that a corpus an older one wrote is
# written again instead of reused.
SYNTHETIC_VERSION = 1
SYNTHETIC_MARKER = "synthetic.json"  # not a suffix prepare reads, so never a document
_VOCAB_WORDS = 32768
_WORDS_PER_LINE = 12  # on average: a word's separator is a newline at odds 1 in 12
_CHUNK_WORDS = 1 << 20  # words drawn at once: memory stays under 100 MB at any corpus size
# English letter frequencies (%), a to z: BPE then learns merges like those of real text.
_LETTER_PERCENT = [8.2, 1.5, 2.8, 4.3, 12.7, 2.2, 2.0, 6.1, 7.0, 0.15, 0.77, 4.0, 2.4, 6.7, 7.5,
                   1.9, 0.095, 6.0, 6.3, 9.1, 2.8, 0.98, 2.4, 0.15, 2.0, 0.074]  # fmt: skip


@dataclass(frozen=True)
class _Vocabulary:
    """Word-like strings ranked by frequency, each stored with the space that follows it."""

    flat: np.ndarray  # uint8: every word followed by one space, back to back
    offsets: np.ndarray  # int64: where word k's slot starts in ``flat``
    slots: np.ndarray  # int64: word k's bytes plus its separator
    cdf: np.ndarray  # float64: probability that a word's rank is k or below

    @property
    def mean_slot(self) -> float:
        """Return the expected bytes of one drawn word and its separator."""
        return float(np.dot(np.diff(self.cdf, prepend=0.0), self.slots))


def _vocabulary(seed: int) -> _Vocabulary:
    rng = np.random.default_rng([seed, 0])
    ranks = np.arange(_VOCAB_WORDS)
    # Frequent words are short, as in text ("the", "of"); rare ones run to 15 letters.
    lengths = np.clip(1 + rng.poisson(0.5 + 0.5 * np.log2(ranks + 1)), 1, 15)
    slots = lengths + 1
    offsets = np.cumsum(slots) - slots
    letters = np.asarray(_LETTER_PERCENT) / sum(_LETTER_PERCENT)
    flat = (ord("a") + rng.choice(26, size=int(slots.sum()), p=letters)).astype(np.uint8)
    flat[offsets + slots - 1] = ord(" ")
    # Zipf-Mandelbrot frequencies (word k drawn in proportion to 1 / (k + 2.7)), as in text.
    weights = 1.0 / (ranks + 2.7)
    cdf = np.cumsum(weights) / weights.sum()
    cdf[-1] = 1.0  # so that no draw in [0, 1) falls past the last word
    return _Vocabulary(flat, offsets, slots, cdf)


def _write_words(path: Path, rng: np.random.Generator, vocab: _Vocabulary, size: int) -> int:
    """Write whole words drawn from ``vocab`` to ``path`` up to ``size`` bytes; return bytes."""
    written = 0
    with path.open("wb") as out:
        while written < size:
            need = size - written
            ids = np.searchsorted(
                vocab.cdf, rng.random(min(_CHUNK_WORDS, int(need / vocab.mean_slot) + 16)), "right"
            )
            slots = vocab.slots[ids]
            ends = np.cumsum(slots)
            fit = int(np.searchsorted(ends, need, side="right"))  # the words that fit whole
            if fit == 0:
                if written:
                    break
                fit = 1  # every file holds a word, however small the size asked
            ids, slots, ends = ids[:fit], slots[:fit], ends[:fit]
            # Byte j of the text is byte j - (where its word starts) of that word's slot.
            text = vocab.flat[
                np.repeat(vocab.offsets[ids] - (ends - slots), slots) + np.arange(ends[-1])
            ]
            text[ends[rng.random(fit) < 1 / _WORDS_PER_LINE] - 1] = ord("\n")
            out.write(text.tobytes())
            written += int(ends[-1])
    return written


def synthetic_corpus(folder: Path, gigabytes: float, files: int, seed: int = 0) -> bool:
    """Return whether ``folder`` was written now (False: reused as it was).

    ``folder`` then holds ``files`` text files of about ``gigabytes`` GB together: words drawn
    from one fixed vocabulary by Zipf's law, separated by spaces and newlines, the same bytes
    for the same arguments. A marker file written last records the arguments; a folder whose
    marker matches them and whose files have the sizes it records is reused.
    """
    wanted = {"version": SYNTHETIC_VERSION, "gigabytes": gigabytes, "files": files, "seed": seed}
    marker = folder / SYNTHETIC_MARKER
    names = [folder / f"part-{i:05d}.txt" for i in range(files)]
    if _reusable(marker, wanted, names):
        return False
    folder.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # until every file is whole again
    for stale in folder.glob("part-*.txt"):
        stale.unlink()
    vocab = _vocabulary(seed)
    total = round(gigabytes * 1e9)
    written = 0
    for i, path in enumerate(names):
        size = total // files + (i < total % files)
        written += _write_words(path, np.random.default_rng([seed, i + 1]), vocab, size)
    marker.write_text(json.dumps({**wanted, "bytes": written}, indent=1) + "\n")
    return True


def _reusable(marker: Path, wanted: dict[str, Any], names: list[Path]) -> bool:
    try:
        found = json.loads(marker.read_text())
    except (OSError, ValueError):  # no marker, or one cut short: write the corpus again
        return False
    if {k: found.get(k) for k in wanted} != wanted or not all(p.is_file() for p in names):
        return False
    return sum(p.stat().st_size for p in names) == found.get("bytes")


# --- prepare and the reader ---------------------------------------------------------------

# The reader as `hpcllm bench data` reads by default (sequence 1024, micro-batch 8), for fewer
# micro-batches: its rate then matches that benchmark's while taking a fraction of a second.
READER = {"seq_len": 1024, "micro_batch_size": 8, "steps": 300, "warmup": 20}


def bench_prepare(
    source: list[str],
    out_root: Path,
    ranks: tuple[int, ...],
    tokenizers: tuple[str, ...],
    vocab_size: int,
    threads_per_rank: int | None = None,
    progress: CaseProgress | None = None,
) -> list[dict[str, Any]]:
    """Return each run's timing from its manifest, running ``hpcllm prepare`` for each
    tokenizer at each rank count, one after another.

    ``source`` is prepare's options that name the corpus (``["--corpus", "python-stdlib"]``,
    ``["--input", ...]``). Runs of more than one rank go through mpirun, as a user would start
    them; all runs write to folders under ``out_root``. ``tokens_per_s_per_rank`` is the
    tokenize phase's: tokens over its seconds, over the ranks. Each run is one case of
    ``progress`` where given (a caller's with more cases), else of a progress of its own.
    """
    cases = list(itertools.product(tokenizers, ranks))
    if progress is None:
        with CaseProgress(len(cases), "hpcllm bench prepare") as own:
            return bench_prepare(
                source, out_root, ranks, tokenizers, vocab_size, threads_per_rank, own
            )
    settings = {"RAYON_NUM_THREADS": str(threads_per_rank)} if threads_per_rank else {}
    rows = []
    for tokenizer, n in cases:
        progress.start(f"{tokenizer} tokenizer, {n} rank(s)")
        out = out_root / f"{tokenizer}-{n}ranks"
        cmd = [sys.executable, "-m", "hpcllm", "prepare", *source]
        cmd += ["--tokenizer", tokenizer, "--out", str(out), "--quiet"]
        if tokenizer == "bpe":
            cmd += ["--vocab-size", str(vocab_size)]
        if n > 1:
            cmd = mpirun_command(n, cmd, export=settings)
        subprocess.run(cmd, check=True, env=mpirun_env(settings))
        prep = json.loads((out / "manifest.json").read_text())
        tokens = sum(prep["n_tokens"].values())
        # The manifest rounds seconds to 1 ms: a tiny corpus may tokenize "in 0 s".
        tokenize_s = max(prep["prepare"]["tokenize_seconds"], 1e-3)
        rows.append(
            {
                "tokenizer": tokenizer,
                "ranks": n,
                "threads": threads_per_rank,
                "folder": str(out),
                "text_mb": prep["text_bytes"] / 1e6,
                **prep["prepare"],
                "tokens": tokens,
                "tokens_per_s_per_rank": tokens / tokenize_s / n,
            }
        )
        progress.done(f"{rows[-1]['tokens_per_s_per_rank'] / 1e6:.2f} M tokens/s per rank")
    return rows


def reader_rate(data: Path) -> dict[str, Any]:
    """Return the shard reader's throughput on ``data`` (one rank, as ``hpcllm bench data``),
    or ``{"data": ..., "skipped": why}`` where its train split is too small to read."""
    from hpcllm.bench.data import bench_reader

    try:
        return {"data": str(data), **bench_reader(data, **READER)}
    except UserError as err:
        return {"data": str(data), "skipped": str(err)}


def run(
    out_root: Path,
    *,
    ranks: tuple[int, ...],
    tokenizers: tuple[str, ...],
    vocab_size: int,
    as_json: bool,
    corpus: str | None = None,
    inputs: tuple[str, ...] = (),
    synthetic_gb: float | None = None,
    files: int = 64,
    threads_per_rank: int | None = None,
) -> int:
    """Print prepare's throughput for each tokenizer and rank count beside the reader's.

    The corpus is ``synthetic_gb`` GB written into ``out_root/corpus`` as ``files`` files, else
    ``inputs``, else the built-in ``corpus`` (python-stdlib when none is given).
    """
    synthetic = None
    cases = len(tokenizers) * len(ranks) + 1  # and the reader
    with CaseProgress(cases + (synthetic_gb is not None), "hpcllm bench prepare") as progress:
        if synthetic_gb is not None:
            folder = out_root / "corpus"
            progress.start(f"synthetic corpus {synthetic_gb:g} GB in {files} files")
            started = time.perf_counter()
            written = synthetic_corpus(folder, synthetic_gb, files)
            synthetic = json.loads((folder / SYNTHETIC_MARKER).read_text())
            synthetic["written_seconds"] = time.perf_counter() - started if written else None
            progress.done("written" if written else "reused")
            source = ["--input", str(folder)]
        elif inputs:
            source = ["--input", *inputs]
        else:
            source = ["--corpus", corpus or "python-stdlib"]
        rows = bench_prepare(
            source, out_root, ranks, tokenizers, vocab_size, threads_per_rank, progress
        )
        progress.start("shard reader, 1 rank")
        reader = reader_rate(Path(rows[0]["folder"]))
        rate = reader.get("tokens_per_s")
        progress.done(f"{rate / 1e6:.2f} M tokens/s" if rate else "skipped")
    first: dict[str, float] = {}  # each tokenizer's tokens/s at its first rank count
    for r in rows:
        tokens_per_s = r["tokens_per_s_per_rank"] * r["ranks"]
        r["scaling"] = tokens_per_s / first.setdefault(r["tokenizer"], tokens_per_s)
        r["reader_ratio"] = rate / r["tokens_per_s_per_rank"] if rate else None
    if as_json:
        report = {"source": source, "synthetic": synthetic, "prepare": rows, "reader": reader}
        print(json.dumps(report))
        return 0
    _print_table(source, synthetic, rows, reader, threads_per_rank)
    return 0


def _print_table(
    source: list[str],
    synthetic: dict[str, Any] | None,
    rows: list[dict[str, Any]],
    reader: dict[str, Any],
    threads_per_rank: int | None,
) -> None:
    threads = (
        f"{threads_per_rank} tokenizer thread(s) per rank"
        if threads_per_rank
        else "tokenizer threads: cores / ranks per node"
    )
    kind = (
        f" (synthetic: {synthetic['files']} files, seed {synthetic['seed']})" if synthetic else ""
    )
    print(f"prepare {' '.join(source)}{kind}: {rows[0]['text_mb']:.2f} MB of text; {threads}")
    print(
        f"{'tokenizer':<10} {'ranks':>5} {'total s':>8} {'MB/s':>7} {'setup s':>12} "
        f"{'tokenize s':>11} {'tokenize MB/s':>14} {'vs 1 rank':>10} {'M tokens':>9} "
        f"{'M tokens/s/rank':>16} {'reader ratio':>13}"
    )
    for r in rows:
        ratio = f"{r['reader_ratio']:>12.1f}x" if r["reader_ratio"] else f"{'-':>13}"
        print(
            f"{r['tokenizer']:<10} {r['ranks']:>5} {r['seconds']:>8.2f} {r['mb_per_s']:>7.2f} "
            f"{r['setup_seconds']:>12.2f} {r['tokenize_seconds']:>11.2f} "
            f"{r['tokenize_mb_per_s']:>14.2f} "
            f"{r['scaling']:>9.2f}x "
            f"{r['tokens'] / 1e6:>9.2f} {r['tokens_per_s_per_rank'] / 1e6:>16.3f} {ratio}"
        )
    if "skipped" in reader:
        print(f"reader on {reader['data']}: not measured: {reader['skipped']}")
        return
    print(
        f"reader on {reader['data']}: {reader['tokens_per_s'] / 1e6:.2f} M tokens/s, one rank "
        f"(seq len {reader['seq_len']}, micro-batch {reader['micro_batch_size']}, "
        f"{reader['steps']} micro-batches, no compute); reader ratio: that over the row's "
        "tokens/s per rank, the prepare ranks that make tokens as fast as one reader takes them"
    )
