"""The SAE hand-off's Ray transport: hidden-state blocks → SAE worker actors → the StoreActor.

The hand-off itself (blocks, the bound, retries, stats, missing blocks) is the engine's
:class:`engine.services.sae_handoff.SAEHandoff`; this module only carries blocks. Each block is
copied to the host once (never per token), ``ray.put`` by the generator and noted in the store's
ledger (``expect_block``, fire-and-forget) — once, in :meth:`RayWorkerTransport.prepare`; each
attempt passes the same top-level ref to the next SAE worker, round-robin, which stores the rows
and answers how many it wrote.

Faults:
* a worker dies (``RayActorError``) or its encoding fails: the hand-off's retry policy sends the
  block again, to the next worker — the block's object is still owned by this generator, and the
  store's batch ids make a repeat harmless; when every attempt failed the block is recorded in
  ``missing_blocks`` with the reason;
* this generator dies: its ``ray.put`` objects die with it (Ray cannot hand ownership over); the
  driver then calls ``StoreActor.abandon_request``, which turns the ledger's unstored blocks of
  that request into ``missing_blocks`` rows. A gap is always explained.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import ray
import torch

from engine.errors import ConfigError
from engine.services.sae_blocks import BlockMeta, HiddenBlock
from engine.services.sae_handoff import HandoffMode
from engine.services.sae import SAEEncoder

__all__ = ["RayWorkerTransport", "Shipment"]


@dataclass
class Shipment:
    """A block as it travels: the ref of its hidden states, its meta, and the worker it went to
    last (so a retry goes to the next one, never straight back to a worker that just failed)."""

    hidden_ref: Any
    meta: BlockMeta
    worker: int | None = None


class RayWorkerTransport:
    """:class:`engine.services.sae_handoff.BlockTransport` over SAE worker actors."""

    mode: HandoffMode = "ray-workers"
    encoder: SAEEncoder | None = None  # the SAE runs on the workers

    def __init__(self, workers: list[Any], store: Any) -> None:
        if not workers:
            raise ConfigError("`workers` must hold at least one SAE worker, got none; set ray.sae_workers >= 1",
                              parameter="workers", value=workers)
        self.workers = list(workers)
        self.store = store
        self._next_worker = 0
        self._lock = threading.Lock()  # sends come from the step loop and from drain()

    def prepare(self, block: HiddenBlock) -> Shipment:
        """The block's hidden states ``(n, d)`` as a float numpy object in Ray's store: one
        device→host copy per block, whatever the attempts."""
        tensor = block.hidden().detach()
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
            tensor = tensor.float()
        meta = block.meta()
        self.store.expect_block.remote(**meta.ledger())
        return Shipment(ray.put(tensor.cpu().numpy()), meta)

    def send(self, shipment: Shipment) -> "Future[int]":
        """Round-robin for a first attempt; a retry goes to the worker after the one that failed."""
        with self._lock:
            if shipment.worker is None:
                shipment.worker, self._next_worker = self._next_worker, self._next_worker + 1
            else:
                shipment.worker += 1
            worker = self.workers[shipment.worker % len(self.workers)]
        return worker.encode.remote(shipment.hidden_ref, shipment.meta).future()

    def record_missing(self, meta: BlockMeta, reason: str) -> None:
        self.store.record_missing.remote(**meta.ledger(), reason=reason)

    def close(self) -> None:
        """Nothing to stop: the workers belong to the topology."""
