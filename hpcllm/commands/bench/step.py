"""``hpcllm bench step``: hpcllm's training step against the same model in plain PyTorch (its
family's baseline), eager and compiled."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from hpcllm.commands.args import add_config_args, positive


def add_parser(targets: argparse._SubParsersAction) -> None:
    """Add the target's parser to ``targets``."""
    step = targets.add_parser(
        "step",
        help="hpcllm's training step against the same model in plain PyTorch, eager and compiled",
        description="For each shape, in one process: time hpcllm's training step (the config "
        "as given, and with fused kernels off) against the plain PyTorch model its family "
        "registers (GPT-2's: nanoGPT's) in nanoGPT's loop, eager and under torch.compile, in "
        "alternating blocks of steps; then run the "
        "real trainer loop for some steps. Prints ms/step, tokens/s, TFLOP/s, MFU, the ratios "
        "to the plain model and the ops that ran Triton kernels. Shapes set the model and "
        "micro-batch; --set applies on top of every shape. Trains on synthetic data "
        "(data.synthetic) unless data.path or data.blend is set in --config or --set.",
    )
    add_config_args(step)
    step.add_argument(
        "--shapes",
        nargs="+",
        choices=["gpt2-124m", "gpt2-1.3b", "cpu-smoke"],
        default=None,
        help="[default: gpt2-124m (seq 1024, mb 16) and gpt2-1.3b (seq 2048, mb 4); "
        "cpu-smoke with --cpu-smoke]",
    )
    step.add_argument(
        "--model",
        metavar="PRESET",
        help="the model, any family's preset (llama3.2-1b, llama-tiny, gpt2-124m, ...); "
        "--shapes then set its micro-batch and sequence length, and with --cpu-smoke the "
        "preset's family runs at the smoke size [default: the shapes' GPT-2 models]",
    )
    step.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="on the CPU (even where a GPU is), the tiny cpu-smoke shape (4 layers, d 256, "
        "seq 128, mb 4), no compiled rows unless --compile; about a minute",
    )
    step.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="include the torch.compile'd plain model [default: on a GPU, not with --cpu-smoke]",
    )
    step.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="both sides' precision, over train.precision "
        "[default: bf16 on a GPU, fp32 on the CPU]",
    )
    step.add_argument(
        "--steps", type=positive, default=None, help="steps per block [default: 3, smoke 2]"
    )
    step.add_argument(
        "--rounds",
        type=positive,
        default=None,
        help="alternating blocks of each [default: 6, smoke 10]",
    )
    step.add_argument(
        "--warmup", type=int, default=2, help="steps of each side before timing [default: 2]"
    )
    step.add_argument(
        "--loop-steps",
        type=positive,
        default=None,
        help="steps of the trainer loop, at least 3 [default: 20, smoke 16]",
    )
    step.add_argument("--json-out", type=Path, default=None, help="also write JSON here")
    step.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Time each shape and print the table (and write JSON)."""
    from hpcllm.errors import UserError

    if args.cpu_smoke:
        # Before anything asks torch about CUDA: the smoke run is on the CPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    loop_steps = args.loop_steps or (16 if args.cpu_smoke else 20)
    if loop_steps < 3:
        raise UserError("--loop-steps must be at least 3 (timed step to step after the first)")
    from hpcllm.bench import step
    from hpcllm.bench.runs import synthetic_unless_data

    overrides = synthetic_unless_data(args.config, args.overrides)
    result = step.run(
        args.shapes or (["cpu-smoke"] if args.cpu_smoke else ["gpt2-124m", "gpt2-1.3b"]),
        args.config,
        overrides,
        args.precision,
        args.compile,
        args.steps or (2 if args.cpu_smoke else 3),
        args.rounds or (10 if args.cpu_smoke else 6),
        args.warmup,
        loop_steps,
        model=args.model,
    )
    print(step.render(result))
    if args.json_out is not None:
        step.write_json(result, args.json_out)
    return 0
