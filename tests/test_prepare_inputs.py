"""``hpcllm prepare``'s inputs: a validation split of its own (--val-input), text files cut
into documents (--split-on, --chunk-chars) and Parquet files (--text-field)."""

import io
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets_fixtures import full_stream, split_docs

from hpcllm.cli import build_parser
from hpcllm.datasets import inspection
from hpcllm.datasets.corpus import find_sources
from hpcllm.datasets.prepare import PrepareOptions, _documents, _shard_plan, prepare
from hpcllm.datasets.shards import load_manifest
from hpcllm.errors import UserError

TRAIN = ["first training text\n", "second: ü ß 漢字\n", "third " * 40]
VAL = ["held-out one\n", "held-out two: zyxwvut zyxwvut\n"]
JSONL_VAL = ["a val record", "another val record"]


def _texts(out: Path, split: str) -> list[str]:
    """Return the documents of ``split`` decoded, in corpus order."""
    buf = io.BytesIO()
    inspection.dump(load_manifest(out), split, buf)
    return buf.getvalue().decode("utf-8").split(inspection.DUMP_SEPARATOR)[:-1]


def _write(folder: Path, texts: list[str]) -> Path:
    folder.mkdir(parents=True)
    for i, text in enumerate(texts):
        (folder / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    return folder


def _corpus(root: Path) -> tuple[Path, list[str]]:
    """Write TRAIN as a folder and VAL as a folder plus a JSONL file; return (root, val
    inputs as arguments)."""
    _write(root / "train", TRAIN)
    _write(root / "val", VAL)
    with open(root / "val.jsonl", "w", encoding="utf-8") as f:
        for text in JSONL_VAL:
            f.write(json.dumps({"text": text}) + "\n")
    return root, [str(root / "val"), str(root / "val.jsonl")]


def _cli(*words: str) -> int:
    """Run ``hpcllm WORDS`` in this process; a refusal is raised as the UserError."""
    args = build_parser().parse_args(list(words))
    return args.run(args)


def test_val_input_is_the_validation_split_and_shards_are_byte_identical(tmp_path):
    root, val_inputs = _corpus(tmp_path / "src")
    folders = [tmp_path / "one", tmp_path / "two"]
    for out in folders:
        _cli(
            "prepare",
            "--input",
            str(root / "train"),
            "--val-input",
            *val_inputs,
            "--tokenizer",
            "byte",
            "--shards",
            "2",
            "--val-shards",
            "2",
            "--out",
            str(out),
            "--quiet",
        )
    assert _texts(folders[0], "train") == TRAIN
    assert _texts(folders[0], "val") == VAL + JSONL_VAL
    raw = json.loads((folders[0] / "manifest.json").read_text())
    assert raw["val_fraction"] is None
    assert raw["sources"]["val_inputs"] == val_inputs
    assert raw["n_documents"] == {"train": 3, "val": 4}
    # Ids: training documents first, then validation ones, each split counted on its own.
    doc_ids = [
        i
        for split in ("train", "val")
        for i, _ in inspection._documents(load_manifest(folders[0]), split)
    ]
    assert doc_ids == list(range(7))
    info = inspection.summary(load_manifest(folders[0]))
    assert info["splits"]["val"]["documents"] == 4 and info["splits"]["val"]["shards"] == 2
    files = sorted(p.name for p in folders[0].iterdir() if p.suffix in (".h5", ".json"))
    assert "val-00001.h5" in files and "tokenizer.json" in files
    for name in files:
        if name != "manifest.json":  # it holds the prepare's timings
            assert (folders[0] / name).read_bytes() == (folders[1] / name).read_bytes(), name


def test_trained_bpe_learns_from_the_training_input_only(tmp_path):
    root, val_inputs = _corpus(tmp_path / "src")
    common = dict(inputs=(str(root / "train"),), tokenizer="bpe", vocab_size=300)
    with_val = prepare(
        PrepareOptions(out=tmp_path / "with", val_inputs=tuple(val_inputs), **common),
        progress=False,
    )
    alone = prepare(PrepareOptions(out=tmp_path / "alone", val_fraction=0.0, **common), False)
    assert with_val["tokenizer"]["sha256"] == alone["tokenizer"]["sha256"]
    assert (tmp_path / "with" / "tokenizer.json").read_bytes() == (
        tmp_path / "alone" / "tokenizer.json"
    ).read_bytes()
    # And the tokenizer never met the word only validation holds.
    vocab = json.loads((tmp_path / "with" / "tokenizer.json").read_text())["model"]["vocab"]
    assert not any("zyx" in token for token in vocab)
    assert _texts(tmp_path / "with", "val") == VAL + JSONL_VAL


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(val_fraction=0.1), "give --val-input or --val-fraction, not both"),
        (dict(val_fraction=0.0), "give --val-input or --val-fraction, not both"),
        (dict(both=True), "train/00.txt is both a training input and a validation input"),
        (dict(empty=True), "the validation input"),
    ],
    ids=["fraction", "zero-fraction", "file-in-both", "empty-val"],
)
def test_val_input_refusals(tmp_path, options, words):
    root, val_inputs = _corpus(tmp_path / "src")
    if options.pop("both", False):
        val_inputs = [str(root / "train" / "00.txt")]  # inside the --input folder
    if options.pop("empty", False):
        (root / "blank.txt").write_text("")
        val_inputs = [str(root / "blank.txt")]
    with pytest.raises(UserError, match=re.escape(words)):
        prepare(
            PrepareOptions(
                out=tmp_path / "out",
                inputs=(str(root / "train"),),
                val_inputs=tuple(val_inputs),
                tokenizer="byte",
                **options,
            ),
            progress=False,
        )
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_val_fraction_on_the_command_line_is_refused_with_val_input(tmp_path):
    root, val_inputs = _corpus(tmp_path / "src")
    words = ["prepare", "--input", str(root / "train"), "--val-input", *val_inputs]
    with pytest.raises(UserError, match="give --val-input or --val-fraction, not both"):
        _cli(*words, "--val-fraction", "0.01", "--out", str(tmp_path / "out"), "--quiet")


def test_split_on_as_a_shell_passes_it_gives_paragraphs(tmp_path):
    (tmp_path / "book.txt").write_text("Para one,\nline two.\n\nPara two.\n\n\n   \n\nPara three.")
    out = tmp_path / "out"
    # The shell passes the four characters \ n \ n; the regular expression reads newlines.
    words = ["--split-on", r"\n\n", "--tokenizer", "byte", "--val-fraction", "0"]
    _cli("prepare", "--input", str(tmp_path / "book.txt"), *words, "--out", str(out), "--quiet")
    assert _texts(out, "train") == ["Para one,\nline two.", "Para two.", "Para three."]
    assert json.loads((out / "manifest.json").read_text())["sources"]["split_on"] == r"\n\n"


def test_chunk_chars_cuts_by_characters_and_applies_to_val_input(tmp_path):
    (tmp_path / "train.txt").write_text("abcdefghij")
    (tmp_path / "val.txt").write_text("üüüüü")  # characters, not bytes
    (tmp_path / "val.jsonl").write_text('{"text": "records are not cut"}\n')
    prepare(
        PrepareOptions(
            out=tmp_path / "out",
            inputs=(str(tmp_path / "train.txt"),),
            val_inputs=(str(tmp_path / "val.txt"), str(tmp_path / "val.jsonl")),
            tokenizer="byte",
            chunk_chars=4,
        ),
        progress=False,
    )
    assert _texts(tmp_path / "out", "train") == ["abcd", "efgh", "ij"]
    assert _texts(tmp_path / "out", "val") == ["üüüü", "ü", "records are not cut"]


def test_cut_documents_are_numbered_for_the_val_fraction(tmp_path):
    paragraphs = [f"paragraph {i}" for i in range(20)]
    (tmp_path / "a.txt").write_text("\n\n".join(paragraphs[:13]))
    (tmp_path / "b.txt").write_text("\n\n".join(paragraphs[13:]))
    inputs = (str(tmp_path / "a.txt"), str(tmp_path / "b.txt"))
    options = PrepareOptions(
        out=tmp_path / "out", inputs=inputs, tokenizer="byte", val_fraction=0.2, split_on="\n\n"
    )
    prepare(options, progress=False)
    expected = split_docs(paragraphs, 0.2)
    assert len(expected["val"]) == 4
    for split in ("train", "val"):
        assert _texts(tmp_path / "out", split) == expected[split]


@pytest.mark.parametrize(
    "pattern, words",
    [
        ("(", "--split-on '(' is not a regular expression"),
        (r"\n*", r"--split-on '\n*' matches the empty string"),
        ("^", "matches the empty string"),
    ],
)
def test_bad_split_on_is_refused(tmp_path, pattern, words):
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(UserError, match=re.escape(words)):
        prepare(
            PrepareOptions(
                out=tmp_path / "out", inputs=(str(tmp_path / "a.txt"),), split_on=pattern
            ),
            progress=False,
        )


def test_split_on_and_chunk_chars_are_one_or_the_other(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(UserError, match="not allowed with argument --split-on"):
        _cli(
            "prepare",
            "--input",
            str(tmp_path / "a.txt"),
            "--split-on",
            "x",
            "--chunk-chars",
            "3",
            "--out",
            str(tmp_path / "out"),
        )
    with pytest.raises(UserError, match="give --split-on or --chunk-chars, not both"):
        PrepareOptions(out=tmp_path, inputs=("a",), split_on="x", chunk_chars=3).check()


def _parquet_and_jsonl(root: Path, n: int = 50) -> tuple[Path, Path, list[str]]:
    """Write the same rows as a Parquet file (row groups of 16) and a JSONL file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    texts = [f"row {i}: " + "ü words " * (i % 5) for i in range(n)]
    table = pa.table({"id": list(range(n)), "content": texts})
    pq.write_table(table, root / "rows.parquet", row_group_size=16)
    with open(root / "rows.jsonl", "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "content": text}) + "\n")
    return root / "rows.parquet", root / "rows.jsonl", texts


def test_parquet_rows_give_the_shards_jsonl_lines_do(tmp_path):
    parquet, jsonl, texts = _parquet_and_jsonl(tmp_path / "src")
    made = {}
    for name, path, flag in (("pq", parquet, "--text-field"), ("js", jsonl, "--jsonl-field")):
        out = tmp_path / name
        _cli(
            "prepare",
            "--input",
            str(path),
            flag,
            "content",
            "--tokenizer",
            "byte",
            "--val-fraction",
            "0.2",
            "--shards",
            "3",
            "--out",
            str(out),
            "--quiet",
        )
        made[name] = json.loads((out / "manifest.json").read_text())
    assert made["pq"]["n_documents"] == made["js"]["n_documents"] == {"train": 40, "val": 10}
    for split in ("train", "val"):
        assert (full_stream(tmp_path / "pq", split) == full_stream(tmp_path / "js", split)).all()
    assert _texts(tmp_path / "pq", "train") == split_docs(texts, 0.2)["train"]


def test_parquet_in_a_folder_is_found_and_can_be_the_val_input(tmp_path):
    parquet, _, texts = _parquet_and_jsonl(tmp_path / "src" / "nested", n=20)
    (tmp_path / "train.txt").write_text("training text")
    prepare(
        PrepareOptions(
            out=tmp_path / "out",
            inputs=(str(tmp_path / "train.txt"),),
            val_inputs=(str(tmp_path / "src"),),
            tokenizer="byte",
            text_field="content",
        ),
        progress=False,
    )
    assert _texts(tmp_path / "out", "val") == texts + texts  # rows.jsonl, then rows.parquet


@pytest.mark.parametrize(
    "table, words",
    [
        (
            dict(body=["a"]),
            "has no column 'text' (choose it with --text-field); its columns: body (string)",
        ),
        (dict(text=[1, 2]), "column 'text' holds int64, not text"),
        (dict(text=["a", "b", None]), "row 2 (counting from 0) has no text: column 'text' is null"),
    ],
    ids=["missing-column", "not-strings", "null"],
)
def test_bad_parquet_is_refused_naming_the_file(tmp_path, table, words):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(table), tmp_path / "bad.parquet")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'bad.parquet'}")) as refused:
        prepare(
            PrepareOptions(
                out=tmp_path / "out", inputs=(str(tmp_path / "bad.parquet"),), tokenizer="byte"
            ),
            progress=False,
        )
    assert words in str(refused.value)


def test_a_dictionary_encoded_text_column_reads_as_its_strings(tmp_path):
    """pandas writes a categorical column dictionary-encoded: its rows are still text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = ["first row", "second", "first row", "third ü"]
    column = pa.array(rows).dictionary_encode()
    pq.write_table(pa.table({"text": column}), tmp_path / "cat.parquet")
    prepare(
        PrepareOptions(
            out=tmp_path / "out",
            inputs=(str(tmp_path / "cat.parquet"),),
            tokenizer="byte",
            val_fraction=0.0,
        ),
        progress=False,
    )
    assert _texts(tmp_path / "out", "train") == rows


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    parquet, _, _ = _parquet_and_jsonl(tmp_path)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now fails
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match=re.escape("pip install 'hpcllm[parquet]'")):
        find_sources([str(tmp_path)])


def test_every_document_goes_to_exactly_one_rank(tmp_path):
    """What each of three ranks reads (with a cut, Parquet and a val input) is a partition of
    what one rank reads, each document with the same id, split and index."""
    parquet, _, _ = _parquet_and_jsonl(tmp_path / "pq", n=40)
    (tmp_path / "a.txt").write_text("\n\n".join(f"paragraph {i}" for i in range(11)))
    _write(tmp_path / "val", VAL)
    opts = PrepareOptions(
        out=tmp_path / "out",
        inputs=(str(tmp_path / "a.txt"), str(parquet)),
        val_inputs=(str(tmp_path / "val"),),
        text_field="content",
        split_on="\n\n",
        shards=4,
        val_shards=2,
    )
    sources = find_sources(list(opts.inputs), None, list(opts.val_inputs))
    everything = list(_documents(opts, sources, lambda split, index: True))
    assert [(d.split, d.index) for d in everything] == [
        *(("train", i) for i in range(51)),
        *(("val", i) for i in range(2)),
    ]
    assert [d.doc_id for d in everything] == list(range(53))
    parts = [
        list(_documents(opts, sources, _shard_plan(opts, SimpleNamespace(size=3, rank=r))[1]))
        for r in range(3)
    ]
    assert all(parts)
    assert sorted(d for part in parts for d in part) == everything
