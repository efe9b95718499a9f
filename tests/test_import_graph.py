"""No two modules of the package import each other, directly or through others.

An import circle makes a module's behaviour depend on which of the circle is imported first (a name read
before its module finished loading) and hides the layering the design draws (validators below the CLI, the
kernels' shared pieces below the kernels, the launcher interface below the launchers). Every import counts,
those inside functions too: a lazy import only moves the circle to run time.

The graph is read from the source (``ast``), without importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"v4launch": "v4launch", "validators": "v4launch.validators", "model": "v4launch.model",
                "checkpoints": "v4launch.checkpoints", "slurm": "v4launch.slurm", "recipes": "v4launch.recipes"}
"""Source folder -> the import name it is installed as (pyproject's package-dir)."""


def _modules() -> dict[str, tuple[Path, bool]]:
    """Import name -> (file, is a package ``__init__``)."""
    found = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join([package] + (parts[:-1] if is_package else parts))] = (path, is_package)
    return found


def _imports(name: str, path: Path, is_package: bool, modules: dict) -> set[str]:
    """The package's modules ``name`` imports anywhere in its file. ``from pkg import sub`` where ``sub`` is a
    module is an edge to ``sub`` alone (the package itself is already loaded as ``name``'s parent)."""
    here = name if is_package else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules]
            targets = submodules if len(submodules) == len(node.names) else [source, *submodules]
        else:
            continue
        edges.update(t for t in targets if t in modules and t != name)
    return edges


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in graph:
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
                    circles.append(sorted(component))
    return circles


def test_the_finder_sees_a_circle():
    """The check can fail: a circle of three and a self-contained pair are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_lazy_and_relative_imports_are_edges(tmp_path):
    """An import inside a function and a relative ``from . import`` both count."""
    (tmp_path / "one.py").write_text("def f():\n    from .two import g\n")
    (tmp_path / "two.py").write_text("from . import one\n")
    modules = {"p.one": (tmp_path / "one.py", False), "p.two": (tmp_path / "two.py", False), "p": (tmp_path, True)}
    assert _imports("p.one", tmp_path / "one.py", False, modules) == {"p.two"}
    assert _imports("p.two", tmp_path / "two.py", False, modules) == {"p.one"}


def test_no_module_imports_itself_through_others():
    modules = _modules()
    assert len(modules) > 100, "the source folders were not found"
    graph = {name: _imports(name, path, is_package, modules) for name, (path, is_package) in modules.items()}
    circles = _circles(graph)
    if circles:
        pytest.fail("import circles (each line: modules that reach each other through imports; move what they "
                    "share into a module that imports neither):\n" +
                    "\n".join(" <-> ".join(c) for c in circles))
