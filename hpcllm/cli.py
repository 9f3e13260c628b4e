"""The ``hpcllm`` command: parses arguments, then hands each verb to its module."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hpcllm import __version__
from hpcllm.errors import run_reporting_errors


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    topo.add_argument("--tp", type=_positive, default=1,
                      help="tensor-parallel size t (ranks that split each layer; keep within "
                      "a node) [default: 1]")
    topo.add_argument("--pp", type=_positive, default=1,
                      help="pipeline-parallel size p (stages) [default: 1]")
    topo.add_argument("--dp", type=_positive, default=None,
                      help="data-parallel size d [default: world size / (t*p)]; "
                      "t*p*d must equal the world size")
    topo.add_argument("--vpp", type=_positive, default=1,
                      help="virtual pipeline stages per rank for the interleaved schedule "
                      "[default: 1]")
    topo.add_argument("--json", action="store_true",
                      help="print one JSON object instead of the table")
    topo.set_defaults(run=_run_topo)

    _add_prepare(verbs)
    _add_inspect(verbs)
    _add_bench(verbs)
    return parser


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
    source.add_argument("--input", nargs="+", metavar="PATH",
                        help="text files, folders (searched recursively for .txt .md .rst .py "
                        ".jsonl) or quoted globs; a text file is one document, a .jsonl file "
                        "one document per line")
    source.add_argument("--corpus", choices=["python-stdlib"],
                        help="a built-in corpus: python-stdlib is the .py files of this "
                        "Python's standard library without its test suites (about 12 MB)")
    prep.add_argument("--out", required=True, type=Path, metavar="DIR",
                      help="folder for the shards, tokenizer.json and manifest.json; shards of "
                      "an earlier prepare in it are replaced")
    prep.add_argument("--tokenizer", default="bpe", metavar="bpe|byte|FILE.json",
                      help="bpe: train a byte-level BPE on the training documents; byte: raw "
                      "UTF-8 bytes (257 ids: 256 bytes and EOS); FILE.json: a Hugging Face "
                      "tokenizer.json with an <|endoftext|> token [default: bpe]")
    prep.add_argument("--vocab-size", type=_positive, default=8192, metavar="N",
                      help="vocabulary of the trained BPE, EOS included [default: 8192]")
    prep.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                      help="fraction of documents (not tokens) held out for validation, "
                      "spread evenly through the corpus [default: 0.01]")
    prep.add_argument("--shards", type=_positive, default=None, metavar="N",
                      help="train shards [default: one per rank]")
    prep.add_argument("--val-shards", type=_positive, default=1, metavar="N",
                      help="validation shards [default: 1]")
    prep.add_argument("--jsonl-field", default="text", metavar="NAME",
                      help="field of each JSONL record that holds the text [default: text]")
    prep.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    prep.set_defaults(run=_run_prepare)


def _add_inspect(verbs: argparse._SubParsersAction) -> None:
    insp = verbs.add_parser(
        "inspect",
        help="summarise, verify or dump prepared shards",
        description="Summarise a folder written by `hpcllm prepare`: shards, documents, "
        "tokens, tokenizer. --verify reads every shard and checks its checksums and counts; "
        "--dump writes a split's documents back as text.",
    )
    insp.add_argument("dir", type=Path, metavar="DIR", help="the folder given to prepare --out")
    insp.add_argument("--json", action="store_true", help="print the summary as JSON")
    insp.add_argument("--verify", action="store_true",
                      help="read every chunk of every shard (fletcher32 checksums), check "
                      "counts and document offsets; exit 2 naming the first bad file")
    insp.add_argument("--dump", choices=["train", "val"], metavar="train|val",
                      help="write the decoded documents of a split to stdout in corpus order, "
                      "each followed by '\\n<|endoftext|>\\n'")
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
    data.add_argument("--steps", type=_positive, default=2000,
                      help="micro-batches timed per rank [default: 2000]")
    data.add_argument("--warmup", type=int, default=20,
                      help="micro-batches read before timing [default: 20]")
    data.add_argument("--json", action="store_true", help="print JSON")
    data.set_defaults(run=_run_bench_data)
    prep = targets.add_parser(
        "prepare",
        help="prepare throughput in MB/s at several rank counts",
        description="Run `hpcllm prepare` on a built-in corpus for each tokenizer at each rank "
        "count (through mpirun when > 1) and print MB of text per second side by side.",
    )
    prep.add_argument("--corpus", default="python-stdlib", choices=["python-stdlib"],
                      help="[default: python-stdlib]")
    prep.add_argument("--out", type=Path, required=True, metavar="DIR",
                      help="scratch folder for the prepared copies")
    prep.add_argument("--ranks", type=_positive, nargs="+", default=[1, 2],
                      help="rank counts to run [default: 1 2]")
    prep.add_argument("--tokenizers", nargs="+", default=["byte", "bpe"],
                      choices=["byte", "bpe"], help="[default: byte bpe]")
    prep.add_argument("--vocab-size", type=_positive, default=8192, help="[default: 8192]")
    prep.add_argument("--threads-per-rank", type=_positive, default=None,
                      help="tokenizer threads per rank (RAYON_NUM_THREADS) [default: the "
                      "node's cores shared among its ranks]")
    prep.add_argument("--json", action="store_true", help="print JSON")
    prep.set_defaults(run=_run_bench_prepare)


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

    manifest = prepare(PrepareOptions(
        out=args.out, inputs=tuple(args.input or ()), corpus=args.corpus,
        tokenizer=args.tokenizer, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
        shards=args.shards, val_shards=args.val_shards, jsonl_field=args.jsonl_field,
    ), progress=not args.quiet)
    from hpcllm.topology import detect_launcher

    if not args.quiet and detect_launcher().rank == 0:
        from hpcllm.datasets.inspection import render_summary, summary
        from hpcllm.datasets.shards import load_manifest

        print(render_summary(summary(load_manifest(args.out))), flush=True)
    return 0 if manifest else 1


def _run_inspect(args: argparse.Namespace) -> int:
    from hpcllm.datasets import inspection
    from hpcllm.datasets.shards import load_manifest

    manifest = load_manifest(args.dir)
    if args.verify:
        count = inspection.verify(manifest)
        print(f"ok: {count} shards verified (checksums, counts, document offsets)",
              file=sys.stderr)
    if args.dump:
        inspection.dump(manifest, args.dump, sys.stdout.buffer)
        return 0
    info = inspection.summary(manifest)
    print(json.dumps(info, indent=2) if args.json else inspection.render_summary(info))
    return 0


def _run_bench_data(args: argparse.Namespace) -> int:
    from hpcllm.datasets import bench

    return bench.run(args.dir, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size,
                     steps=args.steps, warmup=args.warmup, as_json=args.json)


def _run_bench_prepare(args: argparse.Namespace) -> int:
    from hpcllm.datasets import bench

    return bench.run_prepare(args.corpus, args.out, tuple(args.ranks), tuple(args.tokenizers),
                             args.vocab_size, args.json, args.threads_per_rank)


def main(argv: list[str] | None = None) -> int:
    """Run the ``hpcllm`` command line and return its exit code."""
    args = _build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return run_reporting_errors(lambda: args.run(args))
