"""Bench progress: which case of how many, on stderr; a bar on a terminal, else a line per case."""

import io
import re

import pytest
from family_runs import cli
from mpirun import python, run_mpi

from hpcllm.observe import CaseProgress

LINE = re.compile(
    r"^(?P<what>.+): case (?P<i>\d+)/(?P<n>\d+) (?P<label>.+) \.\.\. done in [\d.]+ s"
)


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


def _progress_lines(stderr: str, what: str) -> list[re.Match]:
    return [m for line in stderr.splitlines() if (m := LINE.match(line)) and m["what"] == what]


def test_without_a_terminal_each_case_is_one_line_naming_its_number_and_label():
    stream = io.StringIO()
    labels = ["ddp d=2 fp32", "horovod d=2 fp32", "ps d=2 fp32"]
    with CaseProgress(len(labels), "hpcllm bench dp", stream=stream) as progress:
        for i, label in enumerate(labels):
            progress.start(label)
            progress.done(f"{i} tokens/s" if i else "")
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == len(labels)
    for i, (line, label) in enumerate(zip(lines, labels, strict=True), start=1):
        match = LINE.match(line)
        assert match, line
        assert (match["what"], match["i"], match["n"], match["label"]) == (
            "hpcllm bench dp",
            str(i),
            "3",
            label,
        )
    assert lines[0].endswith(" s") and lines[1].endswith(", 1 tokens/s")


def test_a_rank_that_does_not_show_prints_nothing():
    stream = Terminal()
    with CaseProgress(2, "hpcllm bench data", show=False, stream=stream) as progress:
        for label in ("a", "b"):
            progress.start(label)
            progress.done()
    assert stream.getvalue() == ""


def test_on_a_terminal_a_bar_counts_the_cases_and_ends_done():
    stream = Terminal()
    with CaseProgress(2, "hpcllm bench step", stream=stream) as progress:
        progress.start("gpt2-124m")
        assert "case 1/2 gpt2-124m" in stream.getvalue()
        progress.done("1.01x plain eager")
        progress.start("gpt2-1.3b")
        assert "case 2/2 gpt2-1.3b" in stream.getvalue()
        progress.done()
    text = stream.getvalue()
    assert "\r" in text and "elapsed" in text  # tqdm redraws one line in place
    assert text.rstrip().split("\r")[-1].startswith("hpcllm bench step: 2/2 cases done")
    assert "... done in" not in text  # the lines are for logs, not terminals


def test_done_without_start_is_a_mistake():
    with CaseProgress(1, "x", stream=io.StringIO()) as progress, pytest.raises(RuntimeError):
        progress.done()


@pytest.mark.slow
def test_bench_data_prints_one_progress_line_per_cache_size(stdlib):
    run = cli(
        "bench",
        "data",
        str(stdlib),
        "--seq-len",
        "32",
        "--micro-batch-size",
        "2",
        "--steps",
        "5",
        "--warmup",
        "1",
    )
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stderr
    lines = _progress_lines(run.stderr, "hpcllm bench data")
    assert [(m["i"], m["n"], m["label"]) for m in lines] == [
        ("1", "2", "chunk cache 64 MiB"),
        ("2", "2", "chunk cache 1 MiB"),
    ]
    # The table on stdout is untouched by progress.
    assert run.stdout.splitlines()[0].startswith("reader: seq len 32, micro-batch 2")
    assert "case" not in run.stdout


@pytest.mark.slow
def test_bench_kernels_smoke_prints_one_progress_line_per_op():
    # As a user types it: every option after `bench kernels` reaches the kernels' parser.
    run = cli("bench", "kernels", "--cpu-smoke", "--no-training", "--iters", "1", timeout=300)
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stderr
    lines = _progress_lines(run.stderr, "hpcllm bench kernels")
    assert [(m["i"], m["n"], m["label"]) for m in lines] == [
        (str(i), "7", f"tiny {op}")
        for i, op in enumerate(
            [
                "bias_gelu",
                "bias_dropout_add",
                "layer_norm",
                "cross_entropy",
                "rms_norm",
                "swiglu",
                "rotary",
            ],
            start=1,
        )
    ]
    assert "| cross_entropy | fwd+bwd |" in run.stdout


@pytest.mark.mpi
def test_bench_pipeline_reports_progress_from_rank_0_only():
    result = run_mpi(
        2,
        python(
            "-m",
            "hpcllm",
            "bench",
            "pipeline",
            "--schedules",
            "gpipe",
            "1f1b",
            "--microbatches",
            "2",
            "4",
            "--forward-ms",
            "1",
            "--steps",
            "1",
            "--warmup",
            "0",
        ),
        timeout=120,
    ).check()
    everything = result.stderr + "".join(result.rank_stderr.values())
    assert "\r" not in everything
    lines = _progress_lines(result.rank_stderr.get(0, ""), "hpcllm bench pipeline")
    assert [(m["i"], m["n"], m["label"]) for m in lines] == [
        ("1", "4", "gpipe m=2"),
        ("2", "4", "gpipe m=4"),
        ("3", "4", "1f1b m=2"),
        ("4", "4", "1f1b m=4"),
    ]
    assert not _progress_lines(result.rank_stderr.get(1, ""), "hpcllm bench pipeline")
    assert "| 1f1b | 2 | 4 | 1 |" in result.rank_stdout[0]
