"""``hpcllm bench report``: one command measures a GPU node and hpcllm on it.

The report runs these parts in order, each printing one progress line (done, skipped with a
one-line reason, or failed with the log to read), and writes what it found into ``--out``:

1. ``environment``: GPUs, driver, CUDA, cuDNN, torch, Triton, NCCL, MPI and Horovod's build.
2. ``tests``: the tests marked ``gpu`` (``pytest -m gpu``), from the checkout hpcllm runs in.
3. ``device``: ``hpcllm bench device``, the planner's ``gpu_spec`` measured here.
4. ``kernels``: ``hpcllm bench kernels``, each fused op against eager and torch.compile.
5. ``step``: ``hpcllm bench step`` at gpt2-124m (micro-batch 16) and gpt2-1.3b (sequence
   2048, micro-batch 4): plain eager, plain + torch.compile, hpcllm as configured and with its
   kernels off, then hpcllm with ``model.compile`` none and blocks (a run each, timed against the
   plain model again), with peak memory.
6. ``train``: 50 steps of ``hpcllm train`` at gpt2-124m, the whole loop, against the step of
   part 5.
7. ``collectives``: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv from 8 KB
   to 1 GB (``hpcllm.bench.collectives`` under mpirun, one rank per GPU) through
   torch.distributed, Horovod and MPI, where present: algorithm and bus bandwidth.

Each benchmark runs as its own process (its output in ``raw/PART*.log``, its JSON beside it),
so one that fails or runs out of time costs its own part only. ``--parts`` runs some parts
and keeps the others' results from an earlier report in the same folder.

Written at the end, and after every part (so an interrupted report keeps what it measured):
``report.json`` (everything), ``report.md`` (tables, and the plots ``step.png``,
``collectives.png``) and ``cluster.yaml``, a cluster file ``hpcllm plan --cluster`` reads:
the measured ``gpu_spec``, the link bandwidths measured inside the node (between nodes, and
inside a node of one GPU, the data sheet's, marked so), and the collective tables under
``comm_tables``. Training parts use synthetic data (``data.synthetic``): no corpus needed.

``--cpu-smoke`` runs every part on the CPU at toy sizes (the GPU tests are only collected), in
a few minutes; its numbers describe nothing but that each part works. ``--quick`` repeats each
benchmark less (2 rounds of bench step instead of 6, fewer kernel and GEMM timings): about
half the time, noisier ratios.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcllm.errors import UserError
from hpcllm.files import atomic_write
from hpcllm.observe import read_metrics

PARTS = ("environment", "tests", "device", "kernels", "step", "train", "collectives")
# The standing goals for hpcllm's step against plain PyTorch + torch.compile, by shape.
STEP_GOALS = {"gpt2-124m": 1.10, "gpt2-1.3b": 1.05}
# bench step's variants: (name, --set of model.compile; None: as configured).
COMPILE_VARIANTS: tuple[tuple[str, str | None], ...] = (
    ("as configured", None),
    ("compile none", "none"),
    ("compile blocks", "blocks"),  # as configured is full on one GPU
)
TRAIN_STEPS, SMOKE_TRAIN_STEPS = 50, 12
GB = 1e9


@dataclass
class Context:
    """What every part reads: where to write, the machine, and the sizes to run at."""

    out: Path
    smoke: bool
    gpus: int
    timeout_s: float
    quick: bool = False
    results: dict[str, Any] = field(default_factory=dict)
    # Records a part's results so far (``run`` sets it): a report killed mid-part keeps them.
    keep: Callable[[str, dict[str, Any]], None] = lambda _name, _data: None

    @property
    def raw(self) -> Path:
        return self.out / "raw"

    def env(self) -> dict[str, str]:
        """The environment of a part's process: the CPU only when smoke."""
        env = dict(os.environ)
        if self.smoke:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env


@dataclass
class Outcome:
    """One part's result: ``done``, ``skipped`` or ``failed``, why, and what it measured."""

    status: str
    reason: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def _say(message: str) -> None:
    print(f"bench report: {message}", file=sys.stderr, flush=True)


def _run(
    ctx: Context, log: str, argv: list[str], timeout: float | None = None, cwd: Path | None = None
) -> str | None:
    """Run ``argv`` (stdout and stderr into ``raw/LOG.log``); return None, or why it failed."""
    path = ctx.raw / f"{log}.log"
    with path.open("w") as sink:
        sink.write("$ " + " ".join(argv) + "\n")
        sink.flush()
        try:
            done = subprocess.run(
                argv,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=ctx.env(),
                cwd=cwd,
                timeout=timeout or ctx.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout or ctx.timeout_s:.0f} s (log {path})"
    if done.returncode == 0:
        return None
    last = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return f"exit {done.returncode}: {last[-1][:200] if last else 'no output'} (log {path})"


def _hpcllm(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcllm", *args]


def _stdout_tables(ctx: Context, log: str) -> str:
    """Return the markdown tables a benchmark printed (its lines that start a table row)."""
    text = (ctx.raw / f"{log}.log").read_text(errors="replace")
    keep: list[str] = []
    for line in text.splitlines():
        if not line.startswith(("|", "best GEMM", "causal", "copy:")):
            continue
        if keep and keep[-1].startswith("|") != line.startswith("|"):
            keep.append("")  # a table ends (or starts) at a blank line
        keep.append(line)
    return "\n".join(keep)


# -- the parts ------------------------------------------------------------------------------


def _capture(argv: list[str], timeout: float = 60) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _python_probe(code: str) -> Any:
    """Return the JSON a snippet prints in a fresh interpreter (None if it fails): imports
    that may initialise MPI or load Horovod stay out of the report's process."""
    text = _capture([sys.executable, "-c", code], timeout=120)
    try:
        return None if text is None else json.loads(text.splitlines()[-1])
    except json.JSONDecodeError:
        return None


_HOROVOD_PROBE = (
    "import json, horovod, horovod.torch as h; print(json.dumps({'version': horovod.__version__,"
    " 'nccl_built': bool(h.nccl_built()), 'mpi_built': bool(h.mpi_built()),"
    " 'gloo_built': bool(h.gloo_built())}))"
)
_MPI_PROBE = (
    "import json, mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
    "print(json.dumps({'mpi4py': mpi4py.__version__, "
    "'library': MPI.Get_library_version().replace(chr(0), '').strip().splitlines()[0]}))"
)


def environment(ctx: Context) -> Outcome:
    """GPUs, driver, CUDA, cuDNN, torch, Triton, NCCL, MPI, Horovod: what ran the report."""
    import torch

    from hpcllm import __version__

    cuda = torch.cuda.is_available() and not ctx.smoke
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "hpcllm": __version__,
        "commit": _capture(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "gpus": [],
        "driver": None,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append(
                {
                    "name": p.name,
                    "memory_mib": p.total_memory // 2**20,
                    "sms": p.multi_processor_count,
                    "capability": f"{p.major}.{p.minor}",
                }
            )
        smi = _capture(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["driver"] = smi.splitlines()[0] if smi else None
    mpirun = shutil.which("mpirun")
    version = _capture([mpirun, "--version"]) if mpirun else None
    info["mpirun"] = (version.splitlines()[0] if version else mpirun) if mpirun else None
    info["mpi"] = _python_probe(_MPI_PROBE)
    info["horovod"] = _python_probe(_HOROVOD_PROBE)
    return Outcome("done", data=info)


def tests(ctx: Context) -> Outcome:
    """``pytest -m gpu`` from the checkout (only collected under ``--cpu-smoke``)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "tests").is_dir() or not (root / "pyproject.toml").is_file():
        return Outcome("skipped", "the tests are not installed: run the report from a checkout")
    if not ctx.gpus and not ctx.smoke:
        return Outcome("skipped", "no GPU: the tests marked gpu need one")
    xml = ctx.raw / "tests.xml"
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    argv += ["--collect-only"] if ctx.smoke else [f"--junitxml={xml}"]
    # Only the files that mark tests gpu: the others may import what this node lacks (MPI).
    files = sorted(
        str(f) for f in (root / "tests").glob("test_*.py") if "pytest.mark.gpu" in f.read_text()
    )
    if not files:
        return Outcome("skipped", "no test is marked gpu")
    err = _run(ctx, "tests", [*argv, *files], cwd=root)
    text = (ctx.raw / "tests.log").read_text(errors="replace")
    if ctx.smoke:
        if err:
            return Outcome("failed", err)
        found = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", text)
        count = int(found.group(1)) if found else 0
        return Outcome("done", data={"collected": count, "ran": False})
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    if xml.is_file():
        suite = re.search(r"<testsuite [^>]*", xml.read_text(errors="replace"))
        for key, attr in (("failed", "failures"), ("errors", "errors"), ("skipped", "skipped")):
            m = suite and re.search(rf'{attr}="(\d+)"', suite.group(0))
            counts[key] = int(m.group(1)) if m else 0
        total = suite and re.search(r'tests="(\d+)"', suite.group(0))
        counts["passed"] = (int(total.group(1)) if total else 0) - sum(
            counts[k] for k in ("failed", "errors", "skipped")
        )
    data = {"ran": True, **counts}
    return Outcome("failed", err, data) if err else Outcome("done", data=data)


def device(ctx: Context) -> Outcome:
    """``hpcllm bench device``: the ``gpu_spec`` fragment measured here."""
    from hpcllm.config import load_yaml

    if not ctx.gpus and not ctx.smoke:
        return Outcome("skipped", "no GPU")
    out = ctx.raw / "device.yaml"
    quick = ["--iters", "8"] if ctx.quick and not ctx.smoke else []
    err = _run(ctx, "device", _hpcllm("bench", "device", "--out", str(out), *_smoke(ctx), *quick))
    if err:
        return Outcome("failed", err)
    fragment = load_yaml(out.read_text())
    return Outcome("done", data={"fragment": fragment, "tables": _stdout_tables(ctx, "device")})


def _smoke(ctx: Context) -> list[str]:
    return ["--cpu-smoke"] if ctx.smoke else []


def kernels(ctx: Context) -> Outcome:
    """``hpcllm bench kernels``: each fused op against eager and torch.compile."""
    if not ctx.gpus and not ctx.smoke:
        return Outcome("skipped", "no GPU: the Triton kernels need one")
    out = ctx.raw / "kernels.json"
    quick = ["--iters", "20", "--steps", "5"] if ctx.quick and not ctx.smoke else []
    err = _run(
        ctx, "kernels", _hpcllm("bench", "kernels", "--json", str(out), *_smoke(ctx), *quick)
    )
    if err:
        return Outcome("failed", err)
    result = json.loads(out.read_text())
    return Outcome("done", data={"result": result, "tables": _stdout_tables(ctx, "kernels")})


# The Llama run: a preset at a shape's micro-batch and sequence length (bench step --model).
LLAMA_STEP = ("gpt2-1.3b", "llama3.2-1b")  # mb 4, seq 2048
SMOKE_LLAMA_STEP = ("cpu-smoke", "llama-tiny")


def _step_runs(ctx: Context) -> list[tuple[str, str, str | None, str | None]]:
    """Return (shape, variant, model.compile, --model) of each ``bench step`` run: GPT-2 at
    each shape and compile variant, then Llama as configured."""
    if ctx.smoke:
        return [
            ("cpu-smoke", "as configured", None, None),
            ("cpu-smoke", "compile none", "none", None),
            (*SMOKE_LLAMA_STEP[:1], "as configured", None, SMOKE_LLAMA_STEP[1]),
        ]
    runs = [(s, name, mode, None) for s in STEP_GOALS for name, mode in COMPILE_VARIANTS]
    return [*runs, (LLAMA_STEP[0], "as configured", None, LLAMA_STEP[1])]


def step(ctx: Context) -> Outcome:
    """``hpcllm bench step`` at each shape and compile variant; the rows side by side."""
    if not ctx.gpus and not ctx.smoke:
        return Outcome("skipped", "no GPU")
    shapes: dict[str, Any] = {}
    failures = []
    for shape, variant, mode, model in _step_runs(ctx):
        key = shape if model is None else f"{model} at {shape}"
        tag = f"step-{key.replace(' ', '-')}-{variant.replace(' ', '-')}"
        out = ctx.raw / f"{tag}.json"
        argv = _hpcllm("bench", "step", "--shapes", shape, "--json-out", str(out))
        argv += ["--model", model] if model else []
        argv += ["--cpu-smoke", "--rounds", "2", "--loop-steps", "4"] if ctx.smoke else []
        argv += ["--rounds", "2", "--loop-steps", "6"] if ctx.quick and not ctx.smoke else []
        argv += ["--set", f"model.compile={mode}"] if mode else []
        _say(f"  step: {key}, {variant}")
        err = _run(ctx, tag, argv)
        if err:
            failures.append(f"{key} {variant}: {err}")
            continue
        result = json.loads(out.read_text())["shapes"][0]
        goal = STEP_GOALS.get(shape) if model is None else None
        entry = shapes.setdefault(key, {"variants": {}, "goal": goal})
        entry["variants"][variant] = result
        entry["rows"] = step_summary(entry["variants"])
        ctx.keep("step", {"shapes": shapes})
    data = {"shapes": shapes}
    return Outcome("failed", "; ".join(failures), data) if failures else Outcome("done", data=data)


def step_summary(variants: dict[str, Any]) -> list[dict[str, Any]]:
    """Return one table's rows from the variant runs of a shape: the plain sides and the
    configured run's rows, then each other variant's hpcllm row (its ratio to the plain
    compiled model of its own run)."""
    rows = []
    base = variants.get("as configured")
    if base is not None:
        rows += [dict(r, variant="as configured") for r in base["rows"]]
    for name, result in variants.items():
        if name == "as configured":
            continue
        ours = next(r for r in result["rows"] if r["key"] == "hpcllm")
        rows.append(dict(ours, name=f"hpcllm step, {name}", variant=name))
    return rows


def train(ctx: Context) -> Outcome:
    """``hpcllm train`` for 50 steps at gpt2-124m: the whole loop against the step alone."""
    from hpcllm.bench.step import SHAPES

    if not ctx.gpus and not ctx.smoke:
        return Outcome("skipped", "no GPU")
    shape = "cpu-smoke" if ctx.smoke else "gpt2-124m"
    steps = SMOKE_TRAIN_STEPS if ctx.smoke else TRAIN_STEPS
    run_dir = ctx.raw / "train-run"
    sets = [
        *SHAPES[shape],
        "data.synthetic=true",
        f"train.steps={steps}",
        "train.global_batch_size=null",
        "train.log_interval=1",
        "train.eval_interval=0",
        "train.warmup_steps=2",
        f"train.precision={'fp32' if ctx.smoke else 'bf16'}",
        f"run.dir={run_dir}",
        "run.resume=none",
        "run.overwrite=true",
        "run.tensorboard=false",
    ]
    argv = _hpcllm("train", *[a for s in sets for a in ("--set", s)])
    err = _run(ctx, "train", argv)
    if err:
        return Outcome("failed", err)
    logged = read_metrics(run_dir)
    # The steps after compilation and auto's timings: the second half of the run.
    steady = [m for m in logged if m.get("step", 0) > steps // 2]
    tokens = statistics.median(m["tokens_per_s"] for m in steady)
    data = {
        "shape": shape,
        "steps": steps,
        "median_tokens_per_s": tokens,
        "median_step_ms": statistics.median(m["step_time_s"] for m in steady) * 1e3,
        "mfu": statistics.median(m["mfu"] for m in steady) if steady[0].get("mfu") else None,
        "final_loss": logged[-1]["loss"],
    }
    step_part = ctx.results.get("step", {}).get("data", {}).get("shapes", {}).get(shape)
    if step_part and "as configured" in step_part["variants"]:
        rows = step_part["variants"]["as configured"]["rows"]
        ours = next(r for r in rows if r["key"] == "hpcllm")
        data["step_tokens_per_s"] = ours["tokens_per_s"]
        data["loop_vs_step"] = tokens / ours["tokens_per_s"]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # gigabytes, not a result
    return Outcome("done", data=data)


def collectives(ctx: Context) -> Outcome:
    """The collectives under mpirun, one rank per GPU (two CPU ranks when smoke)."""
    from hpcllm.launcher import mpirun_command, mpirun_env

    ranks = 2 if ctx.smoke else ctx.gpus
    if ranks < 2:
        return Outcome("skipped", f"{'one GPU' if ranks else 'no GPU'}: collectives need two")
    if shutil.which("mpirun") is None:
        return Outcome("skipped", "no MPI runtime here (mpirun not found)")
    out = ctx.raw / "collectives.json"
    sizes = "8K,64K,1M" if ctx.smoke else "8K,64K,512K,4M,32M,256M,1G"
    cmd = [sys.executable, "-m", "hpcllm.bench.collectives", "--sizes", sizes]
    cmd += ["--json", str(out)] + (["--iters", "5"] if ctx.smoke else [])
    settings = {"HOROVOD_CPU_OPERATIONS": "MPI", "OMP_NUM_THREADS": "1"}
    argv = mpirun_command(ranks, cmd, export=settings)
    env_before = os.environ.copy()
    os.environ.update(mpirun_env(settings))
    try:
        err = _run(ctx, "collectives", argv)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    if err:
        return Outcome("failed", err)
    return Outcome("done", data={"result": json.loads(out.read_text()), "ranks": ranks})


STEPS: dict[str, Callable[[Context], Outcome]] = {
    "environment": environment,
    "tests": tests,
    "device": device,
    "kernels": kernels,
    "step": step,
    "train": train,
    "collectives": collectives,
}


# -- the report -----------------------------------------------------------------------------


def run(
    out: Path, parts: list[str] | None, smoke: bool, timeout_s: float, quick: bool = False
) -> dict[str, Any]:
    """Run ``parts`` (all by default) into ``out``; return the whole report's results."""
    from hpcllm.bench import report_files

    if smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not gpus and not smoke:
        raise UserError(
            "bench report measures a GPU node and this machine has no GPU (torch sees none); "
            "--cpu-smoke runs every part on the CPU at toy sizes"
        )
    chosen = list(parts or PARTS)
    unknown = [p for p in chosen if p not in PARTS]
    if unknown:
        raise UserError(f"unknown part {unknown[0]}; parts: {', '.join(PARTS)}")
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(out, smoke, gpus, timeout_s, quick)
    ctx.raw.mkdir(exist_ok=True)
    report = report_files.load(out, smoke)
    ctx.results = report["parts"]
    report["gpus"] = gpus
    for i, name in enumerate(chosen, 1):
        _say(f"[{i}/{len(chosen)}] {name} ...")
        began = time.monotonic()

        def keep(part: str, data: dict[str, Any], began: float = began) -> None:
            ctx.results[part] = {
                "status": "failed",
                "reason": "did not finish: the results so far",
                "seconds": round(time.monotonic() - began, 1),
                "data": data,
                "at": datetime.datetime.now().isoformat(timespec="seconds"),
            }
            report_files.write(out, report)

        ctx.keep = keep
        try:
            outcome = STEPS[name](ctx)
        except (OSError, ValueError, KeyError, StopIteration, json.JSONDecodeError) as err:
            outcome = Outcome("failed", f"{type(err).__name__}: {err}")
        seconds = time.monotonic() - began
        ctx.results[name] = {
            "status": outcome.status,
            "reason": outcome.reason,
            "seconds": round(seconds, 1),
            "data": outcome.data,
            "at": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        word = {"done": "done", "skipped": "skipped", "failed": "FAILED"}[outcome.status]
        why = f": {outcome.reason}" if outcome.reason else ""
        _say(f"[{i}/{len(chosen)}] {name}: {word} in {seconds:.0f} s{why}")
        report_files.write(out, report)
    return report


def check_out(out: Path) -> None:
    """Raise a UserError unless ``out`` can be the report's folder."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "report.json").is_file():
        raise UserError(
            f"--out {out} holds files that are not a report; give an empty or new folder"
        )


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON, whole or not at all."""
    atomic_write(path, json.dumps(data, indent=2, default=str) + "\n")
