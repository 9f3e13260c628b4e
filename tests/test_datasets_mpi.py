import io
import json
import os

import pytest
from datasets_fixtures import make_corpus, split_docs
from mpirun import python, run_mpi

from hpcllm.datasets import inspection
from hpcllm.datasets.shards import load_manifest
from hpcllm.folder_lock import LOCK, Wording, take

pytestmark = pytest.mark.mpi


def _dump(out, split):
    buf = io.BytesIO()
    inspection.dump(load_manifest(out), split, buf)
    return buf.getvalue().decode()


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_prepare_on_three_ranks_equals_one(tmp_path, tokenizer):
    inputs, docs = make_corpus(tmp_path / "src")
    args = [
        "-m",
        "hpcllm",
        "prepare",
        "--input",
        *inputs,
        "--tokenizer",
        tokenizer,
        "--val-fraction",
        "0.2",
        "--quiet",
    ]
    if tokenizer == "bpe":
        args += ["--vocab-size", "300"]
    run_mpi(3, python(*args, "--out", str(tmp_path / "three")), timeout=120).check()
    run_mpi(1, python(*args, "--out", str(tmp_path / "one"), "--shards", "3"), timeout=120).check()
    three = json.loads((tmp_path / "three" / "manifest.json").read_text())
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert three["prepare"]["ranks"] == 3 and len(three["splits"]["train"]) == 3
    assert three["splits"] == one["splits"]  # same documents in the same shards
    assert three["tokenizer"]["sha256"] == one["tokenizer"]["sha256"]
    expected = split_docs(docs, 0.2)
    for split in ("train", "val"):
        assert _dump(tmp_path / "three", split) == "".join(
            d + "\n<|endoftext|>\n" for d in expected[split]
        )


def test_prepare_user_error_is_one_line_on_every_rank(tmp_path):
    result = run_mpi(
        3,
        python(
            "-m",
            "hpcllm",
            "prepare",
            "--input",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "out"),
        ),
        timeout=60,
    )
    assert result.returncode == 2
    lines = [line for text in result.rank_stderr.values() for line in text.splitlines()]
    assert lines == [
        f"hpcllm: error: input {tmp_path / 'nope'} does not exist (no file, folder or glob match)"
    ]


def test_bad_vocab_size_on_three_ranks_is_exit_2_not_a_hang(tmp_path):
    inputs, _ = make_corpus(tmp_path / "src")
    result = run_mpi(
        3,
        python(
            "-m",
            "hpcllm",
            "prepare",
            "--input",
            *inputs,
            "--vocab-size",
            "100",
            "--out",
            str(tmp_path / "out"),
        ),
        timeout=60,
    )
    assert result.returncode == 2
    lines = [line for text in result.rank_stderr.values() for line in text.splitlines()]
    assert lines == ["hpcllm: error: --vocab-size must be at least 257 (256 bytes + EOS), got 100"]


def test_error_in_one_ranks_part_aborts_the_job_with_its_name(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(f"document {i}")
    # Document i goes to shard i mod 3, which rank i mod 3 writes: only rank 1 reads 4.txt,
    # while ranks 0 and 2 finish their part and wait for it.
    (src / "4.txt").write_bytes(b"\xff\xfe not utf-8")
    result = run_mpi(
        3,
        python(
            "-m",
            "hpcllm",
            "prepare",
            "--input",
            str(src),
            "--tokenizer",
            "byte",
            "--val-fraction",
            "0",
            "--out",
            str(tmp_path / "out"),
        ),
        timeout=60,
    )
    assert result.returncode != 0
    assert f"hpcllm: error (rank 1): {src / '4.txt'} is not UTF-8" in "".join(
        result.rank_stderr.values()
    )
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_prepare_on_a_locked_out_is_refused_on_every_rank_not_a_hang(tmp_path):
    inputs, _ = make_corpus(tmp_path / "src")
    out = tmp_path / "out"
    # This test process plays a prepare that holds --out.
    held = take(out, print, Wording(writer="prepare", folder="data folder", instead="wait"))
    try:
        result = run_mpi(
            2,
            python(
                "-m",
                "hpcllm",
                "prepare",
                "--input",
                *inputs,
                "--tokenizer",
                "byte",
                "--out",
                str(out),
                "--quiet",
            ),
            timeout=120,
        )
        # Nothing written: in --out but the holder's lock, nor beside it.
        assert [p.name for p in out.iterdir()] == [LOCK]
        assert not list(tmp_path.glob(".out.partial-*"))
    finally:
        held.release()
    assert result.returncode == 2
    lines = [line for text in result.rank_stderr.values() for line in text.splitlines()]
    assert len(lines) == 1 and lines[0].startswith(
        f"hpcllm: error: {out} is in use by another prepare (pid {os.getpid()} on "
    ), lines
