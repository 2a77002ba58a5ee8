"""Streaming requests on the engine: every route submits through :func:`submit` and nothing else.

Each HTTP or WebSocket request becomes one request in the engine's shared step loop
(``Engine.submit``); the handle yields :class:`TokenEvent` / :class:`Erased` as tokens are committed
or erased, ``result()`` gives the ``GenerationResult`` and ``cancel()`` frees the request's slot.
Keeping the call in one place means the server follows the engine's streaming interface here only.
"""

from __future__ import annotations

from typing import Any

from engine.core.inputs import GenerationRequest
from engine.core.stream import Erased, TokenEvent

__all__ = ["TokenEvent", "Erased", "submit"]


def submit(engine: Any, request: GenerationRequest, **options: Any) -> Any:
    """Start one request; raises the engine's typed errors for bad input before anything runs.
    ``options``: ``Engine.submit``'s own (``block``, ``timeout``), not request fields."""
    return engine.submit(request, **options)
