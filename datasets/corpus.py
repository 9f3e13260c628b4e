"""Where documents come from: text files, folders, globs, JSONL, and the built-in corpus.

Every rank lists the same sources in the same order, so a document's global index (its id) is
known everywhere without communication: a text file is one document, a JSONL line is one.
"""

from __future__ import annotations

import glob
import json
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hpcllm.errors import UserError

BUILTIN_CORPORA = ("python-stdlib",)
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
# Folders of the standard library that hold its test suites, not library code.
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Source:
    """One input file; a JSONL file holds one document per line."""

    path: Path
    jsonl: bool

    @property
    def label(self) -> str:
        """Return the name recorded in shard attributes."""
        return str(self.path)


def python_stdlib_sources() -> list[Source]:
    """Return the ``.py`` files of the running Python's standard library, minus its tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not _STDLIB_SKIP & set(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_")
    )
    return [Source(p, jsonl=False) for p in files]


def find_sources(inputs: list[str], corpus: str | None = None) -> list[Source]:
    """Return the input files named by ``inputs`` (files, folders, globs) or by ``corpus``.

    Folders are searched recursively for text (``.txt .md .rst .py``) and JSONL files. The
    order is sorted within each input, and inputs keep the order given.
    """
    if corpus is not None:
        if corpus not in BUILTIN_CORPORA:
            raise UserError(f"unknown corpus {corpus!r}; built in: {', '.join(BUILTIN_CORPORA)}")
        return python_stdlib_sources()
    sources: list[Source] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix in TEXT_SUFFIXES | JSONL_SUFFIXES
            )
        elif path.is_file():
            found = [path]
        else:
            found = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not found:
                raise UserError(f"input {item} does not exist (no file, folder or glob match)")
        sources += [Source(p, jsonl=p.suffix in JSONL_SUFFIXES) for p in found]
    if not sources:
        raise UserError(f"no text or JSONL files found in {', '.join(inputs)}")
    return sources


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(
            f"{path} is not UTF-8 text ({err.reason} at byte {err.start})", same_on_all_ranks=False
        ) from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}", same_on_all_ranks=False) from None


def _jsonl_lines(path: Path) -> list[bytes]:
    try:
        return [line for line in path.read_bytes().splitlines() if line.strip()]
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}", same_on_all_ranks=False) from None


def _jsonl_text(path: Path, number: int, line: bytes, field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(
            f"{path}:{number + 1}: not JSON ({err.msg})", same_on_all_ranks=False
        ) from None
    except UnicodeDecodeError as err:
        raise UserError(
            f"{path}:{number + 1}: not UTF-8 ({err.reason})", same_on_all_ranks=False
        ) from None
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        raise UserError(
            f"{path}:{number + 1}: no string field {field!r} (choose it with --jsonl-field)",
            same_on_all_ranks=False,
        )
    return record[field]


def iter_documents(
    sources: list[Source], wanted: Callable[[int], bool], jsonl_field: str = "text"
) -> Iterator[tuple[int, int, str]]:
    """Yield ``(doc_id, source_index, text)`` for the documents whose id ``wanted`` accepts.

    Text files that are not wanted are never opened, so ranks that split a corpus by document
    read only their own files; JSONL files are read by every rank to number their lines.
    """
    doc_id = 0
    for index, source in enumerate(sources):
        if not source.jsonl:
            if wanted(doc_id):
                yield doc_id, index, _read_text(source.path)
            doc_id += 1
            continue
        for number, line in enumerate(_jsonl_lines(source.path)):
            if wanted(doc_id):
                yield doc_id, index, _jsonl_text(source.path, number, line, jsonl_field)
            doc_id += 1
