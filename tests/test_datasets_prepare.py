import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from datasets_fixtures import make_corpus, prepare_corpus, split_docs
from family_runs import cli

from hpcllm.datasets import inspection
from hpcllm.datasets.prepare import PrepareOptions, prepare, split_of
from hpcllm.datasets.reader import MicroBatchReader
from hpcllm.datasets.shards import load_manifest
from hpcllm.errors import UserError
from hpcllm.folder_lock import LOCK

REPO = Path(__file__).resolve().parent.parent


def _dump(out: Path, split: str) -> bytes:
    buf = io.BytesIO()
    inspection.dump(load_manifest(out), split, buf)
    return buf.getvalue()


def _joined(docs):
    return "".join(d + "\n<|endoftext|>\n" for d in docs).encode("utf-8")


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_round_trip_multi_file_corpus(tmp_path, tokenizer):
    vocab = {"vocab_size": 300} if tokenizer == "bpe" else {}
    manifest, docs = prepare_corpus(
        tmp_path / "src",
        tmp_path / "out",
        tokenizer=tokenizer,
        val_fraction=0.25,
        shards=3,
        **vocab,
    )
    expected = split_docs(docs, 0.25)
    assert len(expected["val"]) == 3 and len(expected["train"]) == 9
    for split in ("train", "val"):
        assert _dump(tmp_path / "out", split) == _joined(expected[split])
        assert manifest["n_documents"][split] == len(expected[split])
    assert manifest["tokenizer"]["kind"] == tokenizer
    assert manifest["text_bytes"] == sum(len(d.encode()) for d in docs)
    assert len(manifest["splits"]["train"]) == 3
    # EOS only ends documents: the literal "<|endoftext|>" in one of them stayed text.
    eos = manifest["tokenizer"]["eos_id"]
    for entry in manifest["splits"]["train"]:
        with h5py.File(tmp_path / "out" / entry["file"]) as f:
            tokens, offsets = f["tokens"][:], f["doc_offsets"][:]
        assert (tokens == eos).sum() == len(offsets) - 1


def test_token_dtype_and_shard_attributes(tmp_path):
    manifest, _ = prepare_corpus(
        tmp_path / "src", tmp_path / "out", tokenizer="byte", val_fraction=0.0
    )
    with h5py.File(tmp_path / "out" / manifest["splits"]["train"][0]["file"]) as f:
        assert f["tokens"].dtype == np.uint16
        assert f["tokens"].fletcher32 and f["tokens"].chunks
        assert f.attrs["format_version"] == 1 and f.attrs["vocab_size"] == 257
        assert f.attrs["eos_id"] == 256
        assert f.attrs["tokenizer_sha256"] == manifest["tokenizer"]["sha256"]
        assert json.loads(f.attrs["sources"])[0].endswith("a/doc01.txt")  # sorted first
        offsets = f["doc_offsets"][:]
        assert (f["tokens"][offsets[1:] - 1] == 256).all()


def test_given_tokenizer_json_is_used_and_recorded(tmp_path):
    first, docs = prepare_corpus(
        tmp_path / "src", tmp_path / "one", vocab_size=320, val_fraction=0.0
    )
    second = prepare(
        PrepareOptions(
            out=tmp_path / "two",
            inputs=(str(tmp_path / "src" / "a"),),
            tokenizer=str(tmp_path / "one" / "tokenizer.json"),
            val_fraction=0.0,
        ),
        progress=False,
    )
    assert second["tokenizer"]["sha256"] == first["tokenizer"]["sha256"]
    assert second["tokenizer"]["kind"] == "file"
    assert _dump(tmp_path / "two", "train") == _joined(docs[: len(docs) - 3])


def test_val_split_is_by_document_and_exact():
    assigned = [split_of(i, 0.1)[0] for i in range(100)]
    assert assigned.count("val") == 10
    assert all(split_of(i, 0.0) == ("train", i) for i in range(20))


def test_json_field_is_configurable(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"body": "hello"}\n{"body": "world"}\n')
    prepare(
        PrepareOptions(
            out=tmp_path / "out",
            inputs=(str(tmp_path / "c.jsonl"),),
            tokenizer="byte",
            val_fraction=0.0,
            text_field="body",
        ),
        progress=False,
    )
    assert _dump(tmp_path / "out", "train") == _joined(["hello", "world"])
    with pytest.raises(UserError, match="no string field 'text'"):
        prepare(
            PrepareOptions(
                out=tmp_path / "o2", inputs=(str(tmp_path / "c.jsonl"),), tokenizer="byte"
            ),
            progress=False,
        )


def test_builtin_corpus_has_no_test_suites():
    from hpcllm.datasets.corpus import python_stdlib_sources

    sources = python_stdlib_sources()
    assert len(sources) > 300
    assert not any("/test/" in str(s.path) or s.path.name.startswith("test_") for s in sources)
    assert sum(s.path.stat().st_size for s in sources) > 5e6


def test_non_utf8_jsonl_line_is_a_user_error(tmp_path):
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(UserError, match="c.jsonl:2: not UTF-8"):
        prepare(
            PrepareOptions(
                out=tmp_path / "out", inputs=(str(tmp_path / "c.jsonl"),), tokenizer="byte"
            ),
            progress=False,
        )


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(tokenizer="bpe", vocab_size=100), "--vocab-size must be at least 257"),
        (dict(tokenizer="byte", vocab_size=1000), "--vocab-size applies to --tokenizer bpe only"),
        (dict(tokenizer="byte", val_fraction=1.0), "--val-fraction must be in"),
    ],
)
def test_bad_options_are_user_errors(tmp_path, options, words):
    with pytest.raises(UserError, match=re.escape(words)):
        prepare(
            PrepareOptions(out=tmp_path / "out", inputs=(str(tmp_path),), **options), progress=False
        )


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: [str(p / "missing.txt")], "does not exist"),
        (lambda p: (p / "empty.txt").write_text("") and [] or [str(p / "empty.txt")], "is empty"),
        (
            lambda p: (p / "bad.txt").write_bytes(b"ok \xff\xfe") and [] or [str(p / "bad.txt")],
            "is not UTF-8",
        ),
    ],
)
def test_bad_corpus_is_a_user_error(tmp_path, make, words):
    with pytest.raises(UserError, match=words):
        prepare(
            PrepareOptions(out=tmp_path / "out", inputs=tuple(make(tmp_path)), tokenizer="byte"),
            progress=False,
        )


def _flip_byte_in_tokens(shard: Path) -> None:
    with h5py.File(shard, "r") as f:
        info = f["tokens"].id.get_chunk_info(0)
    with open(shard, "r+b") as f:
        f.seek(info.byte_offset + info.size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.slow
def test_flipped_byte_is_reported_with_the_file_name(tmp_path):
    manifest, _ = prepare_corpus(
        tmp_path / "src", tmp_path / "out", tokenizer="byte", val_fraction=0.0, shards=2
    )
    shard = tmp_path / "out" / manifest["splits"]["train"][1]["file"]
    _flip_byte_in_tokens(shard)
    with pytest.raises(UserError, match=f"shard {shard} is corrupt: tokens.* checksum"):
        inspection.verify(load_manifest(tmp_path / "out"))
    run = cli("inspect", str(tmp_path / "out"), "--verify", timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [run.stderr.strip()]
    assert str(shard) in run.stderr and "corrupt" in run.stderr
    # The reader meets the bad chunk too, and says the same, through its prefetch thread.
    reader = MicroBatchReader(tmp_path / "out", seq_len=16, micro_batch_size=4)
    batches = iter(reader)
    with pytest.raises(UserError, match=f"shard {shard} is corrupt"):
        for _ in range(reader.steps_per_epoch):
            next(batches)


def test_manifest_that_does_not_match_is_refused(tmp_path):
    manifest, _ = prepare_corpus(
        tmp_path / "src", tmp_path / "out", tokenizer="byte", val_fraction=0.0, shards=2
    )
    out = tmp_path / "out"
    raw = json.loads((out / "manifest.json").read_text())
    raw["splits"]["train"][0]["n_tokens"] += 1
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(UserError, match="train-00000.h5 does not match .*manifest says"):
        inspection.verify(load_manifest(out))
    with pytest.raises(UserError, match="does not match"):
        list(inspection._documents(load_manifest(out), "train"))
    raw["splits"]["train"][0]["n_tokens"] -= 1
    (out / "manifest.json").write_text(json.dumps(raw))
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text() + " ")
    with pytest.raises(UserError, match="tokenizer.json does not match"):
        load_manifest(out)


def test_missing_shard_and_missing_manifest(tmp_path):
    manifest, _ = prepare_corpus(
        tmp_path / "src", tmp_path / "out", tokenizer="byte", val_fraction=0.0, shards=2
    )
    (tmp_path / "out" / manifest["splits"]["train"][1]["file"]).unlink()
    with pytest.raises(UserError, match="train-00001.h5 named by .* is missing"):
        load_manifest(tmp_path / "out")
    with pytest.raises(UserError, match="has no manifest.json"):
        load_manifest(tmp_path / "src")
    with pytest.raises(UserError, match="does not exist"):
        load_manifest(tmp_path / "nowhere")


def test_sequence_longer_than_data(tmp_path):
    prepare_corpus(tmp_path / "src", tmp_path / "out", tokenizer="byte", val_fraction=0.0)
    with pytest.raises(UserError, match="sequence length 100000 is longer than the train"):
        MicroBatchReader(tmp_path / "out", seq_len=100000, micro_batch_size=1)


def _prepare_args(out, *options: str) -> list[str]:
    return ["prepare", "--out", str(out), "--quiet", *options]


@pytest.mark.slow
def test_killed_prepare_leaves_the_earlier_dataset_and_the_next_removes_its_stage(tmp_path):
    out = tmp_path / "out"
    prepare_corpus(tmp_path / "src", out, tokenizer="byte", val_fraction=0.0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = _prepare_args(out, "--corpus", "python-stdlib", "--tokenizer", "byte", "--shards", "4")
    proc = subprocess.Popen([sys.executable, "-m", "hpcllm", *args], cwd=REPO)
    deadline = time.monotonic() + 60
    # Killed while it writes a shard into its staging folder beside out.
    while not list(tmp_path.glob(".out.partial-*/.*.partial-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, "prepare finished before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stages = list(tmp_path.glob(".out.partial-*"))
    assert len(stages) == 1
    # Untouched, but for the lock file the killed prepare held, which no process holds now.
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != LOCK} == before
    assert json.loads((out / LOCK).read_text())["pid"] == proc.pid
    MicroBatchReader(out, seq_len=8, micro_batch_size=1)  # and readable
    again = cli(*_prepare_args(out, "--input", str(tmp_path / "src"), "--tokenizer", "byte"))
    assert again.returncode == 0, again.stderr
    assert f"removed {stages[0]}, left by process" in again.stderr
    assert f"taking over the lock of {out} from pid {proc.pid} on " in again.stderr
    assert not list(tmp_path.glob(".out.partial-*")) and not (out / LOCK).exists()


@pytest.mark.parametrize(
    "options, message",
    [
        (["src/a", "--tokenizer", "missing.json"], "missing.json"),  # before anything is written
        (["empty.txt", "--tokenizer", "byte"], "is empty: no document has any text"),  # after
    ],
    ids=["missing-tokenizer", "refused-after-the-shards"],
)
def test_a_refused_prepare_leaves_the_dataset_already_there(tmp_path, options, message):
    out = tmp_path / "out"
    prepare_corpus(tmp_path / "src", out, tokenizer="byte", val_fraction=0.0)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "empty.txt").write_text("")
    got = cli(*_prepare_args(out, "--input", str(tmp_path / options[0]), *options[1:]))
    assert got.returncode == 2 and message in got.stderr, got.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not list(tmp_path.glob(".*.partial-*"))


def test_prepare_cli_help_explains_every_option():
    run = cli("prepare", "--help", timeout=60)
    for option in (
        "--input",
        "--corpus",
        "--out",
        "--tokenizer",
        "--vocab-size",
        "--val-fraction",
        "--shards",
        "--val-shards",
        "--text-field",
        "--jsonl-field",
        "--val-input",
        "--split-on",
        "--chunk-chars",
        "--quiet",
    ):
        assert option in run.stdout
    assert "python-stdlib" in run.stdout


@pytest.mark.slow
def test_inspect_cli_summary_and_dump(tmp_path):
    _, docs = prepare_corpus(tmp_path / "src", tmp_path / "out", tokenizer="byte", val_fraction=0.0)
    run = cli("inspect", str(tmp_path / "out"), "--json", timeout=60)
    info = json.loads(run.stdout)
    assert info["splits"]["train"]["documents"] == len(docs)
    assert info["tokenizer"]["vocab_size"] == 257
    run = subprocess.run(
        [sys.executable, "-m", "hpcllm", "inspect", str(tmp_path / "out"), "--dump", "train"],
        capture_output=True,
        timeout=60,
    )
    assert run.returncode == 0 and run.stdout == _joined(docs)


def test_make_corpus_lists_documents_in_prepare_order(tmp_path):
    inputs, docs = make_corpus(tmp_path)
    from hpcllm.datasets.corpus import find_sources, iter_documents

    every = iter_documents(find_sources(inputs), lambda i, s: "train", lambda s, i: True)
    assert [doc.text for doc in every] == docs
