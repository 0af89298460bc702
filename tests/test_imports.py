"""The package's import graph, read with ``ast``: no import circle between its modules, no private name imported
across them.

Every import of a module of the package counts, wherever it stands: at module level, inside a function (a deferred
import still makes the two modules depend on each other; the issue that asked for this test counted such circles)
and under ``if TYPE_CHECKING:`` (a type-only import is still a module a reader must have read first). An edge goes
to the module named: ``from lightning_hydra.planner import cost`` to ``lightning_hydra.planner.cost`` where that is
a module, ``from lightning_hydra.planner import schedule`` to the package ``lightning_hydra.planner`` (its
``__init__``); importing a submodule is no edge to the packages above it, which Python runs first whatever imports
them. A private name is one with a leading underscore; importing a private *module* (``_environ``, ``_lazy``) of the
package is not flagged, only names imported from another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_hydra"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str, int]]:
    """``(imported module, imported name or "", line)`` of every import of a package module in ``path``."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target:
                    out.append((target, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source not in known:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.append((sub, "", node.lineno) if sub in known else (source, alias.name, node.lineno))
    return out


def graph() -> tuple[dict[str, dict[str, int]], list[str]]:
    """The import edges ``importer -> {imported: first line}`` and the private names imported across modules."""
    known = modules()
    edges: dict[str, dict[str, int]] = {name: {} for name in known}
    private = []
    for name, path in known.items():
        for target, imported, line in imports(name, path, known):
            if target != name:
                edges[name].setdefault(target, line)
            if imported.startswith("_") and target != name:
                private.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported} from {target}")
    return edges, private


def circles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
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
    return found


def test_no_import_circle():
    edges, _ = graph()
    found = circles(edges)
    lines = [
        f"{' <-> '.join(c)}: " + ", ".join(f"{a} -> {b} (line {edges[a][b]})" for a in c for b in edges[a] if b in c)
        for c in found
    ]
    assert not found, "import circles:\n" + "\n".join(lines)


def test_no_private_name_across_modules():
    _, private = graph()
    assert not private, "private names imported from another module:\n" + "\n".join(private)


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {}}, []),
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}, [["a", "b", "c"]]),
        ({"a": {"b": 1}, "b": {"a": 1}, "c": {"d": 1}, "d": {"c": 1}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_circles_finds_every_circle(edges, expected):
    assert sorted(circles(edges)) == expected


def test_imports_resolve_relative_function_level_and_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (pkg / name).touch()
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .. import a\n"
        "if TYPE_CHECKING:\n    from pkg.a import _Hidden\n"
        "def f():\n    from pkg import thing\n"
    )
    known = {"pkg": pkg / "__init__.py", "pkg.a": pkg / "a.py", "pkg.sub": pkg / "sub/__init__.py"}
    known["pkg.sub.b"] = pkg / "sub/b.py"
    assert imports("pkg.sub.b", known["pkg.sub.b"], known) == [
        ("pkg.a", "", 2),
        ("pkg.a", "_Hidden", 4),
        ("pkg", "thing", 6),
    ]
