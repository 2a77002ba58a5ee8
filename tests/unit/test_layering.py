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
