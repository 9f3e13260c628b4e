"""``hpcllm bench data`` and ``hpcllm bench prepare``: how fast data is read and prepared.

``bench data``: under mpirun every rank reads its own data-parallel part at the same time, as
in training, and rank 0 prints each rank's rate. No compute runs between micro-batches, so the
figure is the ceiling the reader puts on training throughput.

``bench prepare``: runs prepare at several rank counts in one go and prints MB of text per
second side by side, split into training the tokenizer (rank 0 alone) and tokenizing +
writing shards (all ranks).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hpcllm.datasets.reader import MicroBatchReader
from hpcllm.errors import UserError


def bench_reader(
    data: Path,
    *,
    seq_len: int,
    micro_batch_size: int,
    steps: int,
    warmup: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    prefetch: int = 4,
    cache_mb: int = 64,
) -> dict[str, Any]:
    """Return this rank's reader throughput over ``steps`` micro-batches after ``warmup``."""
    reader = MicroBatchReader(
        data,
        seq_len=seq_len,
        micro_batch_size=micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        prefetch=prefetch,
        cache_bytes=cache_mb << 20,
    )
    batches = iter(reader)
    for _ in range(warmup):
        next(batches)
    started = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += next(batches).input_ids.numel()
    seconds = time.perf_counter() - started
    batches.close()
    return {
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "seq_len": seq_len,
        "cache_mb": cache_mb,
        "micro_batch_size": micro_batch_size,
        "steps": steps,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "epochs_touched": reader.consumed_samples / reader.samples_per_epoch,
    }


def run(
    data: Path,
    *,
    seq_len: int,
    micro_batch_size: int,
    steps: int,
    warmup: int,
    as_json: bool,
    cache_mb: tuple[int, ...] = (64, 1),
) -> int:
    """Run the reader benchmark on every rank of the job; rank 0 prints the table.

    Each chunk-cache size runs in turn: the default (a small corpus then sits in the cache)
    and 1 MiB, where nearly every sample reads and checksums its chunk from the file again,
    as on a corpus much larger than the cache.
    """
    from hpcllm.topology import detect_launcher, start_mpi

    launch = detect_launcher()
    comm = start_mpi().COMM_WORLD if launch.world_size > 1 else None
    results = []
    for mb in cache_mb:
        if comm is not None:
            comm.Barrier()  # all ranks read at once, as in training
        result = bench_reader(
            data,
            seq_len=seq_len,
            micro_batch_size=micro_batch_size,
            steps=steps,
            warmup=warmup,
            dp_rank=launch.rank,
            dp_size=launch.world_size,
            cache_mb=mb,
        )
        gathered = comm.gather(result, root=0) if comm is not None else [result]
        results += gathered or []  # None on ranks other than 0
    if launch.rank == 0:
        if as_json:
            print(json.dumps({"reader": results}))
            return 0
        print(
            f"reader: seq len {seq_len}, micro-batch {micro_batch_size}, {steps} "
            f"micro-batches per rank, {launch.world_size} ranks reading at once"
        )
        for r in results:
            print(
                f"  chunk cache {r['cache_mb']:>3} MiB  rank {r['dp_rank']}: "
                f"{r['tokens_per_s'] / 1e6:8.2f} M tokens/s "
                f"({r['tokens']} tokens in {r['seconds']:.3f} s)"
            )
    return 0


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
    import os
    import shutil
    import subprocess
    import sys

    rows = []
    for tokenizer in tokenizers:
        for n in ranks:
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
            env = dict(os.environ)
            if threads_per_rank:
                env["RAYON_NUM_THREADS"] = str(threads_per_rank)
            if n > 1:
                mpirun = shutil.which("mpirun")
                if mpirun is None:
                    raise UserError("mpirun not found; `make setup` installs Open MPI")
                cmd = [mpirun, "-np", str(n), "--oversubscribe", "--bind-to", "none", *cmd]
                env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
                cmd[1:1] = ["-x", "RAYON_NUM_THREADS"] if threads_per_rank else []
            subprocess.run(cmd, check=True, env=env)
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
    return rows


def run_prepare(
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
