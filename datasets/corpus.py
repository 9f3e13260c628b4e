"""Where documents come from: text files, folders, globs, JSONL, Parquet, and the built-in corpus.

Every rank lists the same sources in the same order (the training inputs, then the validation
inputs), and numbers their documents in that order without communication: each gets its id
(its place in the whole corpus), its split, and its index within that split (how many of its
split came before it). A text file is one document, or the pieces a cut makes of it
(:func:`text_cut`: ``--split-on``, ``--chunk-chars``); a JSONL line is one; a Parquet row is one.

Ranks read only what they must to number the documents. A text file that is not cut is one
document, so a rank that does not want it never opens it; a Parquet file's rows are counted
from its metadata, and a row group none of whose rows a rank wants is not read. A JSONL file,
and a text file that is cut, is read by every rank, since only reading it counts its documents.
"""

from __future__ import annotations

import glob
import json
import re
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from hpcllm.errors import UserError

BUILTIN_CORPORA = ("python-stdlib",)
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".text"}
JSONL_SUFFIXES = {".jsonl", ".ndjson"}
PARQUET_SUFFIXES = {".parquet"}
# Folders of the standard library that hold its test suites, not library code.
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
# Rows of a Parquet column turned into Python strings at a time.
_PARQUET_BATCH = 1024


@dataclass(frozen=True)
class Source:
    """One input file: a text file, or a JSONL or Parquet file of one document per record.

    ``split`` is where its documents go when the inputs say so (``--input`` train,
    ``--val-input`` val); None where ``--val-fraction`` decides document by document.
    """

    path: Path
    kind: str  # "text", "jsonl" or "parquet"
    split: str | None = None

    @property
    def label(self) -> str:
        """Return the name recorded in shard attributes."""
        return str(self.path)


class Document(NamedTuple):
    """One document, numbered: its id in the corpus, its split and its index in the split."""

    doc_id: int
    split: str
    index: int
    source: int  # its source's place in the list of sources
    text: str


def _kind_of(path: Path) -> str:
    if path.suffix in JSONL_SUFFIXES:
        return "jsonl"
    if path.suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


def python_stdlib_sources() -> list[Source]:
    """Return the ``.py`` files of the running Python's standard library, minus its tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not _STDLIB_SKIP & set(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_")
    )
    return [Source(p, "text") for p in files]


def _files_named(inputs: list[str], split: str | None) -> list[Source]:
    """Return the files of ``inputs`` (files, folders, globs) as sources of ``split``."""
    sources: list[Source] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and p.suffix in TEXT_SUFFIXES | JSONL_SUFFIXES | PARQUET_SUFFIXES
            )
        elif path.is_file():
            found = [path]
        else:
            found = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not found:
                raise UserError(f"input {item} does not exist (no file, folder or glob match)")
        sources += [Source(p, _kind_of(p), split) for p in found]
    if not sources:
        raise UserError(f"no text, JSONL or Parquet files found in {', '.join(inputs)}")
    return sources


def find_sources(
    inputs: list[str], corpus: str | None = None, val_inputs: list[str] | None = None
) -> list[Source]:
    """Return the input files named by ``inputs`` (files, folders, globs) or by ``corpus``,
    then those of ``val_inputs``.

    Folders are searched recursively for text (``.txt .md .rst .py .text``), JSONL and Parquet
    files. The order is sorted within each input, and inputs keep the order given. With
    ``val_inputs``, the sources of ``inputs`` or ``corpus`` are all train and theirs all val,
    and a file named by both is refused; without, every source's split is None.
    """
    split = "train" if val_inputs else None
    if corpus is not None:
        if corpus not in BUILTIN_CORPORA:
            raise UserError(f"unknown corpus {corpus!r}; built in: {', '.join(BUILTIN_CORPORA)}")
        sources = [Source(s.path, s.kind, split) for s in python_stdlib_sources()]
    else:
        sources = _files_named(inputs, split)
    if val_inputs:
        val = _files_named(val_inputs, "val")
        trained = {s.path.resolve() for s in sources}
        both = [s.path for s in val if s.path.resolve() in trained]
        if both:
            raise UserError(
                f"{both[0]} is both a training input and a validation input (--val-input); "
                "a document belongs to one split"
            )
        sources += val
    parquet = [s.path for s in sources if s.kind == "parquet"]
    if parquet:
        _parquet_module(parquet[0])  # refused now rather than once documents are read
    return sources


def text_cut(
    split_on: str | None = None, chunk_chars: int | None = None
) -> Callable[[str], list[str]] | None:
    """Return the function that cuts a text file's text into documents; None: a file is one.

    ``split_on`` (a Python regular expression) gives the pieces between its matches, leaving
    out those that are empty or only whitespace; ``chunk_chars`` gives consecutive pieces of
    that many characters, the last shorter.
    """
    if split_on is not None and chunk_chars is not None:
        raise UserError("give --split-on or --chunk-chars, not both")
    if chunk_chars is not None:
        if chunk_chars < 1:
            raise UserError(f"--chunk-chars must be positive, got {chunk_chars}")
        return lambda text: [text[i : i + chunk_chars] for i in range(0, len(text), chunk_chars)]
    if split_on is None:
        return None
    try:
        pattern = re.compile(split_on)
    except re.error as err:
        raise UserError(f"--split-on '{split_on}' is not a regular expression: {err}") from None
    if pattern.search("") is not None:
        # It would match between every two characters, cutting text into single letters.
        raise UserError(f"--split-on '{split_on}' matches the empty string; it must match text")

    def between_matches(text: str) -> list[str]:
        # finditer rather than re.split, which would also return the pattern's groups.
        matches = list(pattern.finditer(text))
        starts = [0, *(m.end() for m in matches)]
        ends = [*(m.start() for m in matches), len(text)]
        pieces = (text[a:b] for a, b in zip(starts, ends, strict=True))
        return [piece for piece in pieces if piece.strip()]

    return between_matches


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
            f"{path}:{number + 1}: no string field {field!r} (choose it with --text-field)",
            same_on_all_ranks=False,
        )
    return record[field]


def _parquet_module(path: Path) -> Any:
    """Return ``pyarrow.parquet``, imported only when a Parquet file is read."""
    try:
        import pyarrow.parquet
    except ImportError:
        raise UserError(
            f"{path} is a Parquet file, and reading Parquet needs pyarrow: "
            "pip install 'hpcllm[parquet]'"
        ) from None
    return pyarrow.parquet


def _parquet_file(path: Path, field: str) -> Any:
    """Return the open ``pyarrow.parquet.ParquetFile`` at ``path``, once its column ``field``
    is known to hold strings."""
    module = _parquet_module(path)
    import pyarrow as pa

    try:
        parquet = module.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise UserError(f"cannot read {path} as Parquet: {err}", same_on_all_ranks=False) from None
    schema = parquet.schema_arrow
    columns = ", ".join(f"{f.name} ({f.type})" for f in schema)
    if field not in schema.names:
        raise UserError(
            f"{path} has no column {field!r} (choose it with --text-field); its columns: {columns}"
        )
    if not _is_text(schema.field(field).type):
        kind = schema.field(field).type
        raise UserError(
            f"{path}: column {field!r} holds {kind}, not text (choose the text column with "
            f"--text-field); its columns: {columns}"
        )
    return parquet


def _is_text(kind: Any) -> bool:
    """Return whether a Parquet column of Arrow type ``kind`` holds strings: plain, large, a
    view (newer writers) or dictionary-encoded (pandas' categoricals)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or view(kind)


def _parquet_texts(
    path: Path, column: Any, field: str, first_row: int, keep: list[bool]
) -> list[str]:
    """Return the strings of the rows ``keep`` says of a batch of Parquet column ``field``
    whose first row is ``first_row``; a null among them is refused naming its row. Only those
    rows become Python strings: a rank keeps about one row in its world size."""
    import pyarrow as pa

    column = column.filter(pa.array(keep, type=pa.bool_()))
    if column.null_count:
        kept = [row for row, wanted in enumerate(keep) if wanted]
        row = first_row + kept[column.is_null().to_pylist().index(True)]
        raise UserError(
            f"{path}: row {row} (counting from 0) has no text: column {field!r} is null",
            same_on_all_ranks=False,
        )
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        column = column.cast(pa.large_string())
    return column.to_pylist()


class _Numbering:
    """Numbers documents in corpus order: an id, a split, and an index within the split."""

    def __init__(self, split_for: Callable[[int, Source], str]) -> None:
        self._split_for = split_for
        self._next_id = 0
        self._counts: dict[str, int] = {}

    def next(self, source: Source) -> tuple[int, str, int]:
        """Return ``(doc_id, split, index)`` of the next document, which ``source`` holds."""
        doc_id = self._next_id
        split = self._split_for(doc_id, source)
        index = self._counts.get(split, 0)
        self._next_id += 1
        self._counts[split] = index + 1
        return doc_id, split, index


def _parquet_documents(
    source: Source,
    where: int,
    numbering: _Numbering,
    wanted: Callable[[str, int], bool],
    field: str,
) -> Iterator[Document]:
    """Yield the wanted rows of a Parquet source as documents, numbering every row; a row
    group none of whose rows is wanted is counted from the footer and not read."""
    parquet = _parquet_file(source.path, field)
    first_row = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        numbers = [numbering.next(source) for _ in range(rows)]
        keep = [wanted(split, index) for _, split, index in numbers]
        if any(keep):
            texts = _parquet_group_texts(source.path, parquet, group, field, first_row, keep)
            mine = [
                number for number, wanted_here in zip(numbers, keep, strict=True) if wanted_here
            ]
            for (doc_id, split, index), text in zip(mine, texts, strict=True):
                yield Document(doc_id, split, index, where, text)
        first_row += rows


def _parquet_group_texts(
    path: Path, parquet: Any, group: int, field: str, first_row: int, keep: list[bool]
) -> Iterator[str]:
    """Yield the texts of the rows ``keep`` says of row group ``group``, whose first row is
    ``first_row``, read batch by batch and only column ``field``: a row group can be far
    larger than its text."""
    import pyarrow as pa

    batches = parquet.iter_batches(batch_size=_PARQUET_BATCH, row_groups=[group], columns=[field])
    row = first_row
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException) as err:
            raise UserError(f"cannot read {path}: {err}", same_on_all_ranks=False) from None
        if batch is None:
            return
        chosen = keep[row - first_row : row - first_row + batch.num_rows]
        yield from _parquet_texts(path, batch.column(0), field, row, chosen)
        row += batch.num_rows


def iter_documents(
    sources: list[Source],
    split_for: Callable[[int, Source], str],
    wanted: Callable[[str, int], bool],
    text_field: str = "text",
    cut: Callable[[str], list[str]] | None = None,
) -> Iterator[Document]:
    """Yield the documents, in corpus order, whose ``(split, index)`` ``wanted`` accepts.

    ``split_for(doc_id, source)`` gives a document's split; its index is the count of its
    split's documents before it. ``text_field`` is the field of a JSONL record, or the column
    of a Parquet file, that holds the text; ``cut`` (:func:`text_cut`) cuts a text file into
    documents.
    """
    numbering = _Numbering(split_for)
    for where, source in enumerate(sources):
        if source.kind == "parquet":
            yield from _parquet_documents(source, where, numbering, wanted, text_field)
        elif source.kind == "jsonl":
            for number, line in enumerate(_jsonl_lines(source.path)):
                doc_id, split, index = numbering.next(source)
                if wanted(split, index):
                    text = _jsonl_text(source.path, number, line, text_field)
                    yield Document(doc_id, split, index, where, text)
        elif cut is None:
            doc_id, split, index = numbering.next(source)
            if wanted(split, index):
                yield Document(doc_id, split, index, where, _read_text(source.path))
        else:
            for text in cut(_read_text(source.path)):
                doc_id, split, index = numbering.next(source)
                if wanted(split, index):
                    yield Document(doc_id, split, index, where, text)
