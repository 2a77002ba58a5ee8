"""SAEWorkerActor: encodes hidden-state blocks into top-k feature rows and stores them.

It acknowledges a block only after the StoreActor committed its rows. Encoding is idempotent (the
store keys batches by id), so a block whose worker died may simply be sent to another worker.
Placement: ``pipelines/cluster/actor_specs.py`` gives workers the configured custom resource, so on a
two-box cluster they run only on the box that offers it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch

from engine.services.sae_blocks import BlockMeta, HiddenBlock, encode_block
from engine.config import SAEConfig
from engine.model.devices import resolve_device
from engine.services.sae import SAEEncoder

from .versioning import code_version

__all__ = ["SAEWorkerActor"]


@ray.remote
class SAEWorkerActor:
    def __init__(self, sae: dict[str, Any], model_hidden_size: int, model_layers: int, model_id: str,
                 store: Any, timeout_s: float = 120.0, model_family: str | None = None) -> None:
        cfg = SAEConfig(**sae)
        self.encoder = SAEEncoder.load(cfg.sae_id, layer=cfg.layer, top_k=cfg.top_k,
                                       model_hidden_size=model_hidden_size, model_layers=model_layers,
                                       model_family=model_family,
                                       device=str(resolve_device(cfg.device)), dtype=cfg.dtype)
        self.model_id = model_id
        self.store = store
        self.timeout_s = timeout_s
        self.blocks_encoded = 0

    def version(self) -> str:
        return code_version()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def encode(self, hidden: np.ndarray, meta: BlockMeta) -> int:
        """``hidden (n, d)`` → rows in the store; returns the rows written (0 for a repeat)."""
        block = HiddenBlock.from_meta(meta, torch.from_numpy(np.asarray(hidden)))
        rows = encode_block(self.encoder, block, source_mode="nearline", model_id=self.model_id)
        written = ray.get(self.store.append.remote(rows, meta.batch_id, meta.request_id), timeout=self.timeout_s)
        self.blocks_encoded += 1
        return written

    def stats(self) -> dict[str, Any]:
        return {"blocks_encoded": self.blocks_encoded, "node_id": self.node_id(),
                "sae": self.encoder.identity.release}
