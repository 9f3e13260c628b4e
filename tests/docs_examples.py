"""The shell examples of the README and docs/: found, classified and run in a fresh copy.

Which lines are examples: every line of a fenced block whose info string is ``bash``, ``sh``,
``shell`` or ``console`` (in a ``console`` block, only the lines after a ``$`` prompt), in
document order: README.md first, then docs/*.md by file name. A line ending in ``\\`` goes on
to the next; a line that is only a comment is left out. Plain fenced blocks are output,
notation or the record of a past measurement, and are not examples.

Marks: a comment that starts with one of :data:`MARKS` in brackets (``# [gpu] 8 GPUs``) says
why the line is not for a CPU machine; every other line is a CPU example, run as written.
Optional arguments written in brackets (``[--step N]``, ``[--set section.key=value ...]``) are
left out, as a reader who does not need them would.

Running: :func:`fresh_copy` copies the tracked and the untracked-but-not-ignored files of the
working tree into a new folder (no ``data/``, no ``runs/``) with ``.venv`` linked to this
checkout's; :func:`walk` runs each CPU example there with ``bash -c``, one after the other,
with ``.venv/bin`` first on the PATH (as ``source .venv/bin/activate`` would do), one torch
thread per process, and Open MPI allowed to run as root and to oversubscribe the cores.

The quick mode (:func:`quick_command`) changes commands by fixed rules, stated there; the full
mode (``make docs-examples``, ``python tests/docs_examples.py``) runs every CPU example as
written.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SHELL_LANGUAGES = ("bash", "sh", "shell", "console")

# Why a line is not run on a CPU machine; the tag is written `# [tag]` at the start of the
# line's comment. The README says the same, after its first example block.
MARKS: dict[str, str] = {
    "gpu": "needs a GPU node (CUDA, Nsight Systems)",
    "nodes": "needs several nodes (a hostfile, NODES=)",
    "slurm": "needs Slurm (sbatch, srun, an allocation)",
    "download": "needs files that are not in the repository (a Hugging Face model folder)",
    "template": "has placeholders to fill in (a config C, your own input files)",
    "tests": "is the test suite, which runs this walk itself",
}

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_TAG = re.compile(r"^\[([a-z]+)\]")
# An optional argument as usage text writes it: `[--step N]`, `[--set k=v ...]`.
_OPTIONAL = re.compile(r"\s+\[-[^\[\]]*\]")


@dataclass(frozen=True)
class Example:
    """One command line of a shell block: where it is, what it runs, and its mark if any."""

    path: str  # relative to the repository, e.g. "docs/training.md"
    line: int  # the line it starts on (1-based)
    written: str  # as written, continuation lines joined, comment included
    command: str  # what runs: no comment, optional arguments left out
    comment: str  # the comment, without the `#`
    mark: str | None  # a key of MARKS, or None for a CPU example

    @property
    def where(self) -> str:
        """Return ``path:line``."""
        return f"{self.path}:{self.line}"


def doc_files(root: Path = REPO) -> list[Path]:
    """Return the documents in walking order: README.md, then docs/*.md by name."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def split_comment(line: str) -> tuple[str, str]:
    """Split a shell line into (command, comment) at the first unquoted `#` starting a word."""
    quote = ""
    escaped = False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def parse_mark(comment: str, where: str) -> str | None:
    """Return the mark a comment starts with, or None; an unknown tag is an error."""
    match = _TAG.match(comment)
    if match is None:
        return None
    if match[1] not in MARKS:
        raise ValueError(f"{where}: unknown mark [{match[1]}]; known: {', '.join(MARKS)}")
    return match[1]


def drop_optional(command: str) -> str:
    """Leave out the optional arguments written in brackets (`[--step N]`)."""
    return _OPTIONAL.sub("", command)


def block_examples(path: str, start: int, language: str, lines: Sequence[str]) -> list[Example]:
    """Return the examples of one shell block whose first body line is line ``start``."""
    found: list[Example] = []
    pending: list[str] = []
    first = start
    for offset, raw in enumerate(lines):
        text = raw.rstrip()
        if not pending:
            first = start + offset
            if language == "console":
                if not text.startswith("$ "):
                    continue  # output
                text = text[2:]
            if not text.strip() or text.lstrip().startswith("#"):
                continue
        if text.endswith("\\"):
            pending.append(text[:-1].rstrip())
            continue
        pending.append(text.strip() if pending else text)
        written = " ".join(part.strip() for part in pending)
        pending = []
        command, comment = split_comment(written)
        mark = parse_mark(comment, f"{path}:{first}")
        found.append(Example(path, first, written, drop_optional(command), comment, mark))
    if pending:
        raise ValueError(f"{path}:{first}: the block ends inside a continued line")
    return found


def examples(root: Path = REPO) -> list[Example]:
    """Return every example of the README and docs/, in walking order."""
    found: list[Example] = []
    for doc in doc_files(root):
        rel = doc.relative_to(root).as_posix()
        lines = doc.read_text().splitlines()
        fence: str | None = None
        language = ""
        body: list[str] = []
        start = 0
        for number, line in enumerate(lines, 1):
            match = _FENCE.match(line)
            if fence is None:
                if match:
                    fence, language, body, start = match[1], match[2].lower(), [], number + 1
            elif match and match[1].startswith(fence) and not match[2]:
                if language in SHELL_LANGUAGES:
                    found.extend(block_examples(rel, start, language, body))
                fence = None
            else:
                body.append(line)
        if fence is not None:
            raise ValueError(f"{rel}:{start - 1}: a fenced block is never closed")
    return found


# --- the quick mode ------------------------------------------------------------------------

# A training run in the quick mode: 2 steps, a log line each, one validation micro-batch at
# the end and a checkpoint at the end (tiny-cpu.yaml saves every 100 steps), so that a later
# example that reads the run (generate, evaluate, convert, timeline, a resume) finds it.
TRAIN_QUICK = (
    "--set train.steps=2 --set train.log_interval=1 --set train.eval_interval=0"
    " --set train.eval_iters=1"
)

# (what a command says, how the quick mode changes it): the first rule whose pattern matches
# the command is applied with re.sub (once), none when none matches. \g<0> is the match.
QUICK_RULES: list[tuple[str, str]] = [
    # make demo's training takes its options from DEMO_ARGS
    (r"^make demo$", rf"\g<0> DEMO_ARGS='{TRAIN_QUICK}'"),
    # a command that trains: later --set options win, so these come last
    (r"^.*\b(hpcllm|mpirun\.sh) train\b.*$", rf"\g<0> {TRAIN_QUICK}"),
    # the benchmarks, at their smallest documented sizes (the last of an option given twice wins)
    (r"^.*\bbench dp\b.*$", r"\g<0> --dp 2 --engines ddp --precisions fp32 --steps 2 --warmup 1"),
    (r"^.*\bbench sync\b.*$", r"\g<0> --engines ddp --steps 2 --log-every 1"),
    (r"^.*\bbench moe\b.*$", r"\g<0> --engines ddp --ep 2 --top-k 2 --steps 2 --warmup 1"),
    (
        r"^.*\bbench pipeline\b.*$",
        r"\g<0> --schedules 1f1b interleaved --microbatches 4 --forward-ms 5 --steps 1 --warmup 0",
    ),
    (r"^.*\bbench collectives\b.*--max-bytes.*$", r"\g<0> --max-bytes 64K --iters 2 --warmup 1"),
    (r"^.*\bbench collectives\b.*$", r"\g<0> --iters 2 --warmup 1"),
    (r"^.*\bbench data\b.*$", r"\g<0> --steps 50 --warmup 5"),
    (r"^.*\bbench step\b.*$", r"\g<0> --steps 1 --rounds 2 --warmup 1 --loop-steps 3"),
    # tests/mpi_scripts/tp_internals.py's shape (b, s, h, heads): its own default
    (r"\bTP_SHAPE=\S+", "TP_SHAPE=2,32,64,4"),
]

# The examples only resolved in the quick mode, as (pattern, replacement) like QUICK_RULES and
# tried before them: the option added makes the command check its config and stop. Each takes
# over a minute here even with QUICK_RULES.
RESOLVE_ONLY: list[tuple[str, str]] = [
    # bf16 autocast is emulated on a CPU without AVX512-BF16: about 10 s a step on 4 ranks
    (r"^.*\bhpcllm train\b.*train\.precision=bf16.*$", r"\g<0> --print-config"),
]


def quick_command(example: Example) -> str:
    """Return the command the quick mode runs for ``example``.

    The first rule of ``RESOLVE_ONLY`` then ``QUICK_RULES`` whose pattern matches the command
    is applied (a bf16 training: only resolved; a command that trains: ``TRAIN_QUICK``, 2 steps
    with a checkpoint at the end; a benchmark: its smallest sizes); the rest run as written.
    """
    command = example.command.strip()
    for pattern, replacement in [*RESOLVE_ONLY, *QUICK_RULES]:
        if re.search(pattern, command):
            return re.sub(pattern, replacement, command, count=1)
    return command


# --- running ------------------------------------------------------------------------------


def fresh_copy(dest: Path, source: Path = REPO) -> Path:
    """Copy ``source``'s working tree as a fresh clone would hold it into ``dest``.

    The files are those git tracks plus the untracked ones it does not ignore, as they are
    now (edits included); ``.venv`` is a link to ``source``'s, so nothing is installed.
    """
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=source,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    dest.mkdir(parents=True, exist_ok=True)
    for name in filter(None, (entry.decode() for entry in listed)):
        src = source / name
        if not src.is_file():
            continue  # deleted in the working tree, or a submodule
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)
    (dest / ".venv").symlink_to((source / ".venv").resolve(), target_is_directory=True)
    check_set_up(dest)
    return dest


def check_set_up(root: Path) -> None:
    """Raise unless ``make setup`` in ``root`` would change nothing.

    `make demo` runs the set-up in the copy; were the venv's stamp stale, it would reinstall
    hpcllm into the shared .venv from the copy (which is then deleted).
    """
    dry = subprocess.run(
        ["bash", "scripts/setup.sh"],
        cwd=root,
        env={**os.environ, "HPCLLM_SETUP_DRY_RUN": "1"},
        capture_output=True,
        text=True,
    )
    said = [line for line in (dry.stdout + dry.stderr).splitlines() if line.strip()]
    if dry.returncode != 0 or said != ["[setup] dry run: nothing was changed"]:
        raise RuntimeError(
            "run `make setup` in the checkout first: in a fresh copy it would change the "
            "shared .venv:\n" + "\n".join(said)
        )


def example_env(root: Path) -> dict[str, str]:
    """Return the environment the examples run in, from ``root`` (the fresh copy)."""
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.update(
        PATH=os.pathsep.join([str(root / ".venv" / "bin"), env.get("PATH", "")]),
        # The copy's code, not the editable install's (which points at the original).
        PYTHONPATH=str(root),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # Open MPI: run as root, more ranks than cores, no binding, no cross-memory attach.
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_rmaps_base_oversubscribe="1",
        OMPI_MCA_hwloc_base_binding_policy="none",
        OMPI_MCA_btl_vader_single_copy_mechanism="none",
    )
    return env


@dataclass
class Outcome:
    """What running one example gave."""

    example: Example
    command: str  # what ran
    returncode: int
    seconds: float  # wall-clock
    cpu_seconds: float  # user + system time of the command and everything it started
    output: str  # stdout and stderr, interleaved

    @property
    def ok(self) -> bool:
        """True when the command exited 0."""
        return self.returncode == 0

    def report(self, lines: int = 15) -> str:
        """Return the failure as its place, exit code, command and last lines of output."""
        tail = "\n".join(self.output.rstrip().splitlines()[-lines:])
        return (
            f"{self.example.where}: exit {self.returncode} after {self.seconds:.1f} s\n"
            f"  $ {self.command}\n{tail}"
        )


def run_example(
    example: Example, command: str, root: Path, env: dict[str, str], timeout: float
) -> Outcome:
    """Run ``command`` with ``bash -c`` in ``root``; kill its process group after ``timeout``."""
    start = time.monotonic()
    used = _children_cpu()
    with tempfile.TemporaryFile(mode="w+") as out:
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = -signal.SIGKILL
            out.write(f"\n(killed after {timeout:.0f} s)\n")
        out.seek(0)
        output = out.read()
    seconds = time.monotonic() - start
    return Outcome(example, command, returncode, seconds, _children_cpu() - used, output)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def same_command(command: str) -> str:
    """Return ``command`` as the walk compares it: ``.venv/bin/hpcllm`` is ``hpcllm`` there."""
    return re.sub(r"(^|\s)\.venv/bin/", r"\1", command)


def walk(
    found: Iterable[Example],
    root: Path,
    *,
    quick: bool,
    timeout: float = 1800,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Run every CPU example of ``found`` in ``root``, in order; return what each gave.

    A command that is one that already ran and passed in this walk (the README repeats a few
    of docs/'), word for word but for ``.venv/bin/`` (first on the walk's PATH), passes as that
    one did, without a second run.
    """
    env = example_env(root)
    outcomes: list[Outcome] = []
    passed: dict[str, Example] = {}
    for example in found:
        if example.mark is not None:
            continue
        command = quick_command(example) if quick else example.command
        key = same_command(command)
        if key in passed:
            earlier = passed[key].where
            outcome = Outcome(example, command, 0, 0.0, 0.0, f"(ran at {earlier}: the same)")
        else:
            outcome = run_example(example, command, root, env, timeout)
        if outcome.ok:
            passed.setdefault(key, example)
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    """Walk the examples (``--quick`` for the quick mode); print times and failures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick mode's rules")
    parser.add_argument("--list", action="store_true", help="list the examples and stop")
    parser.add_argument("--keep", metavar="DIR", help="walk in DIR (kept) instead of a temp dir")
    args = parser.parse_args(argv)
    found = examples()
    if args.list:
        for example in found:
            shown = quick_command(example) if args.quick else example.command
            tag = f"[{example.mark}]" if example.mark else "cpu"
            print(f"{example.where:28} {tag:11} {shown}")
        return 0

    def show(outcome: Outcome) -> None:
        status = "ok" if outcome.ok else f"FAILED (exit {outcome.returncode})"
        print(
            f"{outcome.seconds:7.1f} s {outcome.cpu_seconds:7.1f} s cpu  "
            f"{outcome.example.where:28} {status}  {outcome.command}",
            flush=True,
        )

    with tempfile.TemporaryDirectory(prefix="hpcllm-docs-") as tmp:
        root = fresh_copy(Path(args.keep) if args.keep else Path(tmp) / "hpcllm")
        start = time.monotonic()
        outcomes = walk(found, root, quick=args.quick, on_outcome=show)
        total = time.monotonic() - start
    failed = [outcome for outcome in outcomes if not outcome.ok]
    skipped = sum(example.mark is not None for example in found)
    cpu = sum(outcome.cpu_seconds for outcome in outcomes)
    print(
        f"{len(outcomes)} CPU examples in {total:.0f} s ({total / 60:.1f} min), "
        f"{cpu:.0f} s of CPU, "
        f"{len(failed)} failed; {skipped} marked and skipped"
    )
    for outcome in failed:
        print("\n" + outcome.report(), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
