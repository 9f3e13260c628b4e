"""``hpcllm bench moe``: what expert parallelism costs and buys, by ep and top_k, per engine.

Each case is a real ``mpirun -np d hpcllm train`` of the config's MoE model (the
``mixtral-tiny`` preset when the config names no experts) at one expert-parallel size ep, one
``model.moe_top_k`` and one data-parallel engine (DDP's all-to-all through torch.distributed,
Horovod's through ``hvd.alltoall`` on its process sets), with d and the micro-batch per rank
fixed, so every case trains on the same tokens per step. From each run's metrics.jsonl it
reports the step time, tokens/s and the seconds per step rank 0 spent in the MoE layers'
all-to-alls (``moe_all_to_all_s``: dispatch, combine, the counts and the backward's reverse
exchanges; host time on a CPU, CUDA events on a GPU), and their share of the step. ep = 1
sends no token and is the baseline: every rank holds every expert.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hpcllm.bench.runs import fresh_run_dir, launch_ranks, train_args
from hpcllm.errors import UserError
from hpcllm.observe import CaseProgress, read_metrics

# What carries each engine's token exchange.
TRANSPORT = {
    "ddp": "torch.distributed all_to_all_single on the ep group (gloo on CPU, NCCL on GPU)",
    "horovod": "hvd.alltoall on the ep process set declared at hvd.init (MPI on CPU)",
}
# The model a config without experts is measured with.
DEFAULT_MODEL = ["model.arch=llama", "model.preset=mixtral-tiny"]
# What the options default to (dp and eps None: from the node and the experts).
DEFAULTS = {"steps": 20, "warmup": 5, "eps": None, "top_ks": [1, 2], "dp": None}
# --cpu-smoke: the smallest run that shows every column, on two ranks.
SMOKE = {"steps": 4, "warmup": 1, "eps": [1, 2], "top_ks": [1, 2], "dp": 2}
SMOKE_SETS = ["model.seq_len=32", "train.micro_batch_size=2"]
MARK_VERB = "bench moe"


def model_overrides(config: Path | None, overrides: list[str]) -> list[str]:
    """Return ``overrides`` with the default MoE model first when the config names no
    experts; a one-line UserError when it names a dense model."""
    from hpcllm.config import is_given, load_config

    if is_given(config, overrides, "model.moe_experts") or is_given(
        config, overrides, "model.preset"
    ):
        if not load_config(config, overrides).model.moe_experts:
            raise UserError(
                "bench moe measures a mixture of experts and this config's model.moe_experts "
                "is 0; set it (or model.preset=mixtral-tiny)"
            )
        return overrides
    return [*DEFAULT_MODEL, *overrides]


def choose_eps(
    config: Path | None, overrides: list[str], dp: int, eps: list[int] | None
) -> list[int]:
    """Return the ep sizes to run: ``eps``, checked (one line for one the experts or d
    cannot take, before any run starts), or every divisor of d that divides the experts."""
    from hpcllm.config import load_config

    experts = load_config(config, overrides).model.moe_experts
    if eps is None:
        return [ep for ep in range(1, dp + 1) if dp % ep == 0 and experts % ep == 0]
    for ep in eps:
        if dp % ep or experts % ep:
            raise UserError(
                f"--ep {ep} must divide the data-parallel size {dp} and the "
                f"{experts} experts; give --ep from the divisors of both"
            )
    return eps


def check_top_ks(config: Path | None, overrides: list[str], top_ks: list[int]) -> None:
    """Refuse, in one line and before any run starts, a top_k the model cannot take (more
    than its experts, or 1 with a renormalising router)."""
    from hpcllm.config import load_config

    for k in top_ks:
        try:
            load_config(config, [*overrides, f"model.moe_top_k={k}"])
        except UserError as err:
            raise UserError(f"--top-k {k}: {err}") from None


def _summarise(run_dir: Path, warmup: int) -> dict[str, Any]:
    records = read_metrics(run_dir)
    kept = [r for r in records if r["step"] > warmup] or records[-1:]
    step_time = statistics.median(r["step_time_s"] for r in kept)
    tokens_per_step = kept[-1]["tokens_per_s"] * kept[-1]["step_time_s"]
    a2a = [r["moe_all_to_all_s"] for r in kept if r.get("moe_all_to_all_s") is not None]
    a2a_s = statistics.median(a2a) if a2a else 0.0
    return {
        "step_time_s": step_time,
        "tokens_per_s": tokens_per_step / step_time,
        "all_to_all_s": a2a_s,
        "all_to_all_share": a2a_s / step_time,
        "max_load": kept[-1].get("moe_max_load"),
        "final_loss": kept[-1]["loss"],
    }


def cases(engines: list[str], eps: list[int], top_ks: list[int]) -> list[tuple[str, int, int]]:
    """Return every (engine, ep, top_k) to run, in table order."""
    return [(engine, ep, k) for engine in engines for k in top_ks for ep in eps]


def bench_moe(
    config: Path | None,
    overrides: list[str],
    dp: int,
    engines: list[str],
    eps: list[int],
    top_ks: list[int],
    steps: int,
    warmup: int,
    out: Path,
    progress: CaseProgress,
) -> dict[str, Any]:
    """Run every case; return the rows of the table and the settings they shared."""
    common = train_args(config, overrides, steps)
    # On CPU each rank gets an equal share of the cores, as in bench dp.
    threads = None if torch.cuda.is_available() else max(1, len(os.sched_getaffinity(0)) // dp)
    rows = []
    for engine, ep, k in cases(engines, eps, top_ks):
        progress.start(f"{engine} ep={ep} top_k={k}")
        run_dir = fresh_run_dir(out / f"{engine}-ep{ep}-k{k}", MARK_VERB)
        args = ["train", *common]
        for item in (
            f"parallel.dp_engine={engine}",
            f"parallel.ep={ep}",
            f"model.moe_top_k={k}",
            f"run.dir={run_dir}",
        ):
            args += ["--set", item]
        started = time.perf_counter()
        launch_ranks(dp, args, timeout=1800, force_mpirun=engine == "horovod", threads=threads)
        row = {
            "engine": engine,
            "ep": ep,
            "top_k": k,
            "dp": dp,
            "wall_s": time.perf_counter() - started,
            **_summarise(run_dir, warmup),
        }
        rows.append(row)
        progress.done(f"{row['tokens_per_s']:.0f} tokens/s")
    baselines = {(r["engine"], r["top_k"]): r["tokens_per_s"] for r in rows if r["ep"] == 1}
    for row in rows:  # against the same engine and top_k at ep = 1
        base = baselines.get((row["engine"], row["top_k"]))
        row["vs_ep1"] = row["tokens_per_s"] / base if base else None
    return {"rows": rows, "steps": steps, "warmup": warmup, "threads_per_rank": threads}


def render(result: dict[str, Any]) -> str:
    """Return the table as text."""
    head = (
        f"{'engine':<8} {'d':>2} {'ep':>3} {'top_k':>5} {'ms/step':>9} {'tokens/s':>9} "
        f"{'vs ep=1':>7} {'a2a ms/step':>11} {'a2a share':>9} {'max load':>8}"
    )
    threads = result.get("threads_per_rank")
    lines = [
        f"{result['steps']} steps per run, first {result['warmup']} left out; "
        + (f"{threads} thread(s) per rank on CPU" if threads else "one GPU per rank"),
        head,
        "-" * len(head),
    ]
    for r in result["rows"]:
        versus = f"{r['vs_ep1']:.2f}" if r.get("vs_ep1") is not None else "-"
        load = f"{r['max_load']:.2f}" if r.get("max_load") is not None else "-"
        lines.append(
            f"{r['engine']:<8} {r['dp']:>2} {r['ep']:>3} {r['top_k']:>5} "
            f"{r['step_time_s'] * 1e3:>9.1f} {r['tokens_per_s']:>9.0f} {versus:>7} "
            f"{r['all_to_all_s'] * 1e3:>11.1f} {r['all_to_all_share']:>9.1%} {load:>8}"
        )
    lines += [
        "",
        "a2a: rank 0's seconds per step in the MoE all-to-alls (dispatch, combine, counts, "
        "and the backward's); ep = 1 sends none. max load: the busiest expert's tokens over "
        "the mean (the last step).",
        *(f"  {name}: {text}" for name, text in TRANSPORT.items()),
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Draw tokens/s (bars) and the all-to-all's share of the step (dots) by case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['engine']}\nep={r['ep']} k={r['top_k']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4), dpi=120)
    ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("tokens/s, all ranks", color="tab:blue")
    share = ax.twinx()
    share.plot(range(len(rows)), [100 * r["all_to_all_share"] for r in rows], "o", color="tab:red")
    share.set_ylabel("all-to-all, % of the step", color="tab:red")
    share.set_ylim(bottom=0)
    ax.set_title(f"MoE step by ep and top_k (d = {rows[0]['dp']})")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(
    config: Path | None,
    overrides: list[str],
    dp: int,
    engines: list[str],
    eps: list[int] | None,
    top_ks: list[int],
    steps: int,
    warmup: int,
    out: Path,
) -> int:
    """The ``bench moe`` verb: every case, then the table, JSON and PNG."""
    overrides = model_overrides(config, overrides)
    eps = choose_eps(config, overrides, dp, eps)
    check_top_ks(config, overrides, top_ks)
    out.mkdir(parents=True, exist_ok=True)
    todo = cases(engines, eps, top_ks)
    with CaseProgress(len(todo), "hpcllm bench moe") as progress:
        result = bench_moe(
            config, overrides, dp, engines, eps, top_ks, steps, warmup, out, progress
        )
    result["transport"] = {e: TRANSPORT[e] for e in engines}
    (out / "bench_moe.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "bench_moe.png")
    text = render(result)
    (out / "bench_moe.txt").write_text(text + "\n")
    print(text)
    print(f"\nsaved {out / 'bench_moe.json'}, {out / 'bench_moe.png'}, {out / 'bench_moe.txt'}")
    return 0
