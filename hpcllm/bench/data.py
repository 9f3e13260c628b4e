"""``hpcllm bench data``: how fast the shard reader feeds micro-batches.

Under mpirun every rank reads its own data-parallel part at the same time, as in training, and
rank 0 prints each rank's rate. No compute runs between micro-batches, so the figure is the
ceiling the reader puts on training throughput.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hpcllm.datasets.reader import MicroBatchReader
from hpcllm.observe import CaseProgress


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
    from hpcllm.launcher import detect_launcher, start_mpi

    launch = detect_launcher()
    comm = start_mpi().COMM_WORLD if launch.world_size > 1 else None
    results = []
    with CaseProgress(len(cache_mb), "hpcllm bench data", show=launch.rank == 0) as progress:
        for mb in cache_mb:
            progress.start(f"chunk cache {mb} MiB")
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
            progress.done(f"rank 0 {result['tokens_per_s'] / 1e6:.2f} M tokens/s")
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
