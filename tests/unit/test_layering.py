"""Imports point downwards only: mods (numpy) <- engine (torch …) <- actors/pipelines (ray)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

FORBIDDEN = {
    "mods": {"torch", "transformers", "ray", "duckdb", "sae_lens", "engine", "actors", "pipelines", "httpx"},
    "engine": {"ray", "actors", "pipelines"},
    "actors": {"pipelines"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_no_layer_imports_upwards():
    violations = []
    for layer, forbidden in FORBIDDEN.items():
        for path in sorted((REPO / layer).rglob("*.py")):
            bad = _imports(path) & forbidden
            if bad:
                violations.append(f"{path.relative_to(REPO)} imports {sorted(bad)}")
    assert not violations, "imports that point the wrong way (mods <- engine <- actors/pipelines):\n" + "\n".join(violations)


def test_mods_import_only_numpy_and_the_standard_library():
    import sys

    stdlib = set(sys.stdlib_module_names)
    for path in (REPO / "mods").rglob("*.py"):
        third_party = {m for m in _imports(path) if m not in stdlib and m not in {"mods", "numpy"}}
        assert not third_party, f"{path.relative_to(REPO)} imports {sorted(third_party)}"


# Inside engine/: the model side (backend, KV cache, capture, sampling) knows nothing of the core
# (request state, rules, step loop) or of the services it feeds; services never reach into the core.
ENGINE_SUBLAYERS = {
    "model": {"engine.core", "engine.services", "engine.engine"},
    "services": {"engine.core", "engine.engine"},
}


def _engine_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_engine_model_and_services_do_not_import_the_core():
    violations = []
    for sub, forbidden in ENGINE_SUBLAYERS.items():
        for path in sorted((REPO / "engine" / sub).rglob("*.py")):
            bad = {m for m in _engine_imports(path) if any(m == f or m.startswith(f + ".") for f in forbidden)}
            if bad:
                violations.append(f"{path.relative_to(REPO)} imports {sorted(bad)}")
    assert not violations, "engine sub-layers import the wrong way:\n" + "\n".join(violations)


def _request_state_reads(source: str) -> list[str]:
    """Where ``source`` reaches a request's state: the ``state`` attribute (RequestMachine.state is
    the one way to it) or the RequestState name itself."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "state":
            found.append(f"line {node.lineno}: .state")
        elif isinstance(node, ast.Name) and node.id == "RequestState":
            found.append(f"line {node.lineno}: RequestState")
        elif isinstance(node, ast.ImportFrom) and any(a.name == "RequestState" for a in node.names):
            found.append(f"line {node.lineno}: imports RequestState")
    return found


def test_the_step_loop_and_the_scheduler_read_no_request_state():
    """The loop calls the scheduler, the runner and each request's machine, in order; the
    scheduler reads a request only through its machine's scheduling interface. Neither reaches a
    RequestState field: what a request knows is its machine's business alone."""
    positive = "def f(entry):\n    return entry.machine.state.generated\nfrom engine.core.request import RequestState\n"
    assert len(_request_state_reads(positive)) == 2, "positive control: the scan finds a .state read and the import"
    for name in ("step_loop.py", "scheduler.py"):
        found = _request_state_reads((REPO / "engine" / "core" / name).read_text(encoding="utf-8"))
        assert not found, f"engine/core/{name} reaches a request's state: {found}"
