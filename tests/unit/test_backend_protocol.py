"""The Backend protocol declares everything the rest of the project uses (no model loaded)."""

from __future__ import annotations

import ast
import inspect

from engine.model.backend import Backend
from engine.model.hf import HuggingFaceBackend
from tests.helpers import REPO

# Read the code of these trees for attribute access on a backend; engine/model is the backends' own.
SCANNED = ("engine", "actors", "mods", "pipelines", "tests")


def _members(cls) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")} | set(getattr(cls, "__annotations__", {}))


def test_the_protocol_declares_what_the_engine_calls_and_the_hf_backend_has_it():
    declared = _members(Backend)
    assert {"device", "embed", "capture", "reference_model", "execute", "kv_layout"} <= declared
    methods = {name for name in declared if callable(getattr(Backend, name, None))
               or isinstance(getattr(Backend, name, None), property)}
    missing = {name for name in methods if not hasattr(HuggingFaceBackend, name)}
    assert not missing, f"HuggingFaceBackend lacks {sorted(missing)}"
    assert isinstance(inspect.getattr_static(HuggingFaceBackend, "reference_model"), property)


def test_the_runner_has_no_door_for_request_or_block_state():
    """Which request holds which block, reservations and the prefix index are the scheduler's KV
    manager's (engine/core/kv_manager.py): neither the protocol nor the HF runner offers them."""
    bookkeeping = {"acquire", "release", "reserve", "reuse_prefix", "cache_stats", "forward", "blocks"}
    assert not bookkeeping & _members(Backend)
    assert not bookkeeping & {name for name in dir(HuggingFaceBackend) if not name.startswith("_")}
    for path in sorted((REPO / "engine" / "model").rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        assert "engine.core" not in source.replace("`engine.core", ""), f"{path.name} imports the core"


def _backend_model_reads(source: str) -> list[int]:
    """Lines reading ``<...>backend.model`` (an undeclared attribute) in one file's source."""
    tree = ast.parse(source)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "model":
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            if name == "backend":
                lines.append(node.lineno)
    return lines


def test_nothing_outside_the_backends_reads_an_undeclared_backend_model():
    positive = ("m = engine.backend.model\nn = backend.model.config\n"
                "ok = backend.reference_model\nid = cfg.backend.model_id\n")
    assert _backend_model_reads(positive) == [1, 2], "positive control: the scan finds both spellings, only them"
    found = []
    for tree in SCANNED:
        for path in sorted((REPO / tree).rglob("*.py")):
            if path.is_relative_to(REPO / "engine" / "model"):
                continue
            source = path.read_text(encoding="utf-8")
            found += [f"{path.relative_to(REPO)}:{line}" for line in _backend_model_reads(source)]
    assert not found, f"use backend.reference_model (declared, for independent references) instead: {found}"
