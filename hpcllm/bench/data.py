"""``hpcllm bench data``: how fast the shard reader feeds micro-batches.

Under mpirun every rank reads its own data-parallel part at the same time, as in training, and
rank 0 prints each rank's rate. No compute runs between micro-batches, so the figure is the
ceiling the reader puts on training throughput. With a blend (``--blend``, as ``data.blend``
takes it), the blended reader runs beside the plain one at each cache size, and the table
gives its rate as a ratio of the plain reader's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hpcllm.datasets.blend import Blend, BlendedReader
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
    blend: Blend | None = None,
) -> dict[str, Any]:
    """Return this rank's reader throughput over ``steps`` micro-batches after ``warmup``
    (the ``blend``'s reader where one is given, else ``data``'s)."""
    common = {
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "seed": seed,
        "prefetch": prefetch,
        "cache_bytes": cache_mb << 20,
    }
    reader: MicroBatchReader | BlendedReader = (
        BlendedReader(blend, **common) if blend is not None else MicroBatchReader(data, **common)
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
    epochs = (
        reader.consumed_samples / reader.samples_per_epoch
        if isinstance(reader, MicroBatchReader)
        else None
    )
    return {
        "reader": "blend" if blend is not None else "plain",
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "seq_len": seq_len,
        "cache_mb": cache_mb,
        "micro_batch_size": micro_batch_size,
        "steps": steps,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "epochs_touched": epochs,
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
    blend: list[list[Any]] | None = None,
) -> int:
    """Run the reader benchmark on every rank of the job; rank 0 prints the table.

    Each chunk-cache size runs in turn: the default (a small corpus then sits in the cache)
    and 1 MiB, where nearly every sample reads and checksums its chunk from the file again,
    as on a corpus much larger than the cache.
    """
    from hpcllm.launcher import detect_launcher, start_mpi

    launch = detect_launcher()
    comm = start_mpi().COMM_WORLD if launch.world_size > 1 else None
    mixed = Blend(blend) if blend is not None else None
    cases = [(mb, which) for mb in cache_mb for which in ([None, mixed] if mixed else [None])]
    results = []
    with CaseProgress(len(cases), "hpcllm bench data", show=launch.rank == 0) as progress:
        for mb, which in cases:
            progress.start(f"chunk cache {mb} MiB" + (", blend" if which is not None else ""))
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
                blend=which,
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
        if mixed is not None:
            shares = ", ".join(f"{s.name} {s.weight:.3g}" for s in mixed.sources)
            print(f"  blend: {shares}; ratio: the blend's rate over {data}'s, same rank")
        plain = {(r["cache_mb"], r["dp_rank"]): r for r in results if r["reader"] == "plain"}
        for r in results:
            ratio = ""
            if r["reader"] == "blend":
                base = plain[r["cache_mb"], r["dp_rank"]]["tokens_per_s"]
                ratio = f"  ratio {r['tokens_per_s'] / base:.2f}"
            which = f"{r['reader']:<5}  " if mixed is not None else ""
            print(
                f"  chunk cache {r['cache_mb']:>3} MiB  {which}rank {r['dp_rank']}: "
                f"{r['tokens_per_s'] / 1e6:8.2f} M tokens/s "
                f"({r['tokens']} tokens in {r['seconds']:.3f} s){ratio}"
            )
    return 0
