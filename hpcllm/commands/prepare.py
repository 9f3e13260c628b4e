"""``hpcllm prepare``: tokenize a corpus into HDF5 shards."""

from __future__ import annotations

import argparse
from pathlib import Path

from hpcllm.commands.args import positive


def add_parser(verbs: argparse._SubParsersAction) -> None:
    """Add the command's parser to ``verbs``."""
    prep = verbs.add_parser(
        "prepare",
        help="tokenize a corpus into HDF5 shards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize text into HDF5 shards plus a manifest, which `hpcllm train` "
        "reads.\n\n"
        "Each document (a text file, or a JSONL line) is tokenized, after the tokenizer's "
        "beginning-of-text token if it uses one, followed by its end-of-text token, and goes "
        "to the train or the validation split. Under "
        "mpirun/srun each rank tokenizes its part of the corpus and writes its own shards. "
        "Shards appear under their final names only when complete, and manifest.json is "
        "written last, so an interrupted prepare leaves nothing a reader accepts.\n\n"
        "examples:\n"
        "  hpcllm prepare --corpus python-stdlib --out data/stdlib\n"
        "  mpirun -np 4 hpcllm prepare --input books/ 'web/*.jsonl' --out data/mix "
        "--vocab-size 32000\n"
        "  hpcllm prepare --input corpus.txt --tokenizer gpt2/tokenizer.json --out data/g\n"
        "  hpcllm prepare --input corpus.txt --tokenizer Llama-3.2-1B/ --out data/llama",
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
        metavar="bpe|byte|FILE.json|DIR",
        help="bpe: train a byte-level BPE on the training documents; byte: raw "
        "UTF-8 bytes (257 ids: 256 bytes and EOS); FILE.json: a Hugging Face tokenizer.json; "
        "DIR: a Hugging Face tokenizer folder, whose tokenizer_config.json names BOS and EOS "
        "[default: bpe]",
    )
    prep.add_argument(
        "--vocab-size",
        type=positive,
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
        type=positive,
        default=None,
        metavar="N",
        help="train shards [default: one per rank]",
    )
    prep.add_argument(
        "--val-shards",
        type=positive,
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
    prep.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Prepare the shards; rank 0 prints their summary."""
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
