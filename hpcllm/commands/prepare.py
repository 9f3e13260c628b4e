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
        "Each document (a text file, or the pieces --split-on or --chunk-chars cuts it into; a "
        "JSONL line; a Parquet row) is tokenized, after the tokenizer's beginning-of-text token "
        "if it uses one, followed by its end-of-text token, and goes to the train or the "
        "validation split: the --val-input documents when given, else a --val-fraction of "
        "all. Under "
        "mpirun/srun each rank tokenizes its part of the corpus and writes its own shards. "
        "Shards appear under their final names only when complete, and manifest.json is "
        "written last, so an interrupted prepare leaves nothing a reader accepts.\n\n"
        "examples:\n"
        "  hpcllm prepare --corpus python-stdlib --out data/stdlib\n"
        "  mpirun -np 4 hpcllm prepare --input books/ 'web/*.jsonl' --out data/mix "
        "--vocab-size 32000\n"
        "  hpcllm prepare --input corpus.txt --tokenizer gpt2/tokenizer.json --out data/g\n"
        "  hpcllm prepare --input corpus.txt --tokenizer Llama-3.2-1B/ --out data/llama\n"
        "  hpcllm prepare --input train.txt --val-input val.txt --split-on '\\n\\n' "
        "--out data/mine\n"
        "  hpcllm prepare --input web/ --text-field content --out data/web   "
        "# .parquet files: pip install 'hpcllm[parquet]'",
    )
    _add_input_args(prep)
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
        default=None,
        metavar="F",
        help="fraction of documents (not tokens) held out for validation, "
        "spread evenly through the corpus; not with --val-input [default: 0.01]",
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
    prep.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    prep.set_defaults(run=run)


def _add_input_args(prep: argparse.ArgumentParser) -> None:
    """Add the options that say where the documents come from and what each one is."""
    source = prep.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="text files, folders (searched recursively for .txt .md .rst .py .text "
        ".jsonl .ndjson .parquet) or quoted globs; a text file is one document (unless cut: "
        "--split-on, --chunk-chars), a .jsonl file one document per line, a .parquet file one "
        "per row",
    )
    source.add_argument(
        "--corpus",
        choices=["python-stdlib"],
        help="a built-in corpus: python-stdlib is the .py files of this "
        "Python's standard library without its test suites (about 12 MB)",
    )
    prep.add_argument(
        "--val-input",
        nargs="+",
        metavar="PATH",
        help="the validation split, in the forms --input takes: these documents and no other "
        "are validation, and every --input document is train (a trained BPE learns from the "
        "--input documents only)",
    )
    prep.add_argument(
        "--text-field",
        "--jsonl-field",
        dest="text_field",
        default="text",
        metavar="NAME",
        help="the field of each JSONL record, or the column of a Parquet file, that holds the "
        "text (--jsonl-field is its former name) [default: text]",
    )
    cut = prep.add_mutually_exclusive_group()
    cut.add_argument(
        "--split-on",
        metavar="REGEX",
        help="cut each text file into documents at the matches of this Python regular "
        "expression, leaving out pieces that are only whitespace: '\\n\\n' gives "
        "paragraphs (JSONL and Parquet records are not cut)",
    )
    cut.add_argument(
        "--chunk-chars",
        type=positive,
        metavar="N",
        help="cut each text file into documents of N characters, the last shorter",
    )


def run(args: argparse.Namespace) -> int:
    """Prepare the shards; rank 0 prints their summary."""
    from hpcllm.datasets.prepare import PrepareOptions, prepare

    manifest = prepare(
        PrepareOptions(
            out=args.out,
            inputs=tuple(args.input or ()),
            val_inputs=tuple(args.val_input or ()),
            corpus=args.corpus,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            val_fraction=args.val_fraction,
            shards=args.shards,
            val_shards=args.val_shards,
            text_field=args.text_field,
            split_on=args.split_on,
            chunk_chars=args.chunk_chars,
        ),
        progress=not args.quiet,
    )
    from hpcllm.launcher import detect_launcher

    if not args.quiet and detect_launcher().rank == 0:
        from hpcllm.datasets.inspection import render_summary, summary
        from hpcllm.datasets.shards import load_manifest

        print(render_summary(summary(load_manifest(args.out))), flush=True)
    return 0 if manifest else 1
