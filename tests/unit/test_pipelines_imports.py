"""pipelines/ keeps the shape its docstring gives: no import cycle, each subpackage imports only the
ones below it, and no module grows past 500 lines.

Every import counts, the ones inside functions too: a lazy import that closes a circle is still a
circle a reader has to untangle, it only fails later.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PIPELINES = REPO / "pipelines"
MAX_LINES = 500

# Subpackage -> the other pipelines subpackages it may import (pipelines/__init__.py says why).
ALLOWED = {
    "cluster": set(),
    "sae_training": set(),
    "jobs": {"cluster"},
    "serve": {"cluster"},
    "bench": {"cluster", "jobs", "serve"},
    "cli": {"cluster", "jobs", "serve", "bench", "sae_training"},
}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, package: str = "pipelines") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, relative imports resolved. ``from a import
    b`` points at ``a.b`` when that is a module, else at ``a``."""
    files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[:len(here) - (node.level - 1)]
                    base = ".".join(here + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in files else base)
        graph[name] = set()
        for target in targets:
            while target and target not in files:  # `import pipelines.x.y` names a module; keep the longest one
                target = target.rpartition(".")[0]
            if target and target != name and (target == package or target.startswith(package + ".")):
                graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, …, a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_sees_relative_lazy_and_package_imports(tmp_path):
    pkg = tmp_path / "pipelines"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from . import one\n")
    (pkg / "a" / "one.py").write_text("def f():\n    from ..b.two import g\n")
    (pkg / "b").mkdir()
    (pkg / "b" / "__init__.py").write_text("")
    (pkg / "b" / "two.py").write_text("import pipelines.a.one\nimport json\n")
    graph = import_graph(tmp_path)
    assert graph["pipelines.a"] == {"pipelines.a.one"}
    assert graph["pipelines.a.one"] == {"pipelines.b.two"}
    assert graph["pipelines.b.two"] == {"pipelines.a.one"}
    assert find_cycle(graph) == ["pipelines.a.one", "pipelines.b.two", "pipelines.a.one"]
    (pkg / "b" / "two.py").write_text("import json\n")
    assert find_cycle(import_graph(tmp_path)) is None


def test_pipelines_has_no_import_cycle():
    graph = import_graph(REPO)
    assert graph["pipelines.cluster.topology"] >= {"pipelines.cluster.actor_specs"}  # the graph is not empty
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in pipelines/: " + " -> ".join(cycle or [])


def test_each_subpackage_imports_only_the_ones_below_it():
    graph = import_graph(REPO)
    subpackages = {p.name for p in PIPELINES.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == set(ALLOWED), "a new subpackage: give it a place in ALLOWED and in pipelines/__init__.py"
    violations = []
    for module, targets in sorted(graph.items()):
        if module == "pipelines":
            continue
        own = module.split(".")[1]
        for target in sorted(targets):
            other = target.split(".")[1] if target != "pipelines" else "pipelines"
            if other != own and other not in ALLOWED.get(own, set()):
                violations.append(f"{module} imports {target}")
    assert not violations, "imports against pipelines/__init__.py's rules:\n" + "\n".join(violations)


def test_no_pipelines_module_is_over_500_lines():
    long = {str(p.relative_to(REPO)): n for p in sorted(PIPELINES.rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"pipelines modules over {MAX_LINES} lines (split them by job): {long}"
