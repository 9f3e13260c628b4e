"""``hpcllm bench prepare``: how fast ``hpcllm prepare`` runs at several rank counts.

Runs prepare at each rank count in one go and prints MB of text per second side by side, split
into training the tokenizer (rank 0 alone) and tokenizing + writing shards (all ranks).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from hpcllm.launcher import mpirun_command, mpirun_env
from hpcllm.observe import CaseProgress


def bench_prepare(
    corpus: str,
    out_root: Path,
    ranks: tuple[int, ...],
    tokenizers: tuple[str, ...],
    vocab_size: int,
    threads_per_rank: int | None = None,
) -> list[dict[str, Any]]:
    """Run ``hpcllm prepare`` for each tokenizer at each rank count, one after another.

    Returns each run's timing from its manifest. Runs of more than one rank go through
    mpirun, as a user would start them; all runs write to folders under ``out_root``.
    """
    settings = {"RAYON_NUM_THREADS": str(threads_per_rank)} if threads_per_rank else {}
    rows = []
    cases = list(itertools.product(tokenizers, ranks))
    with CaseProgress(len(cases), "hpcllm bench prepare") as progress:
        for tokenizer, n in cases:
            progress.start(f"{tokenizer} tokenizer, {n} rank(s)")
            out = out_root / f"{tokenizer}-{n}ranks"
            cmd = [
                sys.executable,
                "-m",
                "hpcllm",
                "prepare",
                "--corpus",
                corpus,
                "--tokenizer",
                tokenizer,
                "--out",
                str(out),
                "--quiet",
            ]
            if tokenizer == "bpe":
                cmd += ["--vocab-size", str(vocab_size)]
            if n > 1:
                cmd = mpirun_command(n, cmd, export=settings)
            subprocess.run(cmd, check=True, env=mpirun_env(settings))
            prep = json.loads((out / "manifest.json").read_text())
            rows.append(
                {
                    "tokenizer": tokenizer,
                    "ranks": n,
                    "threads": threads_per_rank,
                    "text_mb": prep["text_bytes"] / 1e6,
                    **prep["prepare"],
                }
            )
            progress.done(f"{rows[-1]['mb_per_s']:.2f} MB/s")
    return rows


def run(
    corpus: str,
    out_root: Path,
    ranks: tuple[int, ...],
    tokenizers: tuple[str, ...],
    vocab_size: int,
    as_json: bool,
    threads_per_rank: int | None = None,
) -> int:
    """Print prepare throughput for each tokenizer and rank count, side by side."""
    rows = bench_prepare(corpus, out_root, ranks, tokenizers, vocab_size, threads_per_rank)
    if as_json:
        print(json.dumps({"prepare": rows}))
        return 0
    threads = (
        f"{threads_per_rank} tokenizer thread(s) per rank"
        if threads_per_rank
        else "tokenizer threads: cores / ranks per node"
    )
    print(f"prepare --corpus {corpus}: {rows[0]['text_mb']:.2f} MB of text; {threads}")
    print(
        f"{'tokenizer':<10} {'ranks':>5} {'total s':>8} {'MB/s':>7} {'setup s':>12} "
        f"{'tokenize s':>11} {'tokenize MB/s':>14} {'vs 1 rank':>10}"
    )
    base: dict[str, float] = {}
    for r in rows:
        base.setdefault(r["tokenizer"], r["tokenize_mb_per_s"])
        print(
            f"{r['tokenizer']:<10} {r['ranks']:>5} {r['seconds']:>8.2f} {r['mb_per_s']:>7.2f} "
            f"{r['setup_seconds']:>12.2f} {r['tokenize_seconds']:>11.2f} "
            f"{r['tokenize_mb_per_s']:>14.2f} "
            f"{r['tokenize_mb_per_s'] / base[r['tokenizer']]:>9.2f}x"
        )
    return 0
