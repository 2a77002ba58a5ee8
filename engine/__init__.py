"""The Ray-free core of raylens: backends, the generation loop, internals, config, ingest.

``from engine import Engine`` is the in-process entry point. Submodules load lazily so that
``engine.config`` (used by store queries and the CLI) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "GenerationResult", "FinishReason", "load_config"]

if TYPE_CHECKING:
    from engine.config import load_config
    from engine.engine import Engine
    from engine.core.result import FinishReason, GenerationResult


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name in ("GenerationResult", "FinishReason"):
        from engine.core import result

        return getattr(result, name)
    if name == "load_config":
        from engine.config import load_config

        return load_config
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
