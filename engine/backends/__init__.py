"""Model runtimes behind the :class:`~engine.backends.base.Backend` protocol."""

from __future__ import annotations

from ..config import BackendConfig
from .base import Backend, ModelInfo

__all__ = ["Backend", "ModelInfo", "create_backend"]


def create_backend(config: BackendConfig) -> Backend:
    """The backend named by ``config.backend_type`` (only ``huggingface`` exists today)."""
    from .hf import HuggingFaceBackend

    return HuggingFaceBackend(config)
