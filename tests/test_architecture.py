"""docs/architecture.md stays the map of the code: what it names exists, and it names every module.

A change that adds, moves or removes a module fails here until the map says so, in the same
commit. Paths are what the page shows in backticks (``hpcllm/train/step.py``, ``jobs/``);
dotted names (``hpcllm.datasets.reader``) are resolved through the package mapping of
pyproject.toml (``hpcllm.kernels`` is ``kernels/``, ``hpcllm.datasets`` is ``datasets/``).
"""

from __future__ import annotations

import ast
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


# Methods that change a container in place.
_MUTATORS = {"append", "extend", "update", "clear", "pop", "popitem", "setdefault", "add"}
_MUTATORS |= {"remove", "discard", "insert"}


def _frozen(node: ast.ClassDef) -> bool:
    """Return whether a class is a frozen dataclass (its instances hold no process state)."""
    return any(
        isinstance(d, ast.Call) and any(k.arg == "frozen" for k in d.keywords)
        for d in node.decorator_list
    )


def process_state(source: str) -> set[str]:
    """Return a module's process state: names rebound by ``global``, module-level instances
    of its own mutable classes, and module-level containers a function changes."""
    tree = ast.parse(source)
    mutable = {n.name for n in tree.body if isinstance(n, ast.ClassDef) and not _frozen(n)}
    top: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            top.update({t.id: node.value for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            if isinstance(node.target, ast.Name):
                top[node.target.id] = node.value
    found = {name for n in ast.walk(tree) if isinstance(n, ast.Global) for name in n.names}
    found |= {
        name
        for name, value in top.items()
        if isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id in mutable
    }
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for function in functions:
        for node in ast.walk(function):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
                targets = node.target if isinstance(node, ast.AugAssign) else node.targets
                for target in targets if isinstance(targets, list) else [targets]:
                    if (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Name)
                        and target.value.id in top
                    ):
                        found.add(target.value.id)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _MUTATORS
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in top
            ):
                found.add(node.func.value.id)
    return found


def mapped_state(text: str) -> set[tuple[str, str]]:
    """Return the (path, name) pairs of the map's "Process state" table."""
    section = text.split("## Process state", 1)[1].split("\n## ", 1)[0]
    pairs = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and "/" in cells[0]:
            pairs |= {(cells[0].strip("`"), n) for n in re.findall(r"`(\w+)`", cells[1])}
    return pairs


def test_module_level_process_state_is_where_the_map_says() -> None:
    found = {
        (f.relative_to(REPO).as_posix(), name)
        for folder in PACKAGES.values()
        for f in sorted((REPO / folder).rglob("*.py"))
        if "__pycache__" not in f.parts
        for name in process_state(f.read_text())
    }
    mapped = mapped_state(MAP.read_text())
    assert found - mapped == set(), "process state the map's table does not name"
    assert mapped - found == set(), "the map's table names process state that is gone"


def test_the_state_finder_sees_each_kind() -> None:
    source = (
        "import dataclasses\n"
        "class Box:\n    pass\n"
        "@dataclasses.dataclass(frozen=True)\nclass Fixed:\n    pass\n"
        "_BOX = Box()\n_FIXED = Fixed()\n_flag = False\n_seen: dict = {}\n_list = []\n"
        "CONSTANT = (1, 2)\n"
        "def f():\n    global _flag\n    _flag = True\n    _seen['a'] = 1\n    _list.append(2)\n"
    )
    assert process_state(source) == {"_BOX", "_flag", "_seen", "_list"}
