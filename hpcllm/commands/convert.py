"""``hpcllm convert``: re-cut a checkpoint for another layout; Hugging Face GPT-2 and Llama in
and out."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import positive, step_arg


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add the command's parser to ``verbs``."""
    from hpcllm.config import choices
    from hpcllm.families import IMPORTED_SEQ_LEN

    conv = verbs.add_parser(
        "convert",
        help="re-cut a checkpoint for another layout; Hugging Face GPT-2 and Llama in and out",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Re-cut: --checkpoint RUN_DIR --out NEW_RUN with any of --tp, --pp, --vpp, "
        "--dp, --ep, --schedule writes the checkpoint (weights, optimizer state, data position, "
        "random states) for that layout; `hpcllm train --config NEW_RUN/config.yaml` resumes "
        "it. "
        "Axes not given keep the checkpoint's.\n"
        "--to-hf DIR --checkpoint RUN_DIR writes a checkpoint of any layout as a "
        "GPT2LMHeadModel or LlamaForCausalLM folder (config.json, model.safetensors or shards "
        "with an index, the tokenizer if the run has one).\n"
        "--from-hf DIR --out RUN_DIR makes a run folder whose step-0 checkpoint holds a "
        "Hugging Face GPT-2 or Llama (one safetensors file or shards, read a tensor at a "
        "time); train from it with --config RUN_DIR/config.yaml. A Llama trains at "
        f"model.seq_len {IMPORTED_SEQ_LEN}, or its max_position_embeddings where shorter (--set "
        "model.seq_len=N for another); --to-hf writes its max_position_embeddings back, or "
        "the trained length where longer.\n\n"
        "examples:\n"
        "  hpcllm convert --checkpoint runs/pp2 --out runs/t2 --tp 2 --pp 1\n"
        "  hpcllm convert --checkpoint runs/pp2 --out runs/v2 --pp 2 --vpp 2\n"
        "  hpcllm convert --checkpoint runs/pp2 --to-hf hf/pp2 --step 200\n"
        "  hpcllm convert --from-hf Llama-3.2-1B --out runs/llama1b\n"
        "  hpcllm convert --checkpoint runs/llama1b --to-hf hf/llama1b --dtype bfloat16",
    )
    way = conv.add_mutually_exclusive_group()
    way.add_argument("--from-hf", type=Path, metavar="DIR", help="Hugging Face folder to read")
    way.add_argument("--to-hf", type=Path, metavar="DIR", help="Hugging Face folder to write")
    conv.add_argument("--tp", type=positive, metavar="T", help="new tensor-parallel size")
    conv.add_argument("--pp", type=positive, metavar="P", help="new number of pipeline ranks")
    conv.add_argument(
        "--vpp",
        type=positive,
        metavar="V",
        help="new chunks per pipeline rank (interleaved schedule) [default: the checkpoint's "
        "with p > 1, else 1]",
    )
    conv.add_argument(
        "--dp",
        type=positive,
        metavar="D",
        help="new data-parallel size (the global batch is kept) [default: world / (t*p)]",
    )
    conv.add_argument(
        "--ep",
        type=positive,
        metavar="E",
        help="new expert-parallel size (ranks of d splitting the experts; checkpoints hold "
        "them whole, so only the config changes) [default: the checkpoint's]",
    )
    conv.add_argument(
        "--schedule",
        choices=choices("parallel", "schedule"),
        help="pipeline schedule [default: interleaved with --vpp > 1; else the checkpoint's, "
        "1f1b in place of interleaved]",
    )
    conv.add_argument(
        "--out", type=Path, metavar="RUN_DIR", help="new run folder (re-cut or --from-hf)"
    )
    conv.add_argument(
        "--checkpoint",
        type=Path,
        metavar="RUN_DIR",
        help="run folder to read (re-cut or --to-hf)",
    )
    step_arg(conv, "read")
    conv.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="--to-hf: the weights' type [default: float32, the training copy's]",
    )
    conv.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help="--from-hf/--to-hf: a tokenizer.json or Hugging Face tokenizer folder to take "
        "along [default: the source folder's, if it has one]",
    )
    conv.add_argument(
        "--allow-unverified",
        action="store_true",
        help="load a checkpoint that has no manifest (format 1, or damaged) without checking it",
    )
    conv.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Re-cut, import or export, as the options say; refuse a mix in one line."""
    from hpcllm import convert
    from hpcllm.errors import UserError

    axes = {k: getattr(args, k) for k in ("tp", "pp", "vpp", "dp", "ep", "schedule")}
    recut = any(v is not None for v in axes.values())
    if args.from_hf is not None:
        if (
            recut
            or args.step is not None
            or args.checkpoint is not None
            or args.allow_unverified
            or args.dtype is not None
        ):
            raise UserError("--from-hf takes --out RUN_DIR [--tokenizer PATH] only")
        if args.out is None:
            raise UserError("--from-hf needs --out RUN_DIR")
        out, seq_len, context = convert.import_hf(args.from_hf, args.out, args.tokenizer)
        if seq_len < context:
            print(
                f"wrote {out}: it trains at model.seq_len {seq_len}, not config.json's "
                f"{context} positions (--set model.seq_len=N for another; --to-hf writes "
                f"{context} back)"
            )
        else:
            print(f"wrote {out}")
    elif args.to_hf is not None:
        if recut or args.out is not None:
            raise UserError("--to-hf takes --checkpoint RUN_DIR [--step N], not a layout")
        if args.checkpoint is None:
            raise UserError("--to-hf needs --checkpoint RUN_DIR")
        out, step = convert.export_hf(
            args.checkpoint,
            args.to_hf,
            step=args.step,
            allow_unverified=args.allow_unverified,
            dtype=args.dtype or "float32",
            tokenizer=args.tokenizer,
        )
        print(f"wrote {out} from step {step}")
    else:
        if args.dtype is not None or args.tokenizer is not None:
            raise UserError("--dtype and --tokenizer go with --to-hf or --from-hf")
        if not recut:
            raise UserError(
                "say what to convert: --tp/--pp/--vpp/--dp/--ep/--schedule (re-cut), --to-hf DIR "
                "or --from-hf DIR"
            )
        if args.checkpoint is None or args.out is None:
            raise UserError("re-cutting needs --checkpoint RUN_DIR and --out NEW_RUN")
        from hpcllm.train.reshard import convert as recut_checkpoint

        out = recut_checkpoint(
            args.checkpoint,
            args.out,
            step=args.step,
            allow_unverified=args.allow_unverified,
            **axes,
        )
        from hpcllm.train import checkpoint

        print(f"wrote {out}, step {checkpoint.step_of(checkpoint.latest(out))}")
    return 0
