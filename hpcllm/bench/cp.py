"""``hpcllm bench cp``: what context parallelism saves in activation memory and costs in time.

Each case trains the config's model (``llama-tiny`` when the config names none) for a few
steps at one sequence length and one context-parallel size cp, on cp ranks (mpirun), one
sequence per step, so every case at a length trains on the same tokens. Each rank counts the
bytes of the tensors autograd saves for the backward during one step
(``torch.autograd.graph.saved_tensors_hooks``: every distinct storage once, the parameters
left out), which is the activation memory a rank holds at the end of its forward, not process
memory; the table shows the largest rank's, its ratio to cp = 1 at the same length, and the
median step time after the warm-up steps.

Run as ``python -m hpcllm.bench.cp WORKER_JSON`` under mpirun it is one case's ranks.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from hpcllm.errors import UserError
from hpcllm.observe import CaseProgress

# The model a config without one is measured with.
DEFAULT_MODEL = ["model.arch=llama", "model.preset=llama-tiny"]
DEFAULTS = {"seqs": [2048, 4096, 8192], "cps": [1, 2, 4], "steps": 4, "warmup": 2}
# --cpu-smoke: the smallest run that shows every column.
SMOKE = {"seqs": [128, 256], "cps": [1, 2], "steps": 2, "warmup": 1}
MARK_VERB = "bench cp"


def model_overrides(config: Path | None, overrides: list[str]) -> list[str]:
    """Return ``overrides`` with the default model first when the config names none."""
    from hpcllm.config import is_given

    if any(is_given(config, overrides, key) for key in ("model.preset", "model.n_layer")):
        return overrides
    return [*DEFAULT_MODEL, *overrides]


def check_cases(config: Path | None, overrides: list[str], seqs: list[int], cps: list[int]) -> None:
    """Refuse, in one line and before any run starts, a length or size the config cannot take
    (a length not cut into 2·cp chunks, cp with experts split, an engine that steps apart)."""
    from hpcllm.config import load_config

    for seq in seqs:
        for cp in cps:
            try:
                load_config(config, [*overrides, f"model.seq_len={seq}", f"parallel.cp={cp}"])
            except UserError as err:
                raise UserError(f"--seq {seq} --cp {cp}: {err}") from None


def case_sets(overrides: list[str], seq: int, cp: int, steps: int, run_dir: Path) -> list[str]:
    """Return the ``--set`` items of one case's run."""
    return [
        *overrides,
        f"model.seq_len={seq}",
        f"parallel.cp={cp}",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.dp=1",
        "train.micro_batch_size=1",
        "train.global_batch_size=null",
        f"train.steps={steps}",
        "train.eval_interval=0",
        "train.save_interval=0",
        "run.resume=none",
        "run.tensorboard=false",
        f"run.dir={run_dir}",
    ]


def bench_cp(
    config: Path | None,
    overrides: list[str],
    seqs: list[int],
    cps: list[int],
    steps: int,
    warmup: int,
    out: Path,
    progress: CaseProgress,
) -> dict[str, Any]:
    """Run every case; return the table's rows and the settings they shared."""
    import torch

    from hpcllm.bench.runs import fresh_run_dir, launch_ranks

    gpu = torch.cuda.is_available()
    cores = len(os.sched_getaffinity(0))
    rows = []
    for seq in seqs:
        for cp in cps:
            progress.start(f"seq {seq} cp={cp}")
            run_dir = fresh_run_dir(out / f"seq{seq}-cp{cp}", MARK_VERB)
            result = run_dir / "measured.json"
            job = {
                "config": str(config) if config else None,
                "sets": case_sets(overrides, seq, cp, steps, run_dir),
                "warmup": warmup,
                "out": str(result),
            }
            # On CPU the ranks share the cores, each an equal part, as in bench dp.
            threads = None if gpu else max(1, cores // cp)
            started = time.perf_counter()
            launch_ranks(
                cp, [json.dumps(job)], timeout=3600, threads=threads, module="hpcllm.bench.cp"
            )
            measured = json.loads(result.read_text())
            rows.append(
                {
                    "seq": seq,
                    "cp": cp,
                    "wall_s": time.perf_counter() - started,
                    "threads_per_rank": threads,
                    **measured,
                    "tokens_per_s": seq / measured["step_time_s"],
                }
            )
            progress.done(f"{measured['activation_bytes'] / 2**20:.1f} MB per rank")
    base = {r["seq"]: r["activation_bytes"] for r in rows if r["cp"] == 1}
    for row in rows:
        row["vs_cp1"] = row["activation_bytes"] / base[row["seq"]] if row["seq"] in base else None
    return {"rows": rows, "steps": steps, "warmup": warmup}


def render(result: dict[str, Any]) -> str:
    """Return the table as text."""
    head = (
        f"{'seq':>6} {'cp':>3} {'activations MB/rank':>19} {'vs cp=1':>7} "
        f"{'ms/step':>9} {'tokens/s':>9}"
    )
    lines = [
        f"{result['steps']} steps per case of one sequence, first {result['warmup']} left out",
        head,
        "-" * len(head),
    ]
    for r in result["rows"]:
        versus = f"{r['vs_cp1']:.2f}" if r.get("vs_cp1") is not None else "-"
        lines.append(
            f"{r['seq']:>6} {r['cp']:>3} {r['activation_bytes'] / 2**20:>19.1f} {versus:>7} "
            f"{r['step_time_s'] * 1e3:>9.1f} {r['tokens_per_s']:>9.0f}"
        )
    lines += [
        "",
        "activations: the bytes autograd saves for the backward in one step on the largest "
        "rank (each storage once, parameters left out), counted by saved_tensors_hooks",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Draw activation MB per rank (lines by cp) and ms per step against the sequence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (mem, step) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for cp in sorted({r["cp"] for r in rows}):
        mine = [r for r in rows if r["cp"] == cp]
        seqs = [r["seq"] for r in mine]
        mem.plot(seqs, [r["activation_bytes"] / 2**20 for r in mine], "o-", label=f"cp={cp}")
        step.plot(seqs, [r["step_time_s"] * 1e3 for r in mine], "o-", label=f"cp={cp}")
    for ax, label in ((mem, "activations, MB per rank"), (step, "ms per step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("context parallelism: one sequence per step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(
    config: Path | None,
    overrides: list[str],
    seqs: list[int],
    cps: list[int],
    steps: int,
    warmup: int,
    out: Path,
) -> int:
    """The ``bench cp`` verb: every case, then the table, JSON and PNG."""
    if warmup >= steps:
        raise UserError(f"--warmup {warmup} leaves none of the {steps} steps to time")
    overrides = model_overrides(config, overrides)
    check_cases(config, overrides, seqs, cps)
    out.mkdir(parents=True, exist_ok=True)
    with CaseProgress(len(seqs) * len(cps), "hpcllm bench cp") as progress:
        result = bench_cp(config, overrides, seqs, cps, steps, warmup, out, progress)
    (out / "bench_cp.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "bench_cp.png")
    text = render(result)
    (out / "bench_cp.txt").write_text(text + "\n")
    print(text)
    print(f"\nsaved {out / 'bench_cp.json'}, {out / 'bench_cp.png'}, {out / 'bench_cp.txt'}")
    return 0


# ---------------------------------------------------------------------------------------------
# One case's ranks


def activation_bytes(step: Any, parameters: list[Any]) -> tuple[Any, int]:
    """Return (``step()``'s result, the bytes of the distinct storages autograd saved for the
    backward while it ran, ``parameters``' own left out)."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in parameters}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = step()
    return result, sum(seen.values())


def measure(job: dict[str, Any]) -> None:
    """Train one case on this rank and write, from rank 0, the largest rank's activation
    bytes and the median step time after the warm-up."""
    import torch
    import torch.distributed as dist

    from hpcllm.config import load_config
    from hpcllm.train.trainer import Trainer

    config = Path(job["config"]) if job["config"] else None
    with Trainer(load_config(config, job["sets"])) as trainer:
        batches = iter(trainer.reader)
        times, counted = [], 0
        for step in range(trainer.cfg.train.steps):
            if step == job["warmup"]:
                record, counted = activation_bytes(
                    lambda: trainer.train_step(batches, timed=True), trainer.parallelized.parameters
                )
            else:
                record = trainer.train_step(batches, timed=True)
            if step >= job["warmup"]:
                times.append(record["step_time_s"])
        most = torch.tensor([counted], dtype=torch.int64)
        if dist.is_initialized() and trainer.grid.world_size > 1:
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
        if trainer.grid.rank == 0:
            Path(job["out"]).write_text(
                json.dumps(
                    {"activation_bytes": int(most.item()), "step_time_s": statistics.median(times)}
                )
            )


if __name__ == "__main__":
    from hpcllm import errors

    sys.exit(errors.run_reporting_errors(lambda: measure(json.loads(sys.argv[1])) or 0))
