"""``hpcllm plan``: choose t, p, d, ep, cp, micro-batch, schedule and recomputation for a
cluster."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hpcllm.commands.args import positive


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add the command's parser to ``verbs``."""
    plan = verbs.add_parser(
        "plan",
        help="choose t, p, d, ep, micro-batch, schedule and recomputation for a cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Estimate every layout of a GPT on N GPUs of a cluster (memory per GPU, "
        "step time by part) and print the fastest that fit, with why the others lost. "
        "Choices given (--tp, --pp, ...) are held; the rest are searched, the expert-parallel "
        "size ep too for a mixture of experts (--set model.moe_experts=E). The model and its "
        "validation against the SC21 paper: docs/plan.md.\n\n"
        "examples:\n"
        "  hpcllm plan --model gpt2-1.3b --gpus 64 --cluster jobs/clusters/dgx-a100.yaml "
        "--global-batch 512\n"
        "  hpcllm plan --layers 96 --hidden 12288 --heads 96 --seq 2048 --gpus 1536 "
        "--global-batch 2304 --cluster jobs/clusters/dgx-a100.yaml --recompute full --json\n"
        "  hpcllm plan --model gpt2-1.3b --set model.moe_experts=8 --gpus 64 "
        "--global-batch 512 --cluster jobs/clusters/dgx-h100.yaml --ep 8",
    )
    plan.add_argument(
        "--model",
        metavar="PRESET",
        help="a model preset of any registered family (model.preset's values: its sizes, the "
        "family's own keys and its vocabulary)",
    )
    plan.add_argument("--layers", type=positive, metavar="L", help="transformer layers")
    plan.add_argument("--hidden", type=positive, metavar="H", help="hidden size")
    plan.add_argument("--heads", type=positive, metavar="A", help="attention heads")
    plan.add_argument("--seq", type=positive, metavar="S", help="sequence length")
    plan.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="model.KEY=VALUE",
        help="a model key as train's --set takes it, e.g. model.moe_experts=8 for a mixture of "
        "experts (docs/moe.md); repeatable",
    )
    plan.add_argument(
        "--vocab",
        type=positive,
        metavar="V",
        help="vocabulary [default: the preset's, else 51200; --write-config writes it only "
        "when given or the preset has one]",
    )
    plan.add_argument("--global-batch", type=positive, required=True, metavar="B")
    plan.add_argument("--gpus", type=positive, required=True, metavar="N")
    plan.add_argument("--cluster", type=Path, required=True, metavar="FILE", help="cluster YAML")
    plan.add_argument(
        "--cluster-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a cluster field (gpu_spec.FIELD too); repeatable",
    )
    plan.add_argument("--tp", type=positive, metavar="T")
    plan.add_argument("--pp", type=positive, metavar="P")
    plan.add_argument("--vpp", type=positive, metavar="V")
    plan.add_argument(
        "--ep",
        type=positive,
        metavar="E",
        help="expert-parallel size, ranks of d that split each MoE block's experts [default: "
        "searched, every divisor of d that divides the experts; 1 for a dense model]",
    )
    plan.add_argument(
        "--cp",
        type=positive,
        metavar="C",
        help="context-parallel size, ranks that split each sequence (next to t) [default: "
        "searched for sequences of 8192 tokens and more, else 1]",
    )
    plan.add_argument("--micro-batch", type=positive, metavar="B")
    plan.add_argument("--recompute", choices=("none", "selective", "full"))
    plan.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1"))
    plan.add_argument(
        "--software",
        choices=("hpcllm", "megatron-2021", "megatron-core"),
        default="hpcllm",
        help="whose step is priced: hpcllm (fp32 weights under autocast, flash attention, DDP "
        "overlapping the backward); megatron-2021 (the SC21 paper's: fp16, unfused attention, "
        "the data-parallel reduction overlapped only at p = 1, no sequence parallelism, "
        "recompute full or none; flags that contradict it "
        "are refused); megatron-core (2024: bf16 weights, fp32 gradients, the distributed "
        "optimizer, data-parallel, tensor-parallel and pipeline communication overlapped) "
        "[default: hpcllm]",
    )
    plan.add_argument(
        "--precision", choices=("bf16", "fp16", "fp32"), help="[default: the software's]"
    )
    plan.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split norms and dropout along the sequence [default: on when t > 1, where the "
        "software has it]",
    )
    plan.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="optimizer state sharded over the data-parallel group",
    )
    plan.add_argument("--top", type=positive, default=5, metavar="K", help="[default: 5]")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument(
        "--write-config", type=Path, metavar="F", help="write a train config of the best layout"
    )
    plan.add_argument(
        "--png", type=Path, metavar="F", help="draw where the time of the top layouts goes"
    )
    plan.set_defaults(run=run)


def _model(args: argparse.Namespace) -> Any:
    """Return the planner's Model: a preset of any registered family, its sizes overridden by
    --set model.KEY=VALUE and --layers ... --seq, or those sizes alone (the default
    model.arch's); its shape the family's of that config, with the vocabulary --vocab, else
    the preset's, else 51,200; its experts those of the config's model.moe_* keys."""
    from hpcllm import families
    from hpcllm.config import load_config
    from hpcllm.errors import UserError
    from hpcllm.plan.costs import Model

    sizes = {
        "layers": ("n_layer", args.layers),
        "hidden": ("d_model", args.hidden),
        "heads": ("n_head", args.heads),
        "seq": ("seq_len", args.seq),
    }
    given = [f"model.{key}={value}" for key, value in sizes.values() if value is not None]
    for item in args.overrides:
        if not item.startswith("model."):
            raise UserError(f"--set {item}: hpcllm plan takes model.* keys only")
    if args.model is None:
        missing = [flag for flag, (_, value) in sizes.items() if value is None]
        if missing:
            raise UserError(f"give --model PRESET or --{missing[0]} (and the other sizes)")
        chosen = ["model.preset=null"]
    else:
        arch = families.preset_family(args.model)
        if arch is None:
            known = ", ".join(families.presets())
            raise UserError(f"unknown --model {args.model}; presets: {known}")
        chosen = [f"model.arch={arch}", f"model.preset={args.model}"]
    model = load_config(None, [*chosen, *args.overrides, *given]).model
    vocab = args.vocab or model.vocab_size or 51200
    return Model.from_config(model, vocab)


def run(args: argparse.Namespace) -> int:
    """Search the layouts and print (or write) the best."""
    from hpcllm.plan import search
    from hpcllm.plan.costs import Software
    from hpcllm.plan.hardware import load_cluster

    model = _model(args)
    cluster = load_cluster(args.cluster, args.cluster_set)
    software = Software.named(args.software, args.precision, args.distributed_optimizer)
    fixed = search.Fixed(
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        ep=args.ep,
        cp=args.cp,
        micro_batch=args.micro_batch,
        schedule=args.schedule,
        recompute=args.recompute,
        sequence_parallel=args.sequence_parallel,
    )
    plan = search.search(model, args.gpus, args.global_batch, cluster, software, fixed)
    if args.json:
        print(json.dumps(search.to_json(plan, args.top)))
    else:
        print(search.render(plan, args.top))
    if args.write_config:
        path = search.write_config(plan, args.write_config, args.model, args.vocab)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    if args.png:
        path = search.draw(plan, args.png, args.top)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0
