"""The README's and docs/' shell examples: parsed, marked, and walked in a fresh copy.

The walk (the last test) runs every CPU example of README.md, then of docs/*.md by file name,
in order, in a fresh copy of the working tree, in the quick mode of tests/docs_examples.py.
The quick mode changes commands by the first matching rule of ``QUICK_RULES``, and only so:

- a command that trains (``hpcllm train``, ``jobs/mpirun.sh train``) gets ``TRAIN_QUICK``
  appended: ``--set train.steps=2 --set train.log_interval=1 --set train.eval_interval=0
  --set train.eval_iters=1`` (a validation and a checkpoint at the end, which the examples
  after it read); ``make demo`` gets the same as ``DEMO_ARGS``;
- a benchmark gets its smallest sizes appended (``bench dp``: d = 2, ddp, fp32, 2 steps;
  ``bench sync``: ddp, 2 steps; ``bench pipeline``: m = 4, 5 ms stages, 1 step; ``bench
  collectives``: 2 iterations, sizes up to 64K where a range is given; ``bench data``: 50
  micro-batches; ``bench step``: 1 step, 2 rounds); ``TP_SHAPE`` becomes the script's default;
- a command ``RESOLVE_ONLY`` matches is only resolved (``--print-config``: it checks its
  config and stops): a bf16 training, emulated at about 10 s a step on this CPU.

A command the walk has already run and passed, word for word, passes without a second run.

``make docs-examples`` runs every CPU example exactly as written instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_examples import (
    MARKS,
    QUICK_RULES,
    RESOLVE_ONLY,
    TRAIN_QUICK,
    Example,
    examples,
    fresh_copy,
    quick_command,
    same_command,
    walk,
)

REPO = Path(__file__).resolve().parent.parent

# What a line needs when it says one of these, and the marks that may stand for it.
NEEDS: list[tuple[str, set[str]]] = [
    (r"\b(sbatch|srun|salloc)\b|LAUNCHER=srun", {"slurm"}),
    (r"\bHOSTFILE=|\bNODES=", {"nodes", "slurm"}),
    (
        r"\bnsys\b|gpu-report|bench device|gpu\.yaml|-1gpu\.yaml|-3d\.yaml",
        {"gpu", "slurm", "nodes"},
    ),
    (r"--from-hf|Llama-3\.2|runs/llama1b", {"download"}),
    (r"--config C\b|\bROW_", set(MARKS)),
]


def _docs(tmp_path: Path, readme: str, **docs: str) -> Path:
    (tmp_path / "docs").mkdir(parents=True)
    (tmp_path / "README.md").write_text(readme)
    for name, text in docs.items():
        (tmp_path / "docs" / f"{name}.md").write_text(text)
    return tmp_path


def test_examples_come_in_document_order_with_continuations_comments_and_marks(tmp_path):
    root = _docs(
        tmp_path,
        "# R\n\n```bash\nmake demo   # the demo\n\n# a comment line\n"
        "NP=8 jobs/mpirun.sh train \\\n    --config x.yaml   # [gpu] 8 GPUs\n```\n"
        "```\nhpcllm output block\n```\n",
        b="```sh\nhpcllm generate --prompt 'a # b' [--step N]\n```\n",
        a="```console\n$ hpcllm topo --tp 2\nworld 2 = tp 2\n```\n```python\nimport hpcllm\n```\n",
    )
    found = examples(root)
    assert [(e.where, e.command, e.mark) for e in found] == [
        ("README.md:4", "make demo", None),
        ("README.md:7", "NP=8 jobs/mpirun.sh train --config x.yaml", "gpu"),
        ("docs/a.md:2", "hpcllm topo --tp 2", None),
        ("docs/b.md:2", "hpcllm generate --prompt 'a # b'", None),
    ]
    assert found[1].comment == "[gpu] 8 GPUs"
    assert found[3].written == "hpcllm generate --prompt 'a # b' [--step N]"


def test_an_unknown_mark_or_an_unclosed_block_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"README.md:2: unknown mark \[gpus\]"):
        examples(_docs(tmp_path / "a", "```bash\nhpcllm topo  # [gpus] x\n```\n"))
    with pytest.raises(ValueError, match="never closed"):
        examples(_docs(tmp_path / "b", "```bash\nhpcllm topo\n"))
    with pytest.raises(ValueError, match="inside a continued line"):
        examples(_docs(tmp_path / "c", "```bash\nhpcllm topo \\\n```\n"))


def test_the_docs_have_examples_and_every_one_that_needs_more_than_a_cpu_is_marked():
    found = examples()
    assert found[0].path == "README.md" and found[-1].path.startswith("docs/")
    cpu = [e for e in found if e.mark is None]
    assert len(cpu) >= 40 and len(found) - len(cpu) >= 20
    assert {e.mark for e in found} - {None} <= set(MARKS)
    for example in found:
        for pattern, marks in NEEDS:
            if re.search(pattern, example.command):
                assert example.mark in marks, f"{example.where}: mark it {marks}: {example.command}"


def test_the_readme_explains_every_mark():
    readme = (REPO / "README.md").read_text()
    for mark in MARKS:
        assert f"`[{mark}]`" in readme, mark
    assert "make docs-examples" in readme


def test_the_quick_rules_each_change_a_documented_example():
    cpu = [e for e in examples() if e.mark is None]
    for pattern, _ in [*RESOLVE_ONLY, *QUICK_RULES]:
        assert any(re.search(pattern, e.command.strip()) for e in cpu), pattern


def test_a_training_gets_train_quick_after_its_own_options():
    line = Example("x.md", 1, "", "NP=2 jobs/mpirun.sh train --set train.steps=300", "", None)
    assert quick_command(line) == f"{line.command} {TRAIN_QUICK}"
    demo = Example("x.md", 1, "make demo", "make demo", "", None)
    assert quick_command(demo) == f"make demo DEMO_ARGS='{TRAIN_QUICK}'"
    bench = Example("x.md", 1, "", "hpcllm bench dp --config c.yaml", "", None)
    assert quick_command(bench).startswith("hpcllm bench dp --config c.yaml --dp 2 ")
    plan = Example("x.md", 1, "", "hpcllm plan --model tiny --gpus 4", "", None)
    assert quick_command(plan) == plan.command


def test_the_walk_runs_cpu_lines_in_order_and_reports_a_failure_by_file_and_line(tmp_path):
    root = _docs(
        tmp_path,
        "```bash\nmkdir made   # made here\nsbatch x.sbatch  # [slurm]\n"
        "ls made missing-file\ntouch made/later\n```\n",
    )
    outcomes = walk(examples(root), root, quick=True, timeout=60)
    assert [(o.example.where, o.ok) for o in outcomes] == [
        ("README.md:2", True),
        ("README.md:4", False),
        ("README.md:5", True),
    ]
    report = outcomes[1].report()
    assert report.startswith(f"README.md:4: exit {outcomes[1].returncode} after ")
    assert outcomes[1].returncode != 0 and "missing-file" in report
    assert (root / "made" / "later").exists()


def test_the_walk_runs_a_command_repeated_word_for_word_once_and_a_failed_one_again(tmp_path):
    root = _docs(
        tmp_path,
        "```bash\necho x >> ran\necho x >> ran\necho x  >> ran\n"
        "test -f flag\ntouch flag\ntest -f flag\n```\n",
    )
    outcomes = walk(examples(root), root, quick=True, timeout=60)
    assert [o.ok for o in outcomes] == [True, True, True, False, True, True]
    assert (root / "ran").read_text() == "x\nx\n"  # the third differs by a space: it ran
    assert outcomes[1].output == "(ran at README.md:2: the same)"
    assert "the same" not in outcomes[5].output  # run again: the first time it failed
    assert same_command(".venv/bin/hpcllm plan --x 1") == same_command("hpcllm plan --x 1")
    assert same_command("NP=2 .venv/bin/hpcllm a") == "NP=2 hpcllm a"
    assert same_command("hpcllm a .venv/bin/b") == "hpcllm a b"


@pytest.mark.slow
def test_a_fresh_copy_has_the_tree_without_data_or_runs_and_the_venv_linked(tmp_path):
    root = fresh_copy(tmp_path / "copy")
    assert (root / "README.md").read_text() == (REPO / "README.md").read_text()
    assert (root / "tests" / "docs_examples.py").exists()
    assert (root / ".venv").is_symlink()
    assert not (root / "data").exists() and not (root / "runs").exists()


@pytest.mark.mpi
@pytest.mark.timeout(2400)
def test_every_cpu_example_runs_in_order_in_a_fresh_copy(tmp_path):
    """The quick mode of the walk (module docstring); a failure names its file:line."""
    found = examples()
    outcomes = walk(found, fresh_copy(tmp_path / "hpcllm"), quick=True, timeout=600)
    assert len(outcomes) == sum(e.mark is None for e in found)
    failed = [outcome.report() for outcome in outcomes if not outcome.ok]
    assert not failed, "\n\n".join(failed)
