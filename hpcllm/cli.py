"""The ``hpcllm`` command: parses arguments, then hands each verb to its module."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcllm import __version__
from hpcllm.errors import run_reporting_errors

# `hpcllm train`'s exit status when SIGTERM or SIGUSR1 stopped it after it saved a checkpoint
# (EX_TEMPFAIL: try again later); jobs/slurm.sbatch requeues the job on it. 0 means finished.
STOPPED_EXIT = 75

if TYPE_CHECKING:
    from hpcllm.config import Config


def _at_least(convert: type, low: float, what: str) -> Any:
    """Return an argparse type: ``convert`` of the text, refused below ``low`` as not ``what``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse


_positive = _at_least(int, 1, "a positive integer")
_non_negative_int = _at_least(int, 0, "an integer >= 0")
_non_negative = _at_least(float, 0.0, "a number >= 0")


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="FILE", help="YAML config")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key (repeatable)",
    )


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UserErrors: one line, rank 0, exit 2 on every rank."""

    def error(self, message: str) -> None:  # type: ignore[override]
        from hpcllm.errors import UserError

        raise UserError(f"{message} (see `{self.prog} --help`)")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hpcllm",
        description="Train GPT-style models with tensor, pipeline and data parallelism, "
        "started by mpirun or srun.",
    )
    parser.add_argument("--version", action="version", version=f"hpcllm {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    topo = verbs.add_parser(
        "topo",
        help="show every rank's place in the tp x pp x dp grid",
        description="Start the grid as a training job would (MPI, then torch.distributed) and "
        "print, on rank 0, each world rank's tensor/pipeline/data coordinates, the members of "
        "its groups, its host, local rank and device. Rank order is Megatron's: tp varies "
        "fastest, then dp, then pp. Run it under the launcher you train with, e.g. "
        "`mpirun -np 8 hpcllm topo --tp 2 --pp 2` or `srun --mpi=pmix -n 8 hpcllm topo --tp 2`.",
    )
    topo.add_argument(
        "--tp",
        type=_positive,
        default=1,
        help="tensor-parallel size t (ranks that split each layer; keep within "
        "a node) [default: 1]",
    )
    topo.add_argument(
        "--pp", type=_positive, default=1, help="pipeline-parallel size p (stages) [default: 1]"
    )
    topo.add_argument(
        "--dp",
        type=_positive,
        default=None,
        help="data-parallel size d [default: world size / (t*p)]; t*p*d must equal the world size",
    )
    topo.add_argument(
        "--vpp",
        type=_positive,
        default=1,
        help="virtual pipeline stages per rank for the interleaved schedule [default: 1]",
    )
    topo.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    topo.set_defaults(run=_run_topo)

    _add_prepare(verbs)
    _add_inspect(verbs)
    _add_train(verbs)
    _add_generate(verbs)
    _add_evaluate(verbs)
    _add_convert(verbs)
    _add_plan(verbs)
    _add_bench(verbs)
    tl = verbs.add_parser(
        "timeline",
        help="draw a pipelined run's measured per-rank timeline",
        description="Read RUN_DIR/timeline/rank*.json (the last pipeline step each rank "
        "recorded) and draw one pipeline's stages as a PNG, like the Megatron paper's "
        "figures, plus a Chrome-trace JSON (chrome://tracing, Perfetto).",
    )
    tl.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    tl.add_argument(
        "--out",
        type=Path,
        default=None,
        help="PNG to write [default: RUN_DIR/timeline.png; the trace beside it]",
    )
    tl.add_argument("--dp-rank", type=int, default=0, help="which replica's pipeline")
    tl.add_argument("--tp-rank", type=int, default=0, help="which tp rank's pipeline")
    tl.set_defaults(run=_run_timeline)
    return parser


def _config_sections() -> str:
    """Return every config section with its keys, as ``model (preset, n_layer, ...)``."""
    import dataclasses

    from hpcllm.config import Config

    cfg = Config()
    sections = [(s.name, dataclasses.fields(getattr(cfg, s.name))) for s in dataclasses.fields(cfg)]
    return ", ".join(f"{name} ({', '.join(f.name for f in keys)})" for name, keys in sections)


def _config_keys() -> str:
    """Return two help lines per config key: its type, default and choices; its description."""
    from hpcllm.config import fields, show_value

    rows = []
    for f in fields():
        allowed = f"  [{' | '.join(f.choices)}]" if f.choices else ""
        rows.append(f"  {f.key:<28} {f.type_text():<16} {show_value(f.default)}{allowed}")
        rows.append(f"      {f.help}")
    return "\n".join(rows)


def _add_train(verbs: argparse._SubParsersAction) -> None:
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
    _add_config_args(train)
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
        type=_positive,
        metavar="N",
        help="with --print-config: check for N ranks (default: the launcher's world size)",
    )
    train.set_defaults(run=_run_train)


def _step_arg(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--step",
        type=_non_negative_int,
        metavar="N",
        help=f"{what} the checkpoint of step N [default: the newest that verifies]",
    )


def _add_generate(verbs: argparse._SubParsersAction) -> None:
    gen = verbs.add_parser(
        "generate",
        help="sample text from a run's checkpoint",
        description="Load RUN_DIR's newest checkpoint (or --step N's), of any layout: "
        "tensor-parallel slices and pipeline stages are merged in memory on one process; "
        "then continue a prompt.",
    )
    gen.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        metavar="RUN_DIR",
        help="a run folder (with checkpoints/ and tokenizer.json)",
    )
    _step_arg(gen, "sample from")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--tokens", type=_positive, default=100, help="new tokens [default: 100]")
    gen.add_argument(
        "--temperature",
        type=_non_negative,
        default=0.8,
        help="0 picks the most likely token [default: 0.8]",
    )
    gen.add_argument("--top-k", type=_positive, default=50, help="[default: 50]")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed [default: 0]")
    gen.set_defaults(run=_run_generate)


def _add_evaluate(verbs: argparse._SubParsersAction) -> None:
    ev = verbs.add_parser(
        "evaluate",
        help="a checkpoint's loss and perplexity on a prepared dataset",
        description="Merge RUN_DIR's newest checkpoint (or --step N's), of any layout, into "
        "one model on one process and print its mean loss and perplexity over micro-batches "
        "of PATH's split, read in the order the trainer's validation reads them.",
    )
    ev.add_argument(
        "--checkpoint", type=Path, required=True, metavar="RUN_DIR", help="a run folder"
    )
    _step_arg(ev, "evaluate")
    ev.add_argument(
        "--data",
        type=Path,
        required=True,
        metavar="PATH",
        help="prepared shards (hpcllm prepare --out PATH), tokenized as the run's data",
    )
    ev.add_argument("--split", choices=("val", "train"), default="val", help="[default: val]")
    ev.add_argument(
        "--micro-batch-size",
        type=_positive,
        metavar="B",
        help="samples per micro-batch [default: the run's train.micro_batch_size]",
    )
    ev.add_argument(
        "--iters",
        type=_positive,
        metavar="N",
        help="micro-batches [default: every whole micro-batch of the split]",
    )
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(run=_run_evaluate)


def _add_convert(verbs: argparse._SubParsersAction) -> None:
    from hpcllm.config import choices

    conv = verbs.add_parser(
        "convert",
        help="re-cut a checkpoint for another layout; Hugging Face GPT-2 in and out",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Re-cut: --checkpoint RUN_DIR --out NEW_RUN with any of --tp, --pp, --vpp, "
        "--dp, --schedule writes the checkpoint (weights, optimizer state, data position, "
        "random states) for that layout; `hpcllm train --config NEW_RUN/config.yaml` resumes "
        "it. "
        "Axes not given keep the checkpoint's.\n"
        "--to-hf DIR --checkpoint RUN_DIR writes a checkpoint of any layout as a "
        "GPT2LMHeadModel folder (config.json + model.safetensors).\n"
        "--from-hf DIR --out RUN_DIR makes a run folder whose step-0 checkpoint holds a "
        "Hugging Face GPT-2; train from it with --set run.dir=RUN_DIR.\n\n"
        "examples:\n"
        "  hpcllm convert --checkpoint runs/pp2 --out runs/t2 --tp 2 --pp 1\n"
        "  hpcllm convert --checkpoint runs/pp2 --out runs/v2 --pp 2 --vpp 2\n"
        "  hpcllm convert --checkpoint runs/pp2 --to-hf hf/pp2 --step 200",
    )
    way = conv.add_mutually_exclusive_group()
    way.add_argument("--from-hf", type=Path, metavar="DIR", help="Hugging Face folder to read")
    way.add_argument("--to-hf", type=Path, metavar="DIR", help="Hugging Face folder to write")
    conv.add_argument("--tp", type=_positive, metavar="T", help="new tensor-parallel size")
    conv.add_argument("--pp", type=_positive, metavar="P", help="new number of pipeline ranks")
    conv.add_argument(
        "--vpp",
        type=_positive,
        metavar="V",
        help="new chunks per pipeline rank (interleaved schedule) [default: the checkpoint's "
        "with p > 1, else 1]",
    )
    conv.add_argument(
        "--dp",
        type=_positive,
        metavar="D",
        help="new data-parallel size (the global batch is kept) [default: world / (t*p)]",
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
    _step_arg(conv, "read")
    conv.set_defaults(run=_run_convert)


def _add_plan(verbs: argparse._SubParsersAction) -> None:
    plan = verbs.add_parser(
        "plan",
        help="choose t, p, d, micro-batch, schedule and recomputation for a cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Estimate every layout of a GPT on N GPUs of a cluster (memory per GPU, "
        "step time by part) and print the fastest that fit, with why the others lost. "
        "Choices given (--tp, --pp, ...) are held; the rest are searched. The model and its "
        "validation against the SC21 paper: docs/plan.md.\n\n"
        "examples:\n"
        "  hpcllm plan --model gpt2-1.3b --gpus 64 --cluster jobs/clusters/dgx-a100.yaml "
        "--global-batch 512\n"
        "  hpcllm plan --layers 96 --hidden 12288 --heads 96 --seq 2048 --gpus 1536 "
        "--global-batch 2304 --cluster jobs/clusters/dgx-a100.yaml --recompute full --json",
    )
    plan.add_argument("--model", metavar="PRESET", help="a model preset (model.preset's values)")
    plan.add_argument("--layers", type=_positive, metavar="L", help="transformer layers")
    plan.add_argument("--hidden", type=_positive, metavar="H", help="hidden size")
    plan.add_argument("--heads", type=_positive, metavar="A", help="attention heads")
    plan.add_argument("--seq", type=_positive, metavar="S", help="sequence length")
    plan.add_argument(
        "--vocab",
        type=_positive,
        metavar="V",
        help="vocabulary [default: 51200; --write-config writes it only when given]",
    )
    plan.add_argument("--global-batch", type=_positive, required=True, metavar="B")
    plan.add_argument("--gpus", type=_positive, required=True, metavar="N")
    plan.add_argument("--cluster", type=Path, required=True, metavar="FILE", help="cluster YAML")
    plan.add_argument(
        "--cluster-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a cluster field (gpu_spec.FIELD too); repeatable",
    )
    plan.add_argument("--tp", type=_positive, metavar="T")
    plan.add_argument("--pp", type=_positive, metavar="P")
    plan.add_argument("--vpp", type=_positive, metavar="V")
    plan.add_argument("--micro-batch", type=_positive, metavar="B")
    plan.add_argument("--recompute", choices=("none", "selective", "full"))
    plan.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zb-h1"))
    plan.add_argument(
        "--software",
        choices=("hpcllm", "megatron-2021"),
        default="hpcllm",
        help="how the step runs: hpcllm (fp32 weights under autocast, flash attention, DDP "
        "overlapping the backward) or megatron-2021 (the SC21 paper's: fp16 weights, unfused "
        "attention, no overlap) [default: hpcllm]",
    )
    plan.add_argument(
        "--precision", choices=("bf16", "fp16", "fp32"), help="[default: the software's]"
    )
    plan.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="optimizer state sharded over the data-parallel group",
    )
    plan.add_argument("--top", type=_positive, default=5, metavar="K", help="[default: 5]")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument(
        "--write-config", type=Path, metavar="F", help="write a train config of the best layout"
    )
    plan.add_argument(
        "--png", type=Path, metavar="F", help="draw where the time of the top layouts goes"
    )
    plan.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    import dataclasses

    from hpcllm.config import PRESETS
    from hpcllm.errors import UserError
    from hpcllm.plan import search
    from hpcllm.plan.costs import Model, Software
    from hpcllm.plan.hardware import load_cluster

    shape = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq}
    if args.model is not None:
        if args.model not in PRESETS:
            raise UserError(f"unknown --model {args.model}; presets: {', '.join(PRESETS)}")
        preset = PRESETS[args.model]
        given = {"layers": "n_layer", "hidden": "d_model", "heads": "n_head", "seq": "seq_len"}
        shape = {k: v if v is not None else preset[given[k]] for k, v in shape.items()}
    missing = [k for k, v in shape.items() if v is None]
    if missing:
        raise UserError(f"give --model PRESET or --{missing[0]} (and the other sizes)")
    model = Model(vocab=args.vocab or 51200, **shape)
    cluster = load_cluster(args.cluster, args.cluster_set)
    software = Software.megatron_2021() if args.software == "megatron-2021" else Software()
    if args.precision:
        software = dataclasses.replace(software, precision=args.precision)
    if args.distributed_optimizer:
        software = dataclasses.replace(software, distributed_optimizer=True)
    fixed = search.Fixed(
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        micro_batch=args.micro_batch,
        schedule=args.schedule,
        recompute=args.recompute,
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


def _add_prepare(verbs: argparse._SubParsersAction) -> None:
    prep = verbs.add_parser(
        "prepare",
        help="tokenize a corpus into HDF5 shards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize text into HDF5 shards plus a manifest, which `hpcllm train` "
        "reads.\n\n"
        "Each document (a text file, or a JSONL line) is tokenized, followed by an "
        "end-of-text token, and goes to the train or the validation split. Under "
        "mpirun/srun each rank tokenizes its part of the corpus and writes its own shards. "
        "Shards appear under their final names only when complete, and manifest.json is "
        "written last, so an interrupted prepare leaves nothing a reader accepts.\n\n"
        "examples:\n"
        "  hpcllm prepare --corpus python-stdlib --out data/stdlib\n"
        "  mpirun -np 4 hpcllm prepare --input books/ 'web/*.jsonl' --out data/mix "
        "--vocab-size 32000\n"
        "  hpcllm prepare --input corpus.txt --tokenizer gpt2/tokenizer.json --out data/g",
    )
    source = prep.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="text files, folders (searched recursively for .txt .md .rst .py "
        ".jsonl) or quoted globs; a text file is one document, a .jsonl file "
        "one document per line",
    )
    source.add_argument(
        "--corpus",
        choices=["python-stdlib"],
        help="a built-in corpus: python-stdlib is the .py files of this "
        "Python's standard library without its test suites (about 12 MB)",
    )
    prep.add_argument(
        "--out",
        required=True,
        type=Path,
        metavar="DIR",
        help="folder for the shards, tokenizer.json and manifest.json; shards of "
        "an earlier prepare in it are replaced",
    )
    prep.add_argument(
        "--tokenizer",
        default="bpe",
        metavar="bpe|byte|FILE.json",
        help="bpe: train a byte-level BPE on the training documents; byte: raw "
        "UTF-8 bytes (257 ids: 256 bytes and EOS); FILE.json: a Hugging Face "
        "tokenizer.json with an <|endoftext|> token [default: bpe]",
    )
    prep.add_argument(
        "--vocab-size",
        type=_positive,
        default=None,
        metavar="N",
        help="vocabulary of the trained BPE, EOS included (bpe only) [default: 8192]",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="fraction of documents (not tokens) held out for validation, "
        "spread evenly through the corpus [default: 0.01]",
    )
    prep.add_argument(
        "--shards",
        type=_positive,
        default=None,
        metavar="N",
        help="train shards [default: one per rank]",
    )
    prep.add_argument(
        "--val-shards",
        type=_positive,
        default=1,
        metavar="N",
        help="validation shards [default: 1]",
    )
    prep.add_argument(
        "--jsonl-field",
        default="text",
        metavar="NAME",
        help="field of each JSONL record that holds the text [default: text]",
    )
    prep.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    prep.set_defaults(run=_run_prepare)


def _add_inspect(verbs: argparse._SubParsersAction) -> None:
    insp = verbs.add_parser(
        "inspect",
        help="summarise, verify or dump prepared shards; verify a run's checkpoints",
        description="Summarise a folder written by `hpcllm prepare`: shards, documents, "
        "tokens, tokenizer. --verify reads every shard and checks its checksums and counts; "
        "--dump writes a split's documents back as text. Given a run folder (run.dir), "
        "verify every checkpoint against its manifest and print one row per checkpoint "
        "(step, files, bytes, status, reason); exit 1 if any is bad.",
    )
    insp.add_argument(
        "dir", type=Path, metavar="DIR", help="the folder given to prepare --out, or a run.dir"
    )
    insp.add_argument("--json", action="store_true", help="print the summary as JSON")
    insp.add_argument(
        "--verify",
        action="store_true",
        help="read every chunk of every shard (fletcher32 checksums), check "
        "counts and document offsets; exit 2 naming the first bad file",
    )
    insp.add_argument(
        "--dump",
        choices=["train", "val"],
        metavar="train|val",
        help="write the decoded documents of a split to stdout in corpus order, "
        "each followed by '\\n<|endoftext|>\\n'",
    )
    insp.set_defaults(run=_run_inspect)


def _add_bench(verbs: argparse._SubParsersAction) -> None:
    bench = verbs.add_parser("bench", help="measure one part of the system")
    targets = bench.add_subparsers(dest="target", required=True, metavar="TARGET")
    data = targets.add_parser(
        "data",
        help="reader throughput in tokens/s per rank",
        description="Read micro-batches from prepared shards as fast as possible on every "
        "rank at once (each rank its own data-parallel part) and print tokens/s per rank.",
    )
    data.add_argument("dir", type=Path, metavar="DIR", help="a folder written by prepare")
    data.add_argument("--seq-len", type=_positive, default=1024, help="[default: 1024]")
    data.add_argument("--micro-batch-size", type=_positive, default=8, help="[default: 8]")
    data.add_argument(
        "--steps", type=_positive, default=2000, help="micro-batches timed per rank [default: 2000]"
    )
    data.add_argument(
        "--warmup", type=int, default=20, help="micro-batches read before timing [default: 20]"
    )
    data.add_argument("--json", action="store_true", help="print JSON")
    data.set_defaults(run=_run_bench_data)
    prep = targets.add_parser(
        "prepare",
        help="prepare throughput in MB/s at several rank counts",
        description="Run `hpcllm prepare` on a built-in corpus for each tokenizer at each rank "
        "count (through mpirun when > 1) and print MB of text per second side by side.",
    )
    prep.add_argument(
        "--corpus",
        default="python-stdlib",
        choices=["python-stdlib"],
        help="[default: python-stdlib]",
    )
    prep.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="scratch folder for the prepared copies",
    )
    prep.add_argument(
        "--ranks",
        type=_positive,
        nargs="+",
        default=[1, 2],
        help="rank counts to run [default: 1 2]",
    )
    prep.add_argument(
        "--tokenizers",
        nargs="+",
        default=["byte", "bpe"],
        choices=["byte", "bpe"],
        help="[default: byte bpe]",
    )
    prep.add_argument("--vocab-size", type=_positive, default=8192, help="[default: 8192]")
    prep.add_argument(
        "--threads-per-rank",
        type=_positive,
        default=None,
        help="tokenizer threads per rank (RAYON_NUM_THREADS) [default: the "
        "node's cores shared among its ranks]",
    )
    prep.add_argument("--json", action="store_true", help="print JSON")
    prep.set_defaults(run=_run_bench_prepare)
    step = targets.add_parser(
        "step",
        help="hpcllm's training step against GPT-2 in plain PyTorch, eager and compiled",
        description="For each shape, in one process: time hpcllm's training step (the config "
        "as given, and with fused kernels off) against nanoGPT's model and loop in plain "
        "PyTorch, eager and under torch.compile, in alternating blocks of steps; then run the "
        "real trainer loop for some steps. Prints ms/step, tokens/s, TFLOP/s, MFU, the ratios "
        "to the plain model and the ops that ran Triton kernels. Shapes set the model and "
        "micro-batch; --set applies on top of every shape. Reads the prepared data of "
        "data.path (the built-in corpus by default: `hpcllm prepare --corpus python-stdlib "
        "--out data/stdlib`).",
    )
    _add_config_args(step)
    step.add_argument(
        "--shapes",
        nargs="+",
        choices=["gpt2-124m", "gpt2-1.3b", "cpu-smoke"],
        default=None,
        help="[default: gpt2-124m (seq 1024, mb 16) and gpt2-1.3b (seq 2048, mb 4); "
        "cpu-smoke with --cpu-smoke]",
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
        "--steps", type=_positive, default=None, help="steps per block [default: 3, smoke 2]"
    )
    step.add_argument(
        "--rounds",
        type=_positive,
        default=None,
        help="alternating blocks of each [default: 6, smoke 10]",
    )
    step.add_argument(
        "--warmup", type=int, default=2, help="steps of each side before timing [default: 2]"
    )
    step.add_argument(
        "--loop-steps",
        type=_positive,
        default=None,
        help="steps of the trainer loop, at least 3 [default: 20, smoke 16]",
    )
    step.add_argument("--json-out", type=Path, default=None, help="also write JSON here")
    step.set_defaults(run=_run_bench_step)
    dpb = targets.add_parser(
        "dp",
        help="DDP vs Horovod vs parameter server, fp32 and mixed precision",
        description="Train the config's model for a few steps as a single-rank baseline and "
        "with each data-parallel engine at each d (mpirun), in each precision, with the "
        "micro-batch per rank fixed; then all-reduce a gradient-sized buffer through MPI, "
        "torch.distributed and Horovod. Prints the comparison table and writes "
        "bench_dp.json, bench_dp.png and bench_dp.txt to --out.",
    )
    _add_config_args(dpb)
    dpb.add_argument(
        "--dp",
        type=_positive,
        nargs="+",
        default=None,
        help="data-parallel sizes [default: 2 up to the cores or GPUs here]",
    )
    dpb.add_argument(
        "--engines",
        nargs="+",
        default=["ddp", "horovod", "ps", "ddp-zero", "horovod-zero"],
        choices=["ddp", "horovod", "ps", "ddp-zero", "horovod-zero"],
        help="ddp-zero and horovod-zero: that engine with the distributed optimizer "
        "(parallel.distributed_optimizer) [default: all five]",
    )
    dpb.add_argument(
        "--precisions",
        nargs="+",
        default=None,
        choices=["fp32", "bf16", "fp16"],
        help="[default: fp32 and fp16 on GPU; fp32 and bf16 on a CPU with native bf16 "
        "arithmetic (avx512_bf16/amx_bf16), else fp32 only]",
    )
    dpb.add_argument("--steps", type=_positive, default=30, help="steps per run [default: 30]")
    dpb.add_argument(
        "--warmup", type=int, default=5, help="first steps left out of the rates [default: 5]"
    )
    dpb.add_argument(
        "--out",
        type=Path,
        default=Path("runs/bench-dp"),
        help="folder for the runs and results [default: runs/bench-dp]",
    )
    dpb.set_defaults(run=_run_bench_dp)
    syncb = targets.add_parser(
        "sync",
        help="synchronous vs asynchronous vs local updates, with and without a straggler",
        description="Train the config's model for the same number of samples at d ranks "
        "(mpirun) under synchronous ddp and ps, ps-async at each staleness bound and "
        "local-sgd at each H, each without and with a dialled straggler, and print samples/s, "
        "its ratio to the same strategy without the straggler, the final losses and the mean "
        "staleness. Writes bench_sync.json, bench_sync.png and bench_sync.txt to --out.",
    )
    _add_config_args(syncb)
    syncb.add_argument("--dp", type=_positive, default=2, help="ranks [default: 2]")
    syncb.add_argument(
        "--engines",
        nargs="+",
        default=["ddp", "ps", "ps-async", "local-sgd"],
        choices=["ddp", "ps", "ps-async", "local-sgd"],
        help="strategies to compare: ps-async once per --staleness, local-sgd once per "
        "--local-steps [default: all four]",
    )
    syncb.add_argument(
        "--steps", type=_positive, default=60, help="global batches per run [default: 60]"
    )
    syncb.add_argument(
        "--log-every",
        type=_positive,
        default=15,
        help="steps between sync points (logged steps), the first interval left out of the "
        "rates [default: 15]",
    )
    syncb.add_argument(
        "--staleness",
        type=int,
        nargs="+",
        default=[1, 4],
        help="ps-async max_staleness values [default: 1 4]",
    )
    syncb.add_argument(
        "--local-steps",
        type=_positive,
        nargs="+",
        default=[2, 8],
        help="local-sgd averaging periods H [default: 2 8]",
    )
    syncb.add_argument("--straggler-rank", type=int, default=1, help="the slow rank [default: 1]")
    syncb.add_argument(
        "--straggler-factor",
        type=float,
        default=3.0,
        help="how many times as long its compute takes [default: 3]",
    )
    syncb.add_argument(
        "--repeats", type=_positive, default=1, help="runs of each case, median [default: 1]"
    )
    syncb.add_argument(
        "--out",
        type=Path,
        default=Path("runs/bench-sync"),
        help="folder for the runs and results [default: runs/bench-sync]",
    )
    syncb.set_defaults(run=_run_bench_sync)
    allr = targets.add_parser(
        "allreduce",
        help="all-reduce bandwidth through MPI, torch.distributed and Horovod",
        description="Under mpirun: all-reduce one float32 buffer through mpi4py, "
        "torch.distributed and Horovod and print algbw/busbw (nccl-tests definitions).",
    )
    allr.add_argument("--bytes", type=_positive, default=8 << 20, help="[default: 8 MiB]")
    allr.add_argument("--iters", type=_positive, default=50, help="[default: 50]")
    allr.add_argument("--warmup", type=int, default=5, help="[default: 5]")
    allr.add_argument("--json-out", type=Path, default=None, help="also write JSON here")
    allr.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress on stderr (a bar on a terminal, else a line per transport)",
    )
    allr.set_defaults(run=_run_bench_allreduce)
    pipe = targets.add_parser(
        "pipeline",
        help="pipeline schedules: measured bubble against theory",
        description="Under mpirun with p ranks (one pipeline): run each schedule through the "
        "real runtime with fixed-cost (sleeping) stages, or the tiny GPT, and print the "
        "measured bubble next to (p-1)/m and (p-1)/(v*m), step-time ratios against 1f1b and "
        "the peak number of live activations per rank.",
    )
    pipe.add_argument(
        "--schedules",
        nargs="+",
        default=["gpipe", "1f1b", "interleaved", "zb-h1"],
        choices=["gpipe", "1f1b", "interleaved", "zb-h1"],
    )
    pipe.add_argument(
        "--microbatches",
        type=_positive,
        nargs="+",
        default=[4, 8, 16],
        help="micro-batches per step, m [default: 4 8 16]",
    )
    pipe.add_argument(
        "--vpp",
        type=_positive,
        default=2,
        help="virtual stages per rank for interleaved [default: 2]",
    )
    pipe.add_argument(
        "--forward-ms",
        type=float,
        default=40.0,
        help="synthetic forward time per stage; backward is twice it [default: 40]",
    )
    pipe.add_argument("--model", choices=["synthetic", "gpt"], default="synthetic")
    pipe.add_argument("--steps", type=_positive, default=3, help="[default: 3]")
    pipe.add_argument("--warmup", type=int, default=1, help="[default: 1]")
    pipe.add_argument(
        "--timeline-dir",
        type=Path,
        default=None,
        help="draw each run's measured timeline (PNG + Chrome trace) here",
    )
    pipe.add_argument("--json-out", type=Path, default=None, help="also write JSON here")
    pipe.set_defaults(run=_run_bench_pipeline)
    kern = targets.add_parser(
        "kernels",
        help="fused Triton kernels against eager PyTorch and torch.compile (GPU)",
        description="Time each fused op against eager PyTorch and torch.compile, then a "
        "gpt2-124m training step with fused kernels on and off; arguments after 'kernels' go "
        "to the benchmark (--help there). --cpu-smoke runs it tiny under Triton's "
        "interpreter.",
        add_help=False,
    )
    kern.add_argument("kernel_args", nargs=argparse.REMAINDER)
    kern.set_defaults(run=_run_bench_kernels)
    dev = targets.add_parser(
        "device",
        help="what hpcllm plan assumes of this GPU, measured: a gpu_spec for a cluster file",
        description="Measure GEMM throughput by shape, causal attention and copy bandwidth on "
        "this GPU and write them as the gpu_spec of a cluster file, so hpcllm plan prices "
        "this GPU from its own numbers; arguments after 'device' go to the benchmark (--help "
        "there). --cpu-smoke runs it tiny on the CPU.",
        add_help=False,
    )
    dev.add_argument("device_args", nargs=argparse.REMAINDER)
    dev.set_defaults(run=_run_bench_device)


def _run_topo(args: argparse.Namespace) -> int:
    from hpcllm import topology

    grid = topology.init(tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp)
    report = topology.describe_grid(grid)
    if grid.rank == 0:
        print(json.dumps(report) if args.json else topology.render_grid(report), flush=True)
    topology.shutdown()
    return 0


def _run_prepare(args: argparse.Namespace) -> int:
    from hpcllm.datasets.prepare import PrepareOptions, prepare

    manifest = prepare(
        PrepareOptions(
            out=args.out,
            inputs=tuple(args.input or ()),
            corpus=args.corpus,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            shards=args.shards,
            val_shards=args.val_shards,
            jsonl_field=args.jsonl_field,
        ),
        progress=not args.quiet,
    )
    from hpcllm.launcher import detect_launcher

    if not args.quiet and detect_launcher().rank == 0:
        from hpcllm.datasets.inspection import render_summary, summary
        from hpcllm.datasets.shards import load_manifest

        print(render_summary(summary(load_manifest(args.out))), flush=True)
    return 0 if manifest else 1


def _run_inspect(args: argparse.Namespace) -> int:
    from hpcllm.datasets import inspection
    from hpcllm.datasets.shards import load_manifest
    from hpcllm.errors import UserError
    from hpcllm.train import inspect_run

    if inspect_run.is_run_folder(args.dir):
        if args.dump:
            raise UserError(f"{args.dir} is a run folder; --dump reads a prepared data folder")
        check = inspect_run.verify_run(args.dir)
        if args.json:
            rows = [{**vars(v), "folder": str(v.folder)} for v in check.verdicts]
            print(json.dumps({"checkpoints": rows, "latest": check.latest_problem or check.latest}))
        else:
            print(inspect_run.render_run(check))
        return 0 if check.ok else 1
    manifest = load_manifest(args.dir)
    if args.verify:
        count = inspection.verify(manifest)
        print(f"ok: {count} shards verified (checksums, counts, document offsets)", file=sys.stderr)
    if args.dump:
        try:
            inspection.dump(manifest, args.dump, sys.stdout.buffer)
        except BrokenPipeError:  # `| head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    info = inspection.summary(manifest)
    print(json.dumps(info, indent=2) if args.json else inspection.render_summary(info))
    return 0


def _run_bench_data(args: argparse.Namespace) -> int:
    from hpcllm.bench import data

    return data.run(
        args.dir,
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        steps=args.steps,
        warmup=args.warmup,
        as_json=args.json,
    )


def _check_for_print(cfg: Config, world_size: int) -> None:
    """Raise a UserError for what training would refuse before it starts, touching nothing.

    The checks :func:`~hpcllm.train.preflight.preflight` makes, then, where ``data.path``
    exists, the ones the trainer makes against the data: its tokenizer's vocabulary and a
    train split holding at least one global micro-batch (d x micro-batch size).
    """
    from hpcllm.datasets.shards import load_manifest
    from hpcllm.topology import Layout
    from hpcllm.train.preflight import check_against_data, preflight

    preflight(cfg, world_size)
    if not Path(cfg.data.path).exists():
        return
    parallel = cfg.parallel
    layout = Layout.for_world(
        world_size, tp=parallel.tp, pp=parallel.pp, dp=parallel.dp, vpp=parallel.vpp
    )
    check_against_data(cfg, load_manifest(cfg.data.path), layout.dp)


def _run_train(args: argparse.Namespace) -> int:
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
        from hpcllm.config import render_yaml
        from hpcllm.launcher import detect_launcher

        _check_for_print(cfg, args.world_size or detect_launcher().world_size)
        print(render_yaml(cfg), end="", flush=True)
        return 0
    if args.world_size is not None:
        from hpcllm.errors import UserError

        raise UserError("--world-size goes with --print-config; the launcher sets a run's")
    from hpcllm import observe
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


def _run_timeline(args: argparse.Namespace) -> int:
    from hpcllm.errors import UserError
    from hpcllm.parallel.pipeline.timeline import chrome_trace, draw

    records = []
    for path in sorted((args.run_dir / "timeline").glob("rank*.json")):
        record = json.loads(path.read_text())
        if (record["dp_rank"], record["tp_rank"]) == (args.dp_rank, args.tp_rank):
            records.append(record)
    if not records:
        raise UserError(
            f"{args.run_dir / 'timeline'} holds no timeline of dp rank "
            f"{args.dp_rank}, tp rank {args.tp_rank}; a run with parallel.pp > 1 "
            "writes one when it ends"
        )
    records.sort(key=lambda r: r["pp_rank"])
    ranks = [
        [
            dict(zip(("kind", "microbatch", "chunk", "start", "end"), i, strict=True))
            for i in r["intervals"]
        ]
        for r in records
    ]
    first = records[0]
    title = (
        f"{first['schedule']}: p={first['pp']}, m={first['microbatches']}"
        + (f", v={first['vpp']}" if first["vpp"] > 1 else "")
        + f" (measured, step {first['step']})"
    )
    png = args.out or args.run_dir / "timeline.png"
    draw(ranks, png, title)
    trace = chrome_trace(ranks, png.with_suffix(".json"))
    print(f"wrote {png} and {trace}")
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from hpcllm.generate import generate

    print(
        generate(
            args.checkpoint,
            args.prompt,
            tokens=args.tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            step=args.step,
        )
    )
    return 0


def _run_evaluate(args: argparse.Namespace) -> int:
    import dataclasses

    from hpcllm.evaluate import evaluate

    result = evaluate(
        args.checkpoint,
        args.data,
        step=args.step,
        split=args.split,
        micro_batch_size=args.micro_batch_size,
        iters=args.iters,
    )
    print(json.dumps(dataclasses.asdict(result)) if args.json else result.line())
    return 0


def _run_convert(args: argparse.Namespace) -> int:
    from hpcllm import convert
    from hpcllm.errors import UserError

    axes = {k: getattr(args, k) for k in ("tp", "pp", "vpp", "dp", "schedule")}
    recut = any(v is not None for v in axes.values())
    if args.from_hf is not None:
        if recut or args.step is not None or args.checkpoint is not None:
            raise UserError("--from-hf takes --out RUN_DIR only")
        if args.out is None:
            raise UserError("--from-hf needs --out RUN_DIR")
        print(f"wrote {convert.from_hf(args.from_hf, args.out)}")
    elif args.to_hf is not None:
        if recut or args.out is not None:
            raise UserError("--to-hf takes --checkpoint RUN_DIR [--step N], not a layout")
        if args.checkpoint is None:
            raise UserError("--to-hf needs --checkpoint RUN_DIR")
        print(f"wrote {convert.to_hf(args.checkpoint, args.to_hf, step=args.step)}")
    else:
        if not recut:
            raise UserError(
                "say what to convert: --tp/--pp/--vpp/--dp/--schedule (re-cut), --to-hf DIR "
                "or --from-hf DIR"
            )
        if args.checkpoint is None or args.out is None:
            raise UserError("re-cutting needs --checkpoint RUN_DIR and --out NEW_RUN")
        from hpcllm.train.reshard import convert as recut_checkpoint

        out = recut_checkpoint(args.checkpoint, args.out, step=args.step, **axes)
        print(f"wrote {out}")
    return 0


def _run_bench_step(args: argparse.Namespace) -> int:
    from hpcllm.errors import UserError

    if args.cpu_smoke:
        # Before anything asks torch about CUDA: the smoke run is on the CPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    loop_steps = args.loop_steps or (16 if args.cpu_smoke else 20)
    if loop_steps < 3:
        raise UserError("--loop-steps must be at least 3 (timed step to step after the first)")
    from hpcllm.bench import step

    result = step.run(
        args.shapes or (["cpu-smoke"] if args.cpu_smoke else ["gpt2-124m", "gpt2-1.3b"]),
        args.config,
        args.overrides,
        args.precision,
        args.compile,
        args.steps or (2 if args.cpu_smoke else 3),
        args.rounds or (10 if args.cpu_smoke else 6),
        args.warmup,
        loop_steps,
    )
    print(step.render(result))
    if args.json_out is not None:
        step.write_json(result, args.json_out)
    return 0


def _run_bench_dp(args: argparse.Namespace) -> int:
    import torch

    from hpcllm.bench import dp
    from hpcllm.errors import UserError

    gpu = torch.cuda.is_available()
    devices = torch.cuda.device_count() if gpu else len(os.sched_getaffinity(0))
    dps = args.dp or list(range(2, devices + 1))
    if not dps:
        raise UserError(
            "bench dp needs d >= 2 and this node has one GPU, so there is nothing to "
            "compare; run it on a node with more GPUs"
        )
    if gpu and max(dps) > devices:
        # Its ranks start on this node (mpirun -np d), one GPU each: NCCL refuses two ranks
        # on one GPU.
        raise UserError(
            f"bench dp runs d = {max(dps)} ranks on this node, one GPU each, and it has "
            f"{devices}; give --dp up to {devices}"
        )
    precisions = args.precisions  # None: what the machine runs fast (dp.default_precisions)
    return dp.run(
        args.config,
        args.overrides,
        dps,
        args.engines,
        precisions,
        args.steps,
        args.warmup,
        args.out,
    )


def _run_bench_sync(args: argparse.Namespace) -> int:
    from hpcllm.bench import sync
    from hpcllm.errors import UserError

    if args.dp < 2:
        raise UserError("bench sync compares data-parallel strategies: give --dp 2 or more")
    if not 0 <= args.straggler_rank < args.dp:
        raise UserError(f"--straggler-rank {args.straggler_rank} is not a rank of --dp {args.dp}")
    if args.straggler_factor < 1:
        raise UserError(f"--straggler-factor must be at least 1, got {args.straggler_factor:g}")
    if any(k < 0 for k in args.staleness):
        raise UserError("--staleness values must be >= 0")
    return sync.run(
        args.config,
        args.overrides,
        args.dp,
        args.steps,
        args.log_every,
        args.staleness,
        args.local_steps,
        args.straggler_rank,
        args.straggler_factor,
        args.repeats,
        args.out,
        args.engines,
    )


def _run_bench_pipeline(args: argparse.Namespace) -> int:
    from hpcllm.bench import pipeline

    pipeline.run(
        args.schedules,
        args.microbatches,
        args.vpp,
        args.forward_ms / 1000.0,
        args.steps,
        args.warmup,
        args.model,
        args.timeline_dir,
        args.json_out,
    )
    return 0


def _run_bench_kernels(args: argparse.Namespace) -> int:
    from hpcllm.bench import kernels

    return kernels.main(list(args.kernel_args))


def _run_bench_device(args: argparse.Namespace) -> int:
    from hpcllm.bench import device

    return device.main(list(args.device_args))


def _run_bench_allreduce(args: argparse.Namespace) -> int:
    from hpcllm.bench import allreduce

    result = allreduce.bench_allreduce(
        args.bytes, args.iters, args.warmup, progress=not args.no_progress
    )
    if result is not None:
        print(allreduce.render_allreduce(result))
        if args.json_out:
            args.json_out.write_text(json.dumps(result, indent=2))
    return 0


def _run_bench_prepare(args: argparse.Namespace) -> int:
    from hpcllm.bench import prepare

    return prepare.run(
        args.corpus,
        args.out,
        tuple(args.ranks),
        tuple(args.tokenizers),
        args.vocab_size,
        args.json,
        args.threads_per_rank,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the ``hpcllm`` command line and return its exit code (the command is :func:`run`)."""

    words = sys.argv[1:] if argv is None else argv

    def parse_and_run() -> int:
        if words[:2] == ["bench", "kernels"]:
            # Its own parser takes every option: argparse's REMAINDER in a sub-command would
            # refuse the ones that start with "-" (--cpu-smoke).
            from hpcllm.bench import kernels

            return kernels.main(words[2:])
        if words[:2] == ["bench", "device"]:
            from hpcllm.bench import device

            return device.main(words[2:])
        args = _build_parser().parse_args(words)
        code = args.run(args)
        _end_torch_distributed()
        return code

    return run_reporting_errors(parse_and_run)


def run() -> None:
    """The ``hpcllm`` command (and ``python -m hpcllm``): :func:`main`, then the process ends.

    A process in which the command started torch.distributed ends through
    :func:`exit_process`; any other exits as usual.
    """
    code = main()
    topology = sys.modules.get("hpcllm.topology")
    if topology is not None and topology.was_started():
        exit_process(code)
    sys.exit(code)


def _end_torch_distributed() -> None:
    """Destroy torch.distributed's process groups, if a command started them.

    destroy_process_group frees the groups torch's registry held last; the command's own
    objects are unreachable now but for reference cycles, and collecting them destroys the
    groups they held, which joins those groups' worker threads.
    """
    if "torch.distributed" not in sys.modules:  # a command that never imported torch
        return
    import gc

    from hpcllm import topology

    topology.shutdown()
    gc.collect()


def exit_process(code: int) -> None:
    """End the process with ``code`` without the interpreter's finalisation.

    A Gloo process group can outlive destroy_process_group (torch keeps a reference of its
    own once an optimizer has been built), and with it its worker threads. One that is still
    releasing a finished operation's tensors when Python finalises needs the GIL, which a
    finalising interpreter refuses by ending the thread inside C++: the rank aborts (SIGABRT,
    "terminate called without an active exception") after a run that succeeded. So the
    process ends the way finalisation would have, minus that: Python's exit handlers (the
    watchdog's stop, Horovod's shutdown), MPI_Finalize where MPI was started, Python's and C's
    buffered output flushed, then ``os._exit``, whatever a step of that raises.
    """
    import atexit
    import ctypes

    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        atexit._run_exitfuncs()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).fflush(None)  # what C extensions printed (NCCL_DEBUG, ...)
        os._exit(code)
