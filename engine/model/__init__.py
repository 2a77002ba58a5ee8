"""Model runtimes behind the :class:`~engine.model.backend.Backend` protocol."""

from __future__ import annotations

from engine.config import BackendConfig
from engine.model.backend import Backend, ModelInfo

__all__ = ["Backend", "ModelInfo", "create_backend"]


def create_backend(config: BackendConfig) -> Backend:
    """The backend named by ``config.backend_type`` (only ``huggingface`` exists today)."""
    from engine.model.hf import HuggingFaceBackend

    return HuggingFaceBackend(config)
