"""``hpcllm train``: train a GPT on prepared shards (or print its resolved config)."""

from __future__ import annotations

import argparse

from hpcllm.commands.args import add_config_args, positive

# `hpcllm train`'s exit status when SIGTERM or SIGUSR1 stopped it after it saved a checkpoint
# (EX_TEMPFAIL: try again later); jobs/slurm.sbatch requeues the job on it. 0 means finished.
STOPPED_EXIT = 75


def _config_sections() -> str:
    """Return every config section with its keys, as ``model (preset, n_layer, ...)``."""
    import dataclasses

    from hpcllm.config import Config

    cfg = Config()
    sections = [(s.name, dataclasses.fields(getattr(cfg, s.name))) for s in dataclasses.fields(cfg)]
    return ", ".join(f"{name} ({', '.join(f.name for f in keys)})" for name, keys in sections)


def _config_keys() -> str:
    """Return two help lines per config key: its type, default and choices; its description.
    The model section's shared keys come first, then each registered family's own under a
    line naming the family, then the other sections."""
    from hpcllm import families
    from hpcllm.config import Field, fields, show_value

    def lines(keys: list[Field]) -> list[str]:
        rows = []
        for f in keys:
            allowed = f"  [{' | '.join(f.choices)}]" if f.choices else ""
            rows.append(f"  {f.key:<28} {f.type_text():<16} {show_value(f.default)}{allowed}")
            rows.append(f"      {f.help}")
        return rows

    shared = fields()
    rows = lines([f for f in shared if f.section == "model"])
    for arch in families.names():
        own = [f for f in fields(arch) if f.family is not None]
        rows.append(f"  the {arch} family's own keys (model.arch={arch}):{'' if own else ' none'}")
        rows += lines(own)
    rows += lines([f for f in shared if f.section != "model"])
    return "\n".join(rows)


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add the command's parser to ``verbs``."""
    train = verbs.add_parser(
        "train",
        help="train a GPT on prepared shards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a GPT from a YAML config on every rank of the job (mpirun/srun, or "
        f"one process). Sections and keys: {_config_sections()}.\n\n"
        "The run folder gets config.yaml, metrics.jsonl, tensorboard/, checkpoints/ and "
        "loss.png. SIGTERM or SIGUSR1 finishes the current step, saves a checkpoint and "
        f"exits {STOPPED_EXIT} (0: finished; 2: a user error); run.resume: auto continues "
        "from the newest checkpoint.\n\n"
        "examples:\n"
        "  mpirun -np 2 hpcllm train --config jobs/configs/tiny-cpu.yaml\n"
        "  hpcllm train --config jobs/configs/tiny-cpu.yaml --set train.steps=20 "
        "--set train.precision=bf16\n"
        "  hpcllm train --config jobs/configs/tiny-cpu.yaml --print-config --world-size 8\n\n"
        f"config keys (SECTION.KEY  type  default  [allowed values]):\n{_config_keys()}",
    )
    add_config_args(train)
    train.add_argument(
        "--profile-steps",
        metavar="A:B",
        help="cudaProfilerStart before step A and Stop before step B, for "
        "`nsys profile --capture-range=cudaProfilerApi` (no-op on CPU)",
    )
    train.add_argument(
        "--peak-tflops",
        type=float,
        metavar="X",
        help="peak TFLOP/s per GPU for MFU (default: the device table; "
        "on CPU MFU is null unless given)",
    )
    train.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (one line per log interval is still printed; without a "
        "terminal there is no bar anyway)",
    )
    train.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML after the checks training makes before it "
        "starts (grid, batch, pipeline; the data when data.path exists) and exit; starts "
        "nothing and writes nothing",
    )
    train.add_argument(
        "--world-size",
        type=positive,
        metavar="N",
        help="with --print-config: check for N ranks (default: the launcher's world size)",
    )
    train.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Train (or, with --print-config, check and print the config); return the exit status."""
    import time

    from hpcllm.config import load_config

    started = time.perf_counter()
    overrides = list(args.overrides)
    if args.profile_steps:
        overrides.append(f"train.profile_steps={args.profile_steps}")
    if args.peak_tflops is not None:
        overrides.append(f"train.peak_tflops={args.peak_tflops}")
    cfg = load_config(args.config, overrides)
    if args.print_config:
        from pathlib import Path

        from hpcllm.config import render_yaml
        from hpcllm.datasets.shards import load_manifest
        from hpcllm.launcher import detect_launcher
        from hpcllm.train.preflight import check_job

        # The trainer's checks, those against the data where data.path (or every folder of
        # data.blend) exists and is read (synthetic data reads none).
        world_size = args.world_size or detect_launcher().world_size
        if cfg.data.blend is not None:
            from hpcllm.datasets.blend import Blend

            if all(Path(path).exists() for path, _, _ in cfg.data.blend):
                blend = Blend(cfg.data.blend)
                check_job(cfg, world_size, blend.manifest, blend)
            else:
                check_job(cfg, world_size, None)
        else:
            data = Path(cfg.data.path)
            manifest = load_manifest(data) if data.exists() and not cfg.data.synthetic else None
            check_job(cfg, world_size, manifest)
        print(render_yaml(cfg), end="", flush=True)
        return 0
    if args.world_size is not None:
        from hpcllm.errors import UserError

        raise UserError("--world-size goes with --print-config; the launcher sets a run's")
    from hpcllm import observe, startup
    from hpcllm.errors import UserError
    from hpcllm.launcher import detect_launcher

    try:  # before MPI starts: the start-up watcher must not wait on it
        launch = detect_launcher()
        startup.begin(cfg.run.dir, cfg.run.startup_timeout_s, launch.rank, launch.world_size)
    except UserError:
        pass  # srun without PMI: the trainer says so, on rank 0 alone
    from hpcllm.train.trainer import Trainer

    with Trainer(cfg) as trainer:
        summary = trainer.run(progress=not args.no_progress)
    if trainer.grid.rank == 0:
        plot = observe.plot_loss(trainer.run_dir)
        mfu = f"{summary['mfu']:.1%}" if summary.get("mfu") is not None else "n/a (no peak)"
        stopped = f" (stopped by {summary['stopped_by']})" if summary["stopped_by"] else ""
        print(
            f"trained {summary['step']} steps{stopped} on {summary['world_size']} ranks, "
            f"{summary['parameters'] / 1e6:.2f} M parameters, global batch "
            f"{summary['global_batch']}",
            flush=True,
        )
        if summary.get("val_loss") is not None:
            print(f"validation loss {summary['val_loss']:.4f}")
        if summary.get("fused_kernels"):
            print(f"fused kernels (Triton): {', '.join(summary['fused_kernels'])}")
        run_rate = summary.get("run_tokens_per_s")
        if run_rate is not None:
            print(f"run mean {run_rate:.0f} tokens/s (every log interval but the first)")
        if summary.get("tokens_per_s") is not None:
            print(
                f"last interval {summary['tokens_per_s']:.0f} tokens/s   "
                f"{summary['tflops_per_gpu']:.4f} TFLOP/s per rank   MFU {mfu}"
            )
        print(
            f"wall time {summary['wall_s']:.1f} s training, "
            f"{time.perf_counter() - started:.1f} s in all"
        )
        print(f"run folder {trainer.run_dir}  (loss curve {plot})", flush=True)
    # Stopped by a signal after a good save: not finished, so a batch script can requeue it.
    return STOPPED_EXIT if summary["stopped_by"] else 0
