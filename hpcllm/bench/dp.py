"""``hpcllm bench dp``: the data-parallel engines compared as in Bai (2022), as a command.

``bench dp`` trains the config's model for a few steps as a single-rank baseline and with
each engine (ddp, horovod, ps) at each data-parallel size d, in fp32 and in mixed precision,
each run a real ``mpirun -np d hpcllm train``. The micro-batch per rank stays fixed (weak
scaling, as in the study: global batch = micro-batch x d). From each run's metrics.jsonl it
reports throughput per rank and in total, speedup over the single rank, scaling efficiency
(total / (d x single)), each rank's busy share of the step (and NVML utilisation on GPUs),
and the share of the step spent waiting for gradients.

Then ``bench collectives`` (:mod:`hpcllm.bench.collectives`) measures the transports
underneath at the largest d, at the gradient's size: the all-reduce of the engines, the
reduce-scatter and all-gather of the distributed optimizer; its table goes under this one.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcllm.bench import collectives
from hpcllm.bench.runs import fresh_run_dir, launch_ranks, train_args
from hpcllm.observe import CaseProgress
from hpcllm.train.preflight import cpu_has_native_bf16

ALGORITHM = {  # what carries each engine's gradient reduction
    "ddp": "torch.distributed all-reduce in buckets, overlapped with backward (gloo: ring "
    "over TCP; nccl: ring/tree)",
    "horovod": "Horovod fused all-reduce through MPI (Open MPI's tuned collectives)",
    "ps": "reduce to the root, root steps, broadcast of all parameters; no overlap",
    "ddp-zero": "distributed optimizer: torch reduce-scatter in buckets during backward, "
    "1/d of AdamW per rank, all-gather of the parameters after the step",
    "horovod-zero": "distributed optimizer: Horovod reducescatter during backward, 1/d of "
    "AdamW per rank, Horovod allgather after the step",
}


def default_precisions(gpu: bool, native_bf16: bool) -> tuple[list[str], str | None]:
    """Return the precisions to compare when none are asked for, and a note of any left out.

    fp32 and fp16 on a GPU; fp32 and bf16 on a CPU that computes bf16 natively. A CPU without
    it emulates bf16 (20x slower than fp32 for a 4-layer GPT), so there fp32 runs alone.
    """
    if gpu:
        return ["fp32", "fp16"], None
    if native_bf16:
        return ["fp32", "bf16"], None
    return ["fp32"], (
        "bench dp: bf16 left out, this CPU has no native bf16 arithmetic (no avx512_bf16 or "
        "amx_bf16); --precisions fp32 bf16 runs it anyway"
    )


# What the engines move their gradients with: DDP and Horovod all-reduce them, the -zero
# engines reduce-scatter the gradients and all-gather the parameters.
DP_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")


def _launch_collectives(
    np_: int, args: list[str], timeout: float, config: Path | None, overrides: list[str]
) -> None:
    """Run ``bench collectives`` with the Horovod settings the config's training runs used."""
    from hpcllm.config import load_config
    from hpcllm.parallel.data.horovod import HOROVOD_KEYS

    parallel = load_config(config, overrides).parallel
    keys = {
        variable: write(getattr(parallel, key))
        for key, (variable, write) in HOROVOD_KEYS.items()
        if getattr(parallel, key) is not None
    }
    launch_ranks(np_, args, timeout=timeout, env=keys)


def _summarise(run_dir: Path, warmup: int) -> dict[str, Any]:
    from hpcllm.observe import read_metrics

    records = [r for r in read_metrics(run_dir) if r["step"] > warmup] or read_metrics(run_dir)[-1:]
    step_time = statistics.median(r["step_time_s"] for r in records)
    tokens_per_step = records[-1]["tokens_per_s"] * records[-1]["step_time_s"]
    busy = np.mean([r["rank_busy_share"] for r in records], axis=0)
    wait = np.mean([r["rank_comm_wait_s"] for r in records], axis=0)
    util = [u for r in records for u in r.get("rank_gpu_util", []) if u is not None]
    return {
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_step / step_time,
        "busy_share": busy.tolist(),
        "comm_share": float(wait.mean() / step_time),
        "gpu_util": statistics.mean(util) if util else None,
        "slowest_rank": max(range(len(busy)), key=lambda i: busy[i]),
        "final_loss": records[-1]["loss"],
        # The busiest rank's optimizer state, measured after its steps.
        "optimizer_mb": records[-1].get("memory_parts_mb", {}).get("optimizer"),
    }


def engine_settings(
    config: Path | None, overrides: list[str], engines: list[str]
) -> dict[str, str]:
    """Return each engine's settings as its ranks will resolve them, one line per engine.

    The ranks read the same config and overrides, and the environment
    :func:`~hpcllm.bench.runs.launch_ranks` gives them (this process's, plus
    ``HOROVOD_CPU_OPERATIONS``), so the Horovod precedence of
    :func:`~hpcllm.parallel.data.horovod.horovod_settings` gives the same answer here.
    """
    from hpcllm.config import load_config
    from hpcllm.parallel.data.ddp import describe_ddp
    from hpcllm.parallel.data.horovod import describe_horovod, describe_mpi, horovod_settings

    parallel = load_config(config, overrides).parallel
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    mpi = describe_mpi(gpu)
    lines = {
        "ddp": describe_ddp(
            parallel.ddp_bucket_mb, parallel.ddp_bucket_view, parallel.dp_compression
        ),
        "horovod": describe_horovod(horovod_settings(parallel, os.environ, device))
        + f", compression {parallel.dp_compression}"
        + (f", {mpi}" if mpi else ""),
        "ps": "one server (dp rank 0): reduce, step, broadcast",
    }
    bucket = f"buckets of up to {parallel.ddp_bucket_mb:g} MB (parallel.ddp_bucket_mb)"
    lines["ddp-zero"] = f"distributed optimizer, torch collectives, {bucket}"
    lines["horovod-zero"] = f"distributed optimizer, {bucket}, Horovod " + lines["horovod"]
    return {engine: lines[engine] for engine in engines}


def engine_runs(dps: list[int], engines: list[str]) -> list[tuple[str, int]]:
    """Return the (engine, d) runs of one precision: the single rank first, the baseline."""
    return [("single", 1)] + [(e, d) for d in dps for e in engines]


def bench_dp(
    config: Path | None,
    overrides: list[str],
    dps: list[int],
    engines: list[str],
    precisions: list[str],
    steps: int,
    warmup: int,
    out: Path,
    progress: CaseProgress,
) -> dict[str, Any]:
    """Run every configuration; return the rows of the comparison table.

    ``progress`` reports each run as a case: the :func:`engine_runs` in each precision.
    """
    out.mkdir(parents=True, exist_ok=True)
    settings = engine_settings(config, overrides, engines)
    common = train_args(config, overrides, steps)
    # On CPU every rank gets the same number of threads, the largest d's share of the cores,
    # so that the single rank is one "device" like each rank of the others and the speedup
    # measures data parallelism, not a change in threads per process. GPUs need no such rule.
    threads = (
        None if torch.cuda.is_available() else max(1, len(os.sched_getaffinity(0)) // max(dps))
    )
    rows = []
    for precision in precisions:
        baseline = None
        for engine, d in engine_runs(dps, engines):
            progress.start(f"{engine} d={d} {precision}")
            run_dir = fresh_run_dir(out / f"{engine}-d{d}-{precision}")
            base, _, zero = engine.partition("-")
            args = [
                "train",
                *common,
                "--set",
                f"train.precision={precision}",
                "--set",
                f"parallel.dp_engine={'ddp' if engine == 'single' else base}",
                "--set",
                f"parallel.distributed_optimizer={'true' if zero else 'false'}",
                "--set",
                f"run.dir={run_dir}",
            ]
            started = time.perf_counter()
            # Horovod needs an MPI launcher even for one rank.
            launch_ranks(d, args, timeout=1800, force_mpirun=base == "horovod", threads=threads)
            row = {
                "engine": engine,
                "dp": d,
                "precision": precision,
                "wall_s": time.perf_counter() - started,
                **_summarise(run_dir, warmup),
            }
            if engine == "single":
                baseline = row["tokens_per_s"]
            row["tokens_per_s_per_rank"] = row["tokens_per_s"] / d
            row["speedup"] = row["tokens_per_s"] / baseline
            row["scaling_efficiency"] = row["speedup"] / d
            row["algorithm"] = ALGORITHM.get(engine, "none (one rank)")
            rows.append(row)
            progress.done(f"{row['tokens_per_s']:.0f} tokens/s")
    return {
        "rows": rows,
        "steps": steps,
        "warmup": warmup,
        "threads_per_rank": threads,
        "settings": settings,
    }


def render_dp(result: dict[str, Any], measured: dict[str, Any] | None) -> str:
    """Return the comparison as a text table (and ``bench collectives``' table under it)."""
    head = (
        f"{'engine':<12} {'d':>2} {'prec':<5} {'ms/step':>8} {'tok/s total':>11} "
        f"{'tok/s/rank':>10} "
        f"{'speedup':>7} {'effic.':>6} {'busy share per rank':<22} {'comm':>5} "
        f"{'slowest':>7} {'GPU util':>8} {'busbw GB/s':>10} {'opt. MB':>8}"
    )
    # Each engine's gradient all-reduce rides one of the measured transports.
    all_reduce = {
        row["transport"]: row["busbw_gbps"]
        for row in (measured or {}).get("rows", [])
        if row["collective"] == "all_reduce"
    }
    busbw = {"ddp": all_reduce.get("torch"), "horovod": all_reduce.get("horovod")}
    threads = result.get("threads_per_rank")
    lines = [
        f"{result['steps']} steps per run, first {result['warmup']} left out; "
        + (f"{threads} thread(s) per rank on CPU" if threads else "one GPU per rank"),
        head,
        "-" * len(head),
    ]
    for r in result["rows"]:
        busy = " ".join(f"{b:.2f}" for b in r["busy_share"])
        util = f"{r['gpu_util']:.0f}%" if r.get("gpu_util") is not None else "-"
        bw = busbw.get(r["engine"].removesuffix("-zero"))
        opt = r.get("optimizer_mb")
        lines.append(
            f"{r['engine']:<12} {r['dp']:>2} {r['precision']:<5} "
            f"{r['step_time_s'] * 1e3:>8.1f} {r['tokens_per_s']:>11.0f} "
            f"{r['tokens_per_s_per_rank']:>10.0f} {r['speedup']:>7.2f} "
            f"{r['scaling_efficiency']:>6.2f} {busy:<22} {r['comm_share']:>5.2f} "
            f"{r['slowest_rank']:>7} {util:>8} {f'{bw:.2f}' if bw else '-':>10} "
            f"{f'{opt:.1f}' if opt is not None else '-':>8}"
        )
    lines.append("")
    lines.append(
        "busbw: the bus bandwidth of the transport each engine's all-reduce rides, "
        "from bench collectives below (ps reduces and broadcasts instead; -zero engines "
        "reduce-scatter and all-gather on the same transport); opt. MB: the busiest rank's "
        "optimizer state"
    )
    lines += [f"  {name}: {text}" for name, text in ALGORITHM.items()]
    if result.get("settings"):
        lines.append(
            "settings (a parallel.* key > its HOROVOD_* variable > hpcllm's default for the "
            "device > Horovod's):"
        )
        lines += [f"  {name}: {text}" for name, text in result["settings"].items()]
    if measured:
        lines += ["", collectives.render(measured)]
    return "\n".join(lines)


def plot_dp(result: dict[str, Any], path: Path) -> None:
    """Draw total throughput per engine, d and precision as a bar chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['engine']}\nd={r['dp']}" for r in rows if r["precision"] == rows[0]["precision"]]
    precisions = list(dict.fromkeys(r["precision"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    width = 0.8 / len(precisions)
    for i, precision in enumerate(precisions):
        values = [r["tokens_per_s"] for r in rows if r["precision"] == precision]
        ax.bar([x + i * width for x in range(len(values))], values, width, label=precision)
    ax.set_xticks([x + width * (len(precisions) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel("tokens/s, all ranks")
    ax.set_title("data-parallel engines (weak scaling)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def gradient_bytes(config: Path | None, overrides: list[str]) -> int:
    """Return the fp32 gradient size of the config's model, in bytes."""
    from hpcllm.config import load_config
    from hpcllm.datasets.synthetic import load_data
    from hpcllm.model import build

    cfg = load_config(config, overrides)
    d = cfg.data
    vocab = cfg.model.vocab_size or load_data(d.synthetic, d.path, None, d.seed).vocab_size
    with torch.device("meta"):
        model = build(cfg.model, vocab)
    return 4 * sum(p.numel() for p in model.parameters())


def run(
    config: Path | None,
    overrides: list[str],
    dps: list[int],
    engines: list[str],
    precisions: list[str] | None,
    steps: int,
    warmup: int,
    out: Path,
) -> int:
    """The ``bench dp`` verb: every run, then ``bench collectives``, table, JSON, PNG.

    ``precisions`` None compares :func:`default_precisions`.
    """
    if precisions is None:
        precisions, note = default_precisions(torch.cuda.is_available(), cpu_has_native_bf16())
        if note:
            print(note, flush=True)
    # bench collectives is one more case: it starts mpirun and Horovod, seconds each.
    total = len(precisions) * len(engine_runs(dps, engines)) + 1
    with CaseProgress(total, "hpcllm bench dp") as progress:
        result = bench_dp(config, overrides, dps, engines, precisions, steps, warmup, out, progress)
        nbytes = gradient_bytes(config, overrides)
        collectives_json = out / "collectives.json"
        progress.start(f"{', '.join(DP_COLLECTIVES)} of {nbytes / 1e6:.1f} MB, d={max(dps)}")
        _launch_collectives(
            max(dps),
            [
                "bench",
                "collectives",
                "--collectives",
                ",".join(DP_COLLECTIVES),
                "--sizes",
                str(nbytes),
                "--json",
                str(collectives_json),
                "--no-progress",
            ],
            timeout=600,
            config=config,
            overrides=overrides,
        )
        progress.done()
    result["collectives"] = json.loads(collectives_json.read_text())
    result["gradient_bytes"] = nbytes
    (out / "bench_dp.json").write_text(json.dumps(result, indent=2))
    plot_dp(result, out / "bench_dp.png")
    text = render_dp(result, result["collectives"])
    (out / "bench_dp.txt").write_text(text + "\n")
    print(text)
    print(f"\nsaved {out / 'bench_dp.json'}, {out / 'bench_dp.png'}, {out / 'bench_dp.txt'}")
    return 0
