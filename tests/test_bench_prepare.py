"""hpcllm bench prepare: a synthetic corpus; prepare's tokens/s per rank beside the reader's."""

import json
import os
from collections import Counter

import pytest
from family_runs import cli

from hpcllm.bench.prepare import SYNTHETIC_MARKER, synthetic_corpus


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.glob("part-*.txt"))}


def test_the_synthetic_corpus_is_the_same_bytes_every_time_and_about_the_size_asked(tmp_path):
    assert synthetic_corpus(tmp_path / "a", 0.0005, 4)
    assert synthetic_corpus(tmp_path / "b", 0.0005, 4)
    first, second = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert list(first) == [f"part-{i:05d}.txt" for i in range(4)]
    assert first == second
    sizes = [len(text) for text in first.values()]
    # Whole words up to each file's share: short of it by less than one word (16 bytes).
    assert all(125_000 - 16 < size <= 125_000 for size in sizes), sizes
    text = b"".join(first.values())
    assert set(text) <= set(b"abcdefghijklmnopqrstuvwxyz \n")
    words = text.split()
    assert 2 < len(text) / len(words) < 10  # word-like, not one long run of letters
    assert Counter(words).most_common(1)[0][1] > len(words) / 50  # a Zipf head
    assert synthetic_corpus(tmp_path / "c", 0.0005, 4, seed=1)
    assert _files(tmp_path / "c") != first


def test_the_synthetic_corpus_is_reused_with_the_same_arguments_and_written_again_otherwise(
    tmp_path,
):
    folder = tmp_path / "corpus"
    assert synthetic_corpus(folder, 0.0002, 4)
    stamps = {p: p.stat().st_mtime_ns for p in folder.glob("part-*.txt")}
    assert not synthetic_corpus(folder, 0.0002, 4)
    assert {p: p.stat().st_mtime_ns for p in folder.glob("part-*.txt")} == stamps
    # Fewer files: the ones past the new count go, the marker says the new arguments.
    assert synthetic_corpus(folder, 0.0002, 2)
    assert sorted(p.name for p in folder.glob("part-*.txt")) == ["part-00000.txt", "part-00001.txt"]
    assert json.loads((folder / SYNTHETIC_MARKER).read_text())["files"] == 2
    # A file cut short since (a full disk, a hand edit): written again, not reused.
    part = folder / "part-00000.txt"
    os.truncate(part, 10)
    assert synthetic_corpus(folder, 0.0002, 2)
    assert part.stat().st_size > 10


@pytest.mark.slow
def test_bench_prepare_on_a_synthetic_corpus_reports_tokens_per_rank_beside_the_reader(tmp_path):
    args = ["bench", "prepare", "--out", str(tmp_path), "--synthetic-gb", "0.0005", "--files"]
    args += ["4", "--ranks", "1", "--tokenizers", "byte"]
    done = cli(*args, "--json", check=True)
    report = json.loads(done.stdout)
    assert report["source"] == ["--input", str(tmp_path / "corpus")]
    assert report["synthetic"]["files"] == 4
    assert 499_900 < report["synthetic"]["bytes"] <= 500_000
    (row,) = report["prepare"]
    # Byte tokens: one a byte, and an EOS after each of the 4 documents.
    assert row["tokens"] == report["synthetic"]["bytes"] + 4
    assert row["tokens_per_s_per_rank"] > 0 and row["scaling"] == 1.0
    reader = report["reader"]
    assert reader["data"] == row["folder"] and reader["tokens_per_s"] > 0
    assert row["reader_ratio"] == pytest.approx(
        reader["tokens_per_s"] / row["tokens_per_s_per_rank"]
    )

    again = cli(*args, check=True)  # the table; the corpus is there already
    assert "synthetic corpus 0.0005 GB in 4 files ... done in" in again.stderr
    assert again.stderr.count("reused") == 1
    lines = again.stdout.splitlines()
    assert lines[0].startswith(f"prepare --input {tmp_path / 'corpus'} (synthetic: 4 files")
    assert lines[1].split()[-6:] == ["M", "tokens", "M", "tokens/s/rank", "reader", "ratio"]
    assert lines[2].split()[:2] == ["byte", "1"] and lines[2].endswith("x")
    assert lines[3].startswith(f"reader on {tmp_path / 'byte-1ranks'}: ")


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--corpus", "python-stdlib", "--synthetic-gb", "0.01"], "not allowed with argument"),
        (["--input", "docs", "--synthetic-gb", "0.01"], "not allowed with argument"),
        (["--files", "8"], "--files sizes the synthetic corpus"),
        (["--synthetic-gb", "0"], "a size in GB of at least 1e-6"),
    ],
)
def test_bench_prepare_takes_one_corpus_kind_in_one_line(tmp_path, extra, says):
    done = cli("bench", "prepare", "--out", str(tmp_path), *extra)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())
