"""The import graph of the library: no cycles, and no import from a lower layer to a higher one.

Every import of an hpcllm module counts, wherever it is written: at the top of a file, inside a
function or a method, under `if TYPE_CHECKING`. A function-level import is still a dependency;
it only moves the moment it runs.
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Import name of each package root -> its folder in the repository (as setup.py maps them).
ROOTS = {"hpcllm": "hpcllm", "hpcllm.kernels": "kernels", "hpcllm.datasets": "datasets"}

# Bottom to top. A module belongs to the first layer with a prefix that matches it: the prefix
# itself or any module below it, except "hpcllm", which matches only the package's __init__.
# A module may import from its own layer and the layers below; a module that no layer matches
# fails the test, so that a new top-level module is placed on purpose.
LAYERS = [
    # __init__: __version__, and load_model resolved on first use (LAZY_EXPORTS)
    ("package", ["hpcllm"]),
    ("user error", ["hpcllm.user_error"]),
    ("launcher", ["hpcllm.launcher", "hpcllm.files", "hpcllm.folder_lock", "hpcllm.startup"]),
    ("errors", ["hpcllm.errors", "hpcllm.watchdog"]),
    ("topology", ["hpcllm.topology"]),
    ("config", ["hpcllm.keys", "hpcllm.config", "hpcllm.flops", "hpcllm.families"]),
    ("observe", ["hpcllm.observe"]),
    ("data+kernels", ["hpcllm.datasets", "hpcllm.kernels"]),
    ("parallel", ["hpcllm.parallel"]),
    ("model", ["hpcllm.model"]),
    ("train", ["hpcllm.train"]),
    (
        "tools",
        ["hpcllm.bench", "hpcllm.convert", "hpcllm.evaluate", "hpcllm.generate", "hpcllm.plan"],
    ),
    ("cli", ["hpcllm.cli", "hpcllm.commands", "hpcllm.__main__"]),
]

# The data-parallel engines wrap any model and optimizer; they know nothing of the model, the
# trainer or pipelines.
ENGINES = ["hpcllm.parallel.data"]

# The package's __init__ imports these inside its PEP 562 __getattr__ only, on first use of
# the name they export (hpcllm.load_model): the one import from the bottom layer upward.
LAZY_EXPORTS = {("hpcllm", "hpcllm.generate")}

# The packages a family's own modules live in (its spec, its torch half, its plain baseline):
# every module outside them reaches a family through the registry (hpcllm.families,
# hpcllm.model.build) and never names one.
FAMILY_HOMES = ["hpcllm.families", "hpcllm.model"]
# What the model may import of the parallel package: its layers and its tensors' roles, never
# the pipeline or the data-parallel engines.
MODEL_MUST_NOT_IMPORT = ["hpcllm.parallel.pipeline", "hpcllm.parallel.data"]

# Private names another module may import: none.
PRIVATE_IMPORTS_ALLOWED: set[tuple[str, str]] = set()
ENGINES_MUST_NOT_IMPORT = ["hpcllm.model", "hpcllm.train", "hpcllm.parallel.pipeline"]

TOP = "hpcllm"


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    is_package: bool


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str  # the deepest existing module the import names
    path: Path
    line: int
    written: str  # for an import of a missing module: the name (resolved if relative); else ""


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def find_modules(base: Path, roots: dict[str, str]) -> dict[str, Module]:
    """Every .py file inside a package (an __init__.py in each folder down from its root)."""
    modules = {}
    for root_name, folder in roots.items():
        top = base / folder
        for path in sorted(top.rglob("*.py")):
            rel = path.relative_to(top)
            if not all((top / p / "__init__.py").is_file() for p in rel.parents):
                continue
            parts = list(rel.with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join([root_name, *parts])
            modules[name] = Module(name, path, is_package)
    return modules


def _deepest(name: str, modules: dict[str, Module]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported_from(node: ast.ImportFrom, mod: Module) -> str:
    """Return the absolute module a ``from ... import`` in ``mod`` names (relative resolved)."""
    if not node.level:
        return node.module or ""
    package = mod.name if mod.is_package else mod.name.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(modules: dict[str, Module], top: str = TOP) -> list[Edge]:
    """Each import of a module under `top`, anywhere in each module's source."""
    edges = []
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(), filename=str(mod.path))
        for node in ast.walk(tree):
            targets = []  # (name as written, candidates from deepest to shallowest)
            if isinstance(node, ast.Import):
                targets = [(alias.name, [alias.name]) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = imported_from(node, mod)
                for alias in node.names:
                    if alias.name == "*":
                        targets.append((source, [source]))
                    else:  # `from a import b`: b may be the submodule a.b
                        targets.append(
                            (f"{source}.{alias.name}", [f"{source}.{alias.name}", source])
                        )
            for written, candidates in targets:
                if not under(written, top):
                    continue
                found = next((c for c in candidates if c in modules), None)
                imported = found or _deepest(candidates[-1], modules)
                if imported is None or imported == mod.name:
                    continue
                missing = "" if found else candidates[-1]  # the module named after `from`
                edge = Edge(mod.name, imported, mod.path, node.lineno, missing)
                if edge not in edges:  # `from a import b, c` is one edge
                    edges.append(edge)
    return edges


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(modules: dict[str, Module], top: str = TOP) -> list[tuple[str, str, str]]:
    """Each use of another hpcllm module's private (``_name``) name: (importer, the name with
    its module, where). Counts ``from m import _name`` and ``m._name`` on a name bound to an
    hpcllm module or to a name imported from one, anywhere in the source; dunder names such
    as ``__version__`` are public."""
    found = []
    for mod in modules.values():
        tree = ast.parse(mod.path.read_text(), filename=str(mod.path))
        bound: dict[str, str] = {}  # local name -> what it is, dotted
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = imported_from(node, mod)
                if not under(source, top):
                    continue
                for alias in node.names:
                    if _private(alias.name) and source != mod.name:
                        found.append((mod.name, f"{source}.{alias.name}", f"line {node.lineno}"))
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if under(alias.name, top):
                        name = alias.asname or alias.name.partition(".")[0]
                        bound[name] = alias.name if alias.asname else name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _private(node.attr)
            ):
                found.append(
                    (mod.name, f"{bound[node.value.id]}.{node.attr}", f"line {node.lineno}")
                )
    return found


def layer_of(name: str, layers: list = LAYERS, top: str = TOP) -> int | None:
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if name == prefix or (prefix != top and under(name, prefix)):
                return index
    return None


def _where(edge: Edge, base: Path) -> str:
    try:
        path = edge.path.relative_to(base)
    except ValueError:
        path = edge.path
    return f"{path}:{edge.line}"


def _layer_name(index: int, layers: list) -> str:
    return f"{index} {layers[index][0]}"


def upward_imports(edges: list[Edge], layers: list, base: Path) -> list[str]:
    lines = []
    for e in edges:
        low, high = layer_of(e.importer, layers), layer_of(e.imported, layers)
        if low is not None and high is not None and low < high:
            lines.append(
                f"{_where(e, base)}  {e.importer} (layer {_layer_name(low, layers)}) -> "
                f"{e.imported} (layer {_layer_name(high, layers)})"
            )
    return lines


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.importer, set()).add(e.imported)
        graph.setdefault(e.imported, set())
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def cycle_report(edges: list[Edge], base: Path) -> list[str]:
    lines = []
    for component in cycles(edges):
        members = set(component)
        lines.append("cycle among " + ", ".join(component) + ":")
        lines += [
            f"    {_where(e, base)}  {e.importer} -> {e.imported}"
            for e in edges
            if e.importer in members and e.imported in members
        ]
    return lines


# --- the real tree ---------------------------------------------------------------------------


def _real_graph() -> tuple[dict[str, Module], list[Edge]]:
    modules = find_modules(REPO, ROOTS)
    assert "hpcllm.cli" in modules and "hpcllm.kernels" in modules, sorted(modules)
    return modules, import_edges(modules)


def test_every_module_has_a_layer():
    modules, _ = _real_graph()
    unplaced = sorted(m for m in modules if layer_of(m) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS in {__file__}): {unplaced}"


def test_no_import_cycles():
    _, edges = _real_graph()
    report = cycle_report(edges, REPO)
    assert not report, "import cycles (function-level imports included):\n" + "\n".join(report)


def test_no_import_from_a_lower_layer_to_a_higher_one():
    _, edges = _real_graph()
    edges = [e for e in edges if (e.importer, e.imported) not in LAZY_EXPORTS]
    report = upward_imports(edges, LAYERS, REPO)
    order = "\n".join(
        f"  {_layer_name(i, LAYERS)}: {', '.join(p)}" for i, (_, p) in enumerate(LAYERS)
    )
    assert not report, (
        f"{len(report)} imports from a lower layer to a higher one (function-level imports "
        f"included):\n" + "\n".join(report) + f"\nlayers, bottom to top:\n{order}"
    )


def test_the_package_init_imports_hpcllm_modules_only_in_its_getattr():
    tree = ast.parse((REPO / "hpcllm" / "__init__.py").read_text())
    lazy = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__")
    inside = {id(n) for n in ast.walk(lazy)}

    def names_hpcllm(node: ast.Import | ast.ImportFrom) -> bool:
        if isinstance(node, ast.ImportFrom):
            return under(node.module or "", TOP)
        return any(under(alias.name, TOP) for alias in node.names)

    eager = [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in inside and names_hpcllm(n)
    ]
    assert not eager, f"hpcllm/__init__.py imports hpcllm modules at lines {eager}"


def _family_blind(module: str) -> bool:
    return not any(under(module, home) for home in FAMILY_HOMES)


def test_no_module_outside_the_family_homes_names_a_model_familys_own_modules():
    from hpcllm import families

    modules, edges = _real_graph()
    own = {m for m in modules if under(m, "hpcllm.families") and m != "hpcllm.families"}
    own |= {families.get(n).module.partition(":")[0] for n in families.names()}
    references = [families.get(n).reference for n in families.names()]
    own |= {r.partition(":")[0] for r in references if r is not None}
    assert "hpcllm.families.gpt2" in own and "hpcllm.model.gpt" in own
    assert "hpcllm.model.plain_llama" in own
    bad = [
        f"{_where(e, REPO)}  {e.importer} -> {e.imported}"
        for e in edges
        if _family_blind(e.importer) and e.imported in own
    ]
    assert not bad, "modules that must reach a family through the registry:\n" + "\n".join(bad)


def family_name_comparisons(source: str, names: set[str]) -> list[int]:
    """Return the lines where ``source`` compares an ``arch`` (``model.arch``, ``arch``) with
    a family's name, or keys a mapping by one (``{"llama": ...}``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            archs = any(
                (isinstance(x, ast.Attribute) and x.attr == "arch")
                or (isinstance(x, ast.Name) and x.id == "arch")
                for x in sides
            )
            words = {
                c.value
                for x in sides
                for c in ([x] if isinstance(x, ast.Constant) else getattr(x, "elts", []))
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            }
            if archs and words & names:
                lines.append(node.lineno)
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if keys & names:
                lines.append(node.lineno)
    return lines


@pytest.mark.slow
def test_no_module_outside_the_family_homes_compares_model_arch_with_a_familys_name():
    from hpcllm import families

    modules, _ = _real_graph()
    names = set(families.names())
    bad = [
        f"{mod.path.relative_to(REPO)}:{line}"
        for mod in modules.values()
        if _family_blind(mod.name)
        for line in family_name_comparisons(mod.path.read_text(), names)
    ]
    assert not bad, "modules that decide by a family's name:\n" + "\n".join(bad)


def test_the_family_name_finder_sees_comparisons_and_keyed_mappings():
    source = (
        "def f(cfg, arch):\n"
        "    if cfg.model.arch == 'llama':\n"
        "        pass\n"
        "    if arch in ('gpt2', 'x'):\n"
        "        pass\n"
        "    if cfg.model.arch != other:\n"
        "        pass\n"
        "    return {'llama': 1}, {'llamas': 2}, cfg.name == 'gpt2'\n"
    )
    assert family_name_comparisons(source, {"gpt2", "llama"}) == [2, 4, 8]


def test_the_model_imports_no_pipeline_and_no_engine():
    modules, edges = _real_graph()
    bad = [
        f"{_where(e, REPO)}  {e.importer} -> {e.imported}"
        for e in edges
        if under(e.importer, "hpcllm.model")
        and any(under(e.imported, p) for p in MODEL_MUST_NOT_IMPORT)
    ]
    assert not bad, "the model importing the pipeline or an engine:\n" + "\n".join(bad)


def test_data_parallel_engines_know_no_model_trainer_or_pipeline():
    modules, edges = _real_graph()
    engines = [m for m in modules if any(under(m, p) for p in ENGINES)]
    assert engines, f"no data-parallel engine module under {ENGINES}: update ENGINES"
    bad = [
        f"{_where(e, REPO)}  {e.importer} -> {e.imported}"
        for e in edges
        if e.importer in engines and any(under(e.imported, p) for p in ENGINES_MUST_NOT_IMPORT)
    ]
    assert not bad, "data-parallel engines importing model, trainer or pipeline:\n" + "\n".join(bad)


@pytest.mark.slow
def test_no_module_uses_another_modules_private_names():
    modules, _ = _real_graph()
    bad = [
        f"{importer} ({where}) uses {name}"
        for importer, name, where in private_imports(modules)
        if (importer, name) not in PRIVATE_IMPORTS_ALLOWED
    ]
    assert not bad, "private names used across modules (make them public):\n" + "\n".join(bad)


@pytest.mark.slow
def test_parallel_holds_the_tensor_pipeline_and_data_packages_and_no_engine_outside():
    parallel = REPO / "hpcllm" / "parallel"
    packages = sorted(p.name for p in parallel.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["data", "pipeline", "tensor"]
    modules, edges = _real_graph()
    data = "hpcllm.parallel.data"
    # Data-parallel machinery is data/'s: outside it no module starts Horovod, wraps in DDP,
    # subclasses an engine or its optimizer, or shards an optimizer.
    machinery = {"DistributedDataParallel", "hvd", "horovod", "ZeroState", "DistributedAdamW"}
    bad = []
    for name, mod in modules.items():
        if under(name, data):
            continue
        for node in ast.walk(ast.parse(mod.path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if bases & {"Engine", "MixedPrecisionOptimizer"}:
                    bad.append(f"{name}: class {node.name} is an engine or its optimizer")
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", "") or ""]
                if any(n.partition(".")[0] == "horovod" for n in names):
                    bad.append(f"{name}:{node.lineno} imports Horovod")
            if isinstance(node, ast.Call):
                called = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if called in machinery:
                    bad.append(f"{name}:{node.lineno} calls {called}")
    assert not bad, "data-parallel code outside hpcllm/parallel/data/:\n" + "\n".join(bad)


def test_every_hpcllm_import_names_an_existing_module():
    _, edges = _real_graph()
    bad = [
        f"{_where(e, REPO)}  {e.importer} imports {e.written}, which does not exist"
        for e in edges
        if e.written
    ]
    assert not bad, "\n".join(bad)


# --- the walker itself, on a small fake package ---------------------------------------------


def _write(base: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_walker_sees_function_level_relative_and_mapped_imports(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "__version__ = '0'\n",
            "pkg/errors.py": (
                "import os\n"
                "\n"
                "def report():\n"
                "    from hpcllm.topology import Grid  # upward, inside a function\n"
                "    return Grid\n"
            ),
            "pkg/topology.py": "from hpcllm import errors\n\nGrid = object\n",
            "pkg/parallel/__init__.py": "",
            "pkg/parallel/data_parallel.py": (
                "class Engine:\n"
                "    def wrap(self):\n"
                "        import hpcllm.model.gpt as gpt\n"
                "        from .. import kernels\n"
                "        from . import tensor\n"
                "        return gpt, kernels, tensor\n"
            ),
            "pkg/parallel/tensor.py": "from ..errors import report\nfrom hpcllm.gone import x\n",
            "pkg/model/__init__.py": "",
            "pkg/model/gpt.py": "from hpcllm.kernels import fused\n",
            "pkg/notinpackage/helper.py": "import hpcllm.cli\n",
            "kern/__init__.py": "def fused():\n    from hpcllm.model import gpt\n",
        },
    )
    modules = find_modules(tmp_path, {"hpcllm": "pkg", "hpcllm.kernels": "kern"})
    assert sorted(modules) == [
        "hpcllm",
        "hpcllm.errors",
        "hpcllm.kernels",
        "hpcllm.model",
        "hpcllm.model.gpt",
        "hpcllm.parallel",
        "hpcllm.parallel.data_parallel",
        "hpcllm.parallel.tensor",
        "hpcllm.topology",
    ]
    edges = import_edges(modules)
    got = {(e.importer, e.imported, e.line) for e in edges}
    assert got == {
        ("hpcllm.errors", "hpcllm.topology", 4),
        ("hpcllm.topology", "hpcllm.errors", 1),
        ("hpcllm.parallel.data_parallel", "hpcllm.model.gpt", 3),
        ("hpcllm.parallel.data_parallel", "hpcllm.kernels", 4),
        ("hpcllm.parallel.data_parallel", "hpcllm.parallel.tensor", 5),
        ("hpcllm.parallel.tensor", "hpcllm.errors", 1),
        ("hpcllm.parallel.tensor", "hpcllm", 2),
        ("hpcllm.model.gpt", "hpcllm.kernels", 1),
        ("hpcllm.kernels", "hpcllm.model.gpt", 2),
    }
    assert [e.written for e in edges if e.written] == ["hpcllm.gone"]

    upward = upward_imports(edges, LAYERS, tmp_path)
    assert sorted(upward) == [
        "kern/__init__.py:2  hpcllm.kernels (layer 7 data+kernels) -> "
        "hpcllm.model.gpt (layer 9 model)",
        "pkg/errors.py:4  hpcllm.errors (layer 3 errors) -> hpcllm.topology (layer 4 topology)",
        "pkg/parallel/data_parallel.py:3  hpcllm.parallel.data_parallel (layer 8 parallel) -> "
        "hpcllm.model.gpt (layer 9 model)",
    ]
    assert cycles(edges) == [
        ["hpcllm.errors", "hpcllm.topology"],
        ["hpcllm.kernels", "hpcllm.model.gpt"],
    ]
    report = cycle_report(edges, tmp_path)
    assert "    pkg/errors.py:4  hpcllm.errors -> hpcllm.topology" in report
    assert "    kern/__init__.py:2  hpcllm.kernels -> hpcllm.model.gpt" in report


def test_private_walker_sees_from_imports_attributes_and_aliases(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "__version__ = '0'\n",
            "pkg/a.py": "_secret = 1\n\ndef _helper():\n    return _secret\n",
            "pkg/b.py": (
                "from hpcllm.a import _helper  # a private name, imported\n"
                "from hpcllm import __version__  # dunder: public\n"
                "from hpcllm import a\n"
                "import hpcllm.a as alias\n"
                "\n"
                "def f():\n"
                "    from . import a as local\n"
                "    return a._secret + alias._secret + local._helper() + a.public\n"
            ),
            "pkg/c.py": "import os\n\nx = os._exit  # not hpcllm's\n",
        },
    )
    modules = find_modules(tmp_path, {"hpcllm": "pkg"})
    found = sorted((importer, name) for importer, name, _ in private_imports(modules))
    assert found == [
        ("hpcllm.b", "hpcllm.a._helper"),
        ("hpcllm.b", "hpcllm.a._helper"),
        ("hpcllm.b", "hpcllm.a._secret"),
        ("hpcllm.b", "hpcllm.a._secret"),
    ]


def test_layer_table():
    assert layer_of("hpcllm") == 0
    assert layer_of("hpcllm.__main__") == layer_of("hpcllm.cli") == len(LAYERS) - 1
    assert layer_of("hpcllm.parallel.pipeline.schedule") == layer_of("hpcllm.parallel")
    assert layer_of("hpcllm.datasets.reader") == layer_of("hpcllm.kernels.reference") == 7
    assert layer_of("hpcllm.somethingnew") is None
    assert layer_of("hpcllm.errorsx") is None


def test_the_architecture_map_states_this_layer_order():
    # docs/architecture.md lists the layers bottom to top, one numbered item each, naming its
    # modules in backticks; it must say what this test enforces.
    text = (REPO / "docs" / "architecture.md").read_text()
    items = re.findall(r"^\s*(\d+)\. ((?:`[\w.]+`(?:, )?)+):", text, flags=re.MULTILINE)
    stated = [re.findall(r"`([\w.]+)`", names) for _, names in items]
    assert [int(number) for number, _ in items] == list(range(len(LAYERS)))
    assert stated == [prefixes for _, prefixes in LAYERS]
