"""Which code an actor runs: detached named actors outlive jobs and keep the code they were
started with, so each reports this version and get-or-create replaces one that differs."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

__all__ = ["code_version"]

_PACKAGES = ("mods", "engine", "actors")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A digest of every ``.py`` file of the packages actors run."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
