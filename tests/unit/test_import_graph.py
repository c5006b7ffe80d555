"""No import circles among kvtier's modules (issue 13, "No import circles").

Every ``.py`` under the folders that pyproject maps into the ``kvtier`` import root is
parsed; each ``import`` (at module level or inside a function; relative or absolute)
that names a project module is an edge. ``from pkg import name`` is an edge to
``pkg.name`` where that is a module, else to ``pkg``'s ``__init__``. Importing
``a.b.c`` is an edge to ``a.b.c`` only: a package's ``__init__`` re-exporting a
submodule that imports a sibling is no circle. Imports under ``if TYPE_CHECKING:``
never run, so the graph leaves them out, except where one test asks for them: a circle
that only the type checker follows is still two modules that need each other. A
function-level import that dodges a circle at start-up is still a circle here: that
is the point.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules(root: Path) -> dict[str, Path]:
    """Module name -> file, from ``[tool.setuptools] package-dir``."""
    conf = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    out: dict[str, Path] = {}
    for prefix, folder in conf["package-dir"].items():
        base = root / folder
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            # The kvtier folder holds no mapped wing itself, so no name is claimed twice.
            assert name not in out, name
            out[name] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, *, in_functions: bool, type_only: bool = False
) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements outside ``if TYPE_CHECKING:`` blocks (inside them too with
    ``type_only``): at any depth, or (without ``in_functions``) only those that run when
    the module is imported."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not type_only:
            stack.extend(node.orelse)
            continue
        elif not in_functions and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        stack.extend(ast.iter_child_nodes(node))


def _edges(
    name: str,
    path: Path,
    modules: dict[str, Path],
    *,
    in_functions: bool = True,
    type_only: bool = False,
) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in _imports(tree, in_functions=in_functions, type_only=type_only):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join([*base, *([node.module] if node.module else [])])
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in modules:
                out.add(sub)
            elif target in modules:
                out.add(target)
    out.discard(name)
    return out


def graph(root: Path, *, in_functions: bool = True, type_only: bool = False) -> dict[str, set[str]]:
    """Each project module's imports of project modules (without ``in_functions``: only
    those that run when it is imported; with ``type_only``: also those for the type
    checker alone)."""
    modules = _modules(root)
    return {
        name: _edges(name, path, modules, in_functions=in_functions, type_only=type_only)
        for name, path in modules.items()
    }


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(comp: list[str], g: dict[str, set[str]]) -> str:
    members = set(comp)
    arrows = (f"{a} -> {b}" for a in comp for b in sorted(g[a] & members))
    return "; ".join(arrows)


def test_no_import_circles() -> None:
    g = graph(ROOT)
    assert len(g) > 100  # the mapping found the wings too
    found = cycles(g)
    assert not found, "import circles:\n" + "\n".join(_describe(c, g) for c in found)


def test_no_import_circles_through_type_only_imports() -> None:
    """An import under ``if TYPE_CHECKING:`` never runs, but the two modules still
    depend on each other: a design circle, however the interpreter is spared it."""
    g = graph(ROOT, type_only=True)
    found = cycles(g)
    assert not found, "import circles through type-only imports:\n" + "\n".join(
        _describe(c, g) for c in found
    )


# The layers, bottom first (docs/architecture.md): a module imports only its own part
# and the parts of lower layers, at module level or inside a function. The core is
# everything under kvtier/ but the CLI; the CLI is the composition root, on top.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("kvtier.policies",),
    ("kvtier.service",),
    ("kvtier.connectors", "kvtier.bench"),
    ("kvtier.cli",),
)


def part_of(module: str) -> str:
    """The part a module belongs to: a wing's or the CLI's package, else ``core``."""
    for layer in LAYERS[1:]:
        for part in layer:
            if module == part or module.startswith(f"{part}."):
                return part
    return "core"


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import from a part into another part of the same or a higher layer."""
    rank = {part: i for i, layer in enumerate(LAYERS) for part in layer}
    out = []
    for m, targets in g.items():
        for t in targets:
            a, b = part_of(m), part_of(t)
            if a != b and rank[b] >= rank[a]:
                out.append(f"{m} -> {t}")
    return sorted(out)


def test_the_layers_import_downward_only() -> None:
    """The core (kvtier/ but the CLI) imports no wing, not even inside a function; the
    policies import only the core; the daemon the policies and the core; connectors and
    benchmarks what lies below them; and only the CLI, the composition root, imports
    them all."""
    g = graph(ROOT)
    assert {part_of(m) for m in g} == {p for layer in LAYERS for p in layer}
    found = upward(g)
    assert not found, "imports that run against the layers:\n" + "\n".join(found)
    cli = ast.parse((ROOT / "kvtier" / "cli" / "__init__.py").read_text())
    assert "the composition root" in (ast.get_docstring(cli) or "")


def test_the_layer_check_sees_an_import_inside_a_function() -> None:
    g = {
        "kvtier.store.store": {"kvtier.keys"},
        "kvtier.keys": set(),
        "kvtier.factory": set(),
        "kvtier.policies.wiring": {"kvtier.factory"},
    }
    assert upward(g) == []
    g["kvtier.factory"] = {"kvtier.policies.wiring"}  # e.g. `def f(): from kvtier.policies...`
    g["kvtier.service.app"] = {"kvtier.connectors.vllm.settings", "kvtier.policies"}
    g["kvtier.bench.x"] = {"kvtier.connectors", "kvtier.cli.main"}
    assert upward(g) == [
        "kvtier.bench.x -> kvtier.cli.main",
        "kvtier.bench.x -> kvtier.connectors",
        "kvtier.factory -> kvtier.policies.wiring",
        "kvtier.service.app -> kvtier.connectors.vllm.settings",
    ]


def test_the_checker_sees_a_circle_dodged_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "kvtier" = "kvtier", "kvtier.bench" = "bench" }\n'
    )
    (tmp_path / "kvtier").mkdir()
    (tmp_path / "kvtier" / "__init__.py").write_text("")
    (tmp_path / "kvtier" / "leaf.py").write_text("")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("from kvtier.bench import a\n")
    (tmp_path / "bench" / "a.py").write_text(
        "from kvtier.bench import b\nfrom kvtier import leaf\n"
    )
    (tmp_path / "bench" / "b.py").write_text("def f():\n    from .a import x\n")
    g = graph(tmp_path)
    assert g["kvtier.bench"] == {"kvtier.bench.a"}
    assert cycles(g) == [["kvtier.bench.a", "kvtier.bench.b"]]
    (tmp_path / "bench" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"
    )
    assert cycles(graph(tmp_path)) == []
    assert cycles(graph(tmp_path, type_only=True)) == [["kvtier.bench.a", "kvtier.bench.b"]]
