"""``hpcllm bench sync``: synchronous, asynchronous and local updates, with and without a
straggler, as a command.

For the config's model it trains the same number of samples (``--steps`` global batches) at
``--dp`` ranks under each strategy: synchronous ``ddp`` and ``ps``, ``ps-async`` at each
``--staleness`` bound and ``local-sgd`` at each ``--local-steps`` H; each once as it is and
once with ``train.straggler_rank``/``train.straggler_factor`` dialled in, each ``--repeats``
times (the median is reported). Every run is a real ``mpirun -np d hpcllm train``; the rows
come from its ``metrics.jsonl``: samples/s after the first logged interval (warm-up), the
same figure relative to the strategy's own run without the straggler, the final training and
validation loss, ps-async's mean staleness and dropped gradients, and the gradients each rank
sent. The PNG shows samples/s and loss against wall time.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from hpcllm.bench.runs import fresh_run_dir, launch_ranks, train_args
from hpcllm.observe import CaseProgress, read_metrics

ENGINES = ("ddp", "ps", "ps-async", "local-sgd")


def strategies(
    staleness: list[int], local_steps: list[int], engines: tuple[str, ...] | list[str] = ENGINES
) -> list[tuple[str, list[str]]]:
    """Return (name, overrides) of every strategy compared, of the ``engines`` given."""
    rows = [(f"sync {e}", [f"parallel.dp_engine={e}"]) for e in ("ddp", "ps") if e in engines]
    if "ps-async" in engines:
        rows += [
            (f"ps-async K={k}", ["parallel.dp_engine=ps-async", f"parallel.max_staleness={k}"])
            for k in staleness
        ]
    if "local-sgd" in engines:
        rows += [
            (f"local-sgd H={h}", ["parallel.dp_engine=local-sgd", f"parallel.local_sgd_steps={h}"])
            for h in local_steps
        ]
    return rows


def summarise(run_dir: Path) -> dict[str, Any]:
    """Return one run's figures from its metrics: samples/s after the first logged interval,
    losses, staleness and the loss against wall time."""
    records = read_metrics(run_dir)
    elapsed, previous, curve = 0.0, 0, []
    for r in records:
        elapsed += r["step_time_s"] * (r["step"] - previous)  # a record's mean step time
        previous = r["step"]
        curve.append((elapsed, r.get("loss_mean", r["loss"])))
    first = records[0]
    samples = records[-1]["consumed_samples"] - first["consumed_samples"]
    seconds = curve[-1][0] - curve[0][0]
    if samples <= 0 or seconds <= 0:  # one logged interval: the whole run
        samples, seconds = records[-1]["consumed_samples"], curve[-1][0]
    updates = sum(r.get("updates", 0) for r in records)
    stale = sum(r.get("staleness_mean", 0.0) * r.get("updates", 0) for r in records)
    sent = (
        [sum(col) for col in zip(*(r["rank_gradients"] for r in records), strict=True)]
        if "rank_gradients" in first
        else None
    )
    return {
        "samples_per_s": samples / seconds,
        "train_s": curve[-1][0],
        "final_loss": records[-1]["loss"],
        "val_loss": next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None),
        "staleness_mean": stale / updates if updates else None,
        "staleness_max": max((r.get("staleness_max", 0) for r in records), default=None)
        if updates
        else None,
        "dropped": sum(r.get("dropped_gradients", 0) for r in records) if updates else None,
        "rank_gradients": sent,
        "curve": curve,
    }


def bench_sync(
    config: Path | None,
    overrides: list[str],
    dp: int,
    steps: int,
    log_every: int,
    staleness: list[int],
    local_steps: list[int],
    straggler_rank: int,
    straggler_factor: float,
    repeats: int,
    out: Path,
    progress: CaseProgress,
    engines: list[str] | tuple[str, ...] = ENGINES,
) -> dict[str, Any]:
    """Run every strategy with and without the straggler, ``repeats`` times each."""
    out.mkdir(parents=True, exist_ok=True)
    common = train_args(
        config, overrides, steps, f"train.log_interval={log_every}", f"parallel.dp={dp}"
    )
    slow = [f"train.straggler_rank={straggler_rank}", f"train.straggler_factor={straggler_factor}"]
    # Repeat r trains from seeds + r (model and data order), so the spread of the validation
    # losses is the run-to-run noise a comparison of strategies has to beat.
    from hpcllm.config import load_config

    cfg = load_config(config, overrides)
    seeds = (cfg.train.seed, cfg.data.seed)
    rows = []
    for name, sets in strategies(staleness, local_steps, engines):
        for straggler in (False, True):
            runs = []
            for repeat in range(repeats):
                label = f"{name}{' straggler' if straggler else ''} #{repeat + 1}"
                progress.start(label)
                slug = name.replace(" ", "-").replace("=", "")
                run_dir = fresh_run_dir(
                    out / f"{slug}{'-straggler' if straggler else ''}-{repeat + 1}", "bench sync"
                )
                args = ["train", *common]
                seeded = [f"train.seed={seeds[0] + repeat}", f"data.seed={seeds[1] + repeat}"]
                for item in [*sets, *(slow if straggler else []), *seeded, f"run.dir={run_dir}"]:
                    args += ["--set", item]
                started = time.perf_counter()
                launch_ranks(dp, args, timeout=1800, threads=1)
                summary = summarise(run_dir)
                summary["wall_s"] = time.perf_counter() - started
                runs.append(summary)
                progress.done(f"{summary['samples_per_s']:.1f} samples/s")
            median = statistics.median(r["samples_per_s"] for r in runs)
            middle = min(runs, key=lambda r: abs(r["samples_per_s"] - median))
            rows.append(
                {
                    "strategy": name,
                    "straggler": straggler,
                    **{k: v for k, v in middle.items() if k != "samples_per_s"},
                    "samples_per_s": median,
                    "samples_per_s_runs": [r["samples_per_s"] for r in runs],
                    "val_loss_runs": [r["val_loss"] for r in runs],
                    "val_loss_mean": _mean([r["val_loss"] for r in runs]),
                    "val_loss_spread": _spread([r["val_loss"] for r in runs]),
                }
            )
    base = {r["strategy"]: r["samples_per_s"] for r in rows if not r["straggler"]}
    for r in rows:
        r["vs_no_straggler"] = r["samples_per_s"] / base[r["strategy"]]
    return {
        "rows": rows,
        "dp": dp,
        "steps": steps,
        "log_every": log_every,
        "repeats": repeats,
        "straggler": {"rank": straggler_rank, "factor": straggler_factor},
    }


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def _spread(values: list[float | None]) -> float | None:
    """Return half the range of ``values``: the ± of their mean."""
    known = [v for v in values if v is not None]
    return (max(known) - min(known)) / 2 if len(known) > 1 else None


def render_sync(result: dict[str, Any]) -> str:
    """Return the comparison as a text table."""
    s = result["straggler"]
    head = (
        f"{'strategy':<16} {'straggler':<10} {'samples/s':>9} {'vs none':>7} {'train s':>7} "
        f"{'loss':>7} {'val loss':>15} {'staleness':>9} {'max':>4} {'dropped':>7} "
        f"{'gradients per rank':<18}"
    )
    lines = [
        f"d = {result['dp']}, {result['steps']} steps (global batches) per run, synced every "
        f"{result['log_every']}; median of {result['repeats']} run(s) (seeds + 0, 1, ...); "
        f"straggler: rank {s['rank']} computes {s['factor']:g}x as long",
        head,
        "-" * len(head),
    ]

    def show(value: Any, spec: str) -> str:
        return format(value, spec) if value is not None else "-"

    for r in result["rows"]:
        sent = " ".join(str(n) for n in r["rank_gradients"]) if r["rank_gradients"] else "-"
        val = show(r["val_loss_mean"], ".3f")
        if r["val_loss_spread"] is not None:
            val += f" ± {r['val_loss_spread']:.3f}"
        lines.append(
            f"{r['strategy']:<16} {'rank ' + str(s['rank']) if r['straggler'] else 'none':<10} "
            f"{r['samples_per_s']:>9.1f} {r['vs_no_straggler']:>7.2f} {r['train_s']:>7.2f} "
            f"{r['final_loss']:>7.3f} {val:>15} "
            f"{show(r['staleness_mean'], '.2f'):>9} {show(r['staleness_max'], 'd'):>4} "
            f"{show(r['dropped'], 'd'):>7} {sent:<18}"
        )
    lines += [
        "",
        "samples/s: after the first synced interval; vs none: against the same strategy "
        "without the straggler; loss: the last interval's mean training loss (the median "
        "run's); val loss: mean ± half the range over the repeats, repeat r from train.seed "
        "and data.seed + r; staleness: ps-async's mean versions between a gradient's "
        "weights and its update; dropped: gradients that arrived after a sync point's quota",
    ]
    return "\n".join(lines)


def plot_sync(result: dict[str, Any], path: Path) -> None:
    """Draw samples/s per strategy and loss against wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(11, 4), dpi=120)
    width = 0.4
    for i, straggler in enumerate((False, True)):
        values = [
            next(
                r["samples_per_s"]
                for r in rows
                if (r["strategy"], r["straggler"]) == (n, straggler)
            )
            for n in names
        ]
        label = f"straggler rank {result['straggler']['rank']}" if straggler else "no straggler"
        bars.bar([x + i * width for x in range(len(names))], values, width, label=label)
    bars.set_xticks([x + width / 2 for x in range(len(names))], names, rotation=30, ha="right")
    bars.set_ylabel("samples/s")
    bars.legend()
    bars.grid(axis="y", alpha=0.3)
    for n, color in zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False):
        for r in rows:
            if r["strategy"] == n:
                t, loss = zip(*r["curve"], strict=True)
                style = "--" if r["straggler"] else "-"
                label = None if r["straggler"] else n
                curves.plot(t, loss, color=color, ls=style, label=label)
    curves.set_xlabel("training wall time, s (dashed: with the straggler)")
    curves.set_ylabel("training loss")
    curves.legend(fontsize=8)
    curves.grid(alpha=0.3)
    fig.suptitle(f"synchronous vs asynchronous updates, d = {result['dp']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(
    config: Path | None,
    overrides: list[str],
    dp: int,
    steps: int,
    log_every: int,
    staleness: list[int],
    local_steps: list[int],
    straggler_rank: int,
    straggler_factor: float,
    repeats: int,
    out: Path,
    engines: list[str] | tuple[str, ...] = ENGINES,
) -> int:
    """The ``bench sync`` verb: every run, then the table, JSON and PNG."""
    total = len(strategies(staleness, local_steps, engines)) * 2 * repeats
    with CaseProgress(total, "hpcllm bench sync") as progress:
        result = bench_sync(
            config,
            overrides,
            dp,
            steps,
            log_every,
            staleness,
            local_steps,
            straggler_rank,
            straggler_factor,
            repeats,
            out,
            progress,
            engines,
        )
    (out / "bench_sync.json").write_text(json.dumps(result, indent=2))
    plot_sync(result, out / "bench_sync.png")
    text = render_sync(result)
    (out / "bench_sync.txt").write_text(text + "\n")
    print(text)
    print(f"\nsaved {out / 'bench_sync.json'}, {out / 'bench_sync.png'}, {out / 'bench_sync.txt'}")
    return 0
