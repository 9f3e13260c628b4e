"""``hpcllm bench pipeline``: the real runtime's bubble against theory, schedule by schedule.

Run under mpirun with p ranks (one pipeline, t = d = 1). Two kinds of stage:

- ``synthetic``: forward and backward are fixed sleeps (t_f; t_b = 2·t_f; for zb-h1 the
  backward is split into B = W = t_b / 2), so ranks do not compete for cores and the
  measured bubble is the schedule's, plus the runtime's own overhead and p2p latency;
- ``gpt``: the tiny GPT cut into p stages, computing for real (on a machine with fewer cores
  than ranks the stages slow each other, so read its bubble as indicative).

The bubble is the paper's: (step time − m·(t_f + t_b)) / (m·(t_f + t_b)), set against
(p − 1)/m, or (p − 1)/(v·m) for the interleaved schedule; for the GPT, whose costs are not
fixed, the idle share of each rank's step is reported instead.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcllm.errors import UserError
from hpcllm.observe import CaseProgress
from hpcllm.parallel.pipeline.runtime import Channel, Runtime
from hpcllm.parallel.pipeline.schedule import Interval, check_sizes, rank_actions
from hpcllm.parallel.pipeline.simulate import theory_bubble

_MESSAGE = (256,)  # floats per synthetic activation: 1 KiB, latency not bandwidth


class SleepWork:
    """A stage whose forward and backward take fixed times; counts live activations."""

    def __init__(
        self,
        t_f: float,
        t_b: float,
        t_w: float,
        v: int,
        last_chunk: int | None,
        first_chunk: int | None,
    ) -> None:
        self.t_f, self.t_b, self.t_w, self.v = t_f, t_b, t_w, v
        self.last_chunk, self.first_chunk = last_chunk, first_chunk
        self.alive = 0
        self.peak = 0

    def reset(self) -> None:
        self.alive = self.peak = 0

    def forward(self, chunk: int, microbatch: int, x: torch.Tensor | None) -> torch.Tensor | None:
        time.sleep(self.t_f / self.v)
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        return None if chunk == self.last_chunk else torch.zeros(_MESSAGE)

    def backward(
        self, chunk: int, microbatch: int, grad: torch.Tensor | None, weights: bool
    ) -> torch.Tensor | None:
        time.sleep((self.t_b if weights else self.t_b - self.t_w) / self.v)
        if weights:
            self.alive -= 1
        return None if chunk == self.first_chunk else torch.zeros(_MESSAGE)

    def backward_weight(self, chunk: int, microbatch: int) -> None:
        time.sleep(self.t_w / self.v)
        self.alive -= 1


def _gpt_work(grid: Any, v: int, m: int, split: bool, seed: int = 1) -> tuple[Any, tuple[int, ...]]:
    """Return (factory of GPT stage work for one step, activation shape) for the tiny GPT."""
    from hpcllm.config import load_config
    from hpcllm.model.stages import build_chunks
    from hpcllm.parallel.data.engine import Engine
    from hpcllm.train.stage_work import ChunkWork

    tiny = load_config(None, ["model.preset=tiny"]).model
    cfg = replace(tiny, n_layer=max(tiny.n_layer, grid.pp * v), dropout=0.0)
    vocab, micro = 257, 4
    chunks = build_chunks(
        cfg,
        vocab,
        p=grid.pp,
        rank=grid.pp_rank,
        v=v,
        tp_group=None,
        seed=seed,
        sequence_parallel=False,
    )
    engine = Engine(grid)
    engine.wrap(chunks)
    gen = torch.Generator().manual_seed(seed)
    batches = [
        (
            torch.randint(0, vocab, (micro, cfg.seq_len), generator=gen),
            torch.randint(0, vocab, (micro, cfg.seq_len), generator=gen),
        )
        for _ in range(m)
    ]

    def make() -> ChunkWork:
        chunks.zero_grad(set_to_none=True)
        return ChunkWork(chunks, engine, batches, split_backward=split)

    return make, (micro, cfg.seq_len, cfg.d_model)


def run(
    schedules: Sequence[str],
    microbatches: Sequence[int],
    v: int,
    t_f: float,
    steps: int,
    warmup: int,
    model: str,
    timeline_dir: Path | None,
    json_out: Path | None,
) -> list[dict[str, Any]]:
    """Measure each schedule at each m; rank 0 prints the table and returns the rows."""
    from hpcllm import topology
    from hpcllm.launcher import detect_launcher

    world = detect_launcher().world_size
    if world < 2:
        raise UserError(
            "hpcllm bench pipeline runs under mpirun with p >= 2 ranks, all in "
            "one pipeline (e.g. mpirun -np 4 hpcllm bench pipeline)"
        )
    grid = topology.init(pp=world)
    if model == "gpt":
        torch.set_num_threads(1)
    t_b = 2 * t_f
    # The sizes a schedule cannot run are known before any runs: skip them up front, so
    # that the progress counts only the cases that run.
    cases = []
    for schedule in schedules:
        chunks = v if schedule == "interleaved" else 1
        for m in microbatches:
            try:
                check_sizes(schedule, grid.pp, m, chunks)
            except ValueError as err:
                if grid.rank == 0:
                    print(f"skipped {schedule} m={m}: {err}", flush=True)
                continue
            cases.append((schedule, m, chunks))
    rows: list[dict[str, Any]] = []
    progress = CaseProgress(len(cases), "hpcllm bench pipeline", show=grid.rank == 0)
    with progress:
        for schedule, m, chunks in cases:
            progress.start(f"{schedule} m={m}" + (f" v={chunks}" if chunks > 1 else ""))
            t_w = t_b / 2 if schedule == "zb-h1" else 0.0
            actions = rank_actions(schedule, grid.pp, grid.pp_rank, m, chunks)
            last = chunks - 1 if grid.pp_rank == grid.pp - 1 else None
            first = 0 if grid.pp_rank == 0 else None
            if model == "synthetic":
                sleeper = SleepWork(t_f, t_b, t_w, chunks, last, first)
                make = lambda sleeper=sleeper: (sleeper.reset(), sleeper)[1]  # noqa: E731
                shape: tuple[int, ...] = _MESSAGE
            else:
                make, shape = _gpt_work(grid, chunks, m, schedule == "zb-h1")
            channel = Channel(
                prev=grid.pp_prev,
                next=grid.pp_next,
                shape=shape,
                dtype=torch.float32,
                device=grid.device,
            )
            runtime = Runtime(channel)
            sync = torch.cuda.synchronize if grid.device.type == "cuda" else None
            times, intervals, peak = [], [], 0
            for step in range(warmup + steps):
                work = make()
                dist.barrier()
                origin = time.perf_counter()
                intervals = runtime.run(
                    actions,
                    work,
                    split_backward=schedule == "zb-h1",
                    origin=origin,
                    synchronize=sync,
                )
                elapsed = torch.tensor([time.perf_counter() - origin])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if step >= warmup:
                    times.append(elapsed.item())
                if model == "synthetic":
                    peak = max(peak, work.peak)
            busy = sum(i.end - i.start for i in intervals if i.kind.is_compute)
            gathered: list[Any] = [None] * grid.world_size
            dist.all_gather_object(gathered, (peak, busy, intervals))
            step_time = statistics.median(times)
            row = {
                "schedule": schedule,
                "p": grid.pp,
                "m": m,
                "v": chunks,
                "model": model,
                "step_s": step_time,
                "theory": theory_bubble(schedule, grid.pp, m, chunks, t_f, t_b - t_w, t_w)
                if model == "synthetic"
                else (grid.pp - 1) / (chunks * m),
                "idle_share": [1 - g[1] / step_time for g in gathered],
            }
            if model == "synthetic":
                ideal = m * (t_f + t_b)
                row["bubble"] = (step_time - ideal) / ideal
                row["peak_activations"] = [g[0] for g in gathered]
            rows.append(row)
            if timeline_dir is not None and grid.rank == 0:
                _draw(timeline_dir, row, [g[2] for g in gathered])
            progress.done(f"step {step_time:.3f} s")
    if grid.rank == 0:
        _ratios(rows)
        print(render(rows), flush=True)
        if json_out is not None:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(rows, indent=2))
    topology.shutdown()
    return rows


def _ratios(rows: list[dict[str, Any]]) -> None:
    """Add each row's speed-up over 1f1b at the same m (step time ratio)."""
    base = {r["m"]: r["step_s"] for r in rows if r["schedule"] == "1f1b"}
    for row in rows:
        row["vs_1f1b"] = base[row["m"]] / row["step_s"] if row["m"] in base else None


def _draw(folder: Path, row: dict[str, Any], ranks: list[list[Interval]]) -> None:
    from hpcllm.parallel.pipeline.timeline import chrome_trace, draw

    folder.mkdir(parents=True, exist_ok=True)
    name = f"bench_{row['model']}_{row['schedule']}_p{row['p']}_m{row['m']}"
    if row["v"] > 1:
        name += f"_v{row['v']}"
    title = f"{row['schedule']} (measured, {row['model']} stages): p={row['p']}, m={row['m']}" + (
        f", v={row['v']}" if row["v"] > 1 else ""
    )
    draw(ranks, folder / f"{name}.png", title)
    chrome_trace(ranks, folder / f"{name}.json")


def render(rows: list[dict[str, Any]]) -> str:
    """Return the results as a markdown table."""
    lines = [
        "| schedule | p | m | v | step (s) | bubble measured | theory | rel. error | "
        "× 1f1b | peak activations per rank |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = r.get("bubble")
        if measured is None:  # the GPT: idle share of the busiest rank's step
            measured = min(r["idle_share"])
        error = (measured - r["theory"]) / r["theory"] if r["theory"] else float("nan")
        peak = ", ".join(str(x) for x in r.get("peak_activations", [])) or "n/a"
        ratio = f"{r['vs_1f1b']:.2f}" if r.get("vs_1f1b") else "n/a"
        lines.append(
            f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | "
            f"{r['step_s']:.3f} | {measured:.3f} | {r['theory']:.3f} | "
            f"{error:+.1%} | {ratio} | {peak} |"
        )
    return "\n".join(lines)
