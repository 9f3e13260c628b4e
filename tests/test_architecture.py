"""docs/architecture.md stays the map of the code: what it names exists, and it names every module.

A change that adds, moves or removes a module fails here until the map says so, in the same
commit. Paths are what the page shows in backticks (``hpcllm/train/step.py``, ``jobs/``);
dotted names (``hpcllm.datasets.reader``) are resolved through the package mapping of
pyproject.toml (``hpcllm.kernels`` is ``kernels/``, ``hpcllm.datasets`` is ``datasets/``).
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAP = REPO / "docs" / "architecture.md"
# The folders whose every module the map must name, and how import names reach them.
PACKAGES = {"hpcllm": "hpcllm", "hpcllm.kernels": "kernels", "hpcllm.datasets": "datasets"}
# A backticked path under one of these is the repository's; others (a run folder's
# `checkpoints/`) are not checked.
ROOTS = ("hpcllm", "kernels", "datasets", "jobs", "tests", "docs", "scripts", ".ci")

_PATH = re.compile(r"`([\w.-]+/[\w./-]*)`")
_DOTTED = re.compile(r"`(hpcllm(?:\.\w+)+)`")


def named_paths(text: str) -> set[str]:
    """Return the repository paths the page shows in backticks (files and folders)."""
    return {m for m in _PATH.findall(text) if m.split("/")[0] in ROOTS}


def module_file(dotted: str) -> Path | None:
    """Return the file or package folder a dotted module name is, None if neither exists."""
    parts = dotted.split(".")
    # The longest mapped prefix decides the folder (hpcllm.kernels before hpcllm).
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in PACKAGES:
            base = (
                REPO / PACKAGES[prefix] / Path(*parts[n:]) if parts[n:] else REPO / PACKAGES[prefix]
            )
            break
    else:
        return None
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def test_every_path_and_module_the_map_names_exists() -> None:
    text = MAP.read_text()
    paths = named_paths(text)
    assert len(paths) > 50, "the map names too few paths: was it emptied?"
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"docs/architecture.md names paths that are gone: {missing}"
    dotted = set(_DOTTED.findall(text))
    unresolved = sorted(d for d in dotted if module_file(d) is None)
    assert not unresolved, f"docs/architecture.md names modules that are gone: {unresolved}"


def test_the_map_names_every_module() -> None:
    text = MAP.read_text()
    paths = named_paths(text)
    modules = [
        f.relative_to(REPO).as_posix()
        for folder in PACKAGES.values()
        for f in sorted((REPO / folder).rglob("*.py"))
        if f.name != "__init__.py" and "__pycache__" not in f.parts
    ]
    unnamed = [m for m in modules if m not in paths]
    assert not unnamed, f"modules docs/architecture.md does not name: {unnamed}"


def test_the_readme_links_the_map() -> None:
    assert "docs/architecture.md" in (REPO / "README.md").read_text()


def test_a_path_that_is_gone_is_caught() -> None:
    # The checks above would pass on a page that names nothing checkable: they must see these.
    assert named_paths("see `hpcllm/train/gone.py` and `jobs/`") == {
        "hpcllm/train/gone.py",
        "jobs/",
    }
    assert module_file("hpcllm.train.gone") is None
    assert module_file("hpcllm.kernels.reference") == REPO / "kernels" / "reference.py"
    assert module_file("hpcllm.datasets") == REPO / "datasets" / "__init__.py"
