"""EmbedActor: one loaded model that turns chunks of texts into embedding rows.

Thin, as actors are: ``__init__`` builds an :class:`engine.Engine` from the config (without SAE,
store or ingest, which embedding never uses) and ``embed`` forwards to ``Engine.embed``. The
embedding job (``pipelines/jobs/embed.py``) creates it with the configured resources, sends it chunks
and kills it at the end; it holds no state besides the model, so a chunk may simply be resent.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import ray

from engine.config import RaylensConfig

__all__ = ["EmbedActor"]


@ray.remote
class EmbedActor:
    def __init__(self, config: dict[str, Any]) -> None:
        from engine import Engine

        cfg = RaylensConfig.from_dict(config)
        cfg = dataclasses.replace(cfg, activations=dataclasses.replace(cfg.activations, enabled=False),
                                  sae=dataclasses.replace(cfg.sae, enabled=False),
                                  ingest=dataclasses.replace(cfg.ingest, url=None))
        self.engine = Engine(cfg)

    def info(self) -> dict[str, Any]:
        info = self.engine.backend.info
        return {"model_id": info.model_id, "hidden_size": info.hidden_size, "num_layers": info.num_layers,
                "device": info.device}

    def embed(self, texts: list[str], layer: int | None, pool: str, batch_size: int) -> np.ndarray:
        """``(len(texts), d)`` float32; the same call always returns the same rows (idempotent)."""
        return self.engine.embed(texts, layer=layer, pool=pool, batch_size=batch_size)
