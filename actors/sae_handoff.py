"""The generator side of the nearline hand-off: hidden-state blocks → SAE workers, bounded.

Per request, forwards are gathered into blocks of ``block_steps`` (engine's BlockAccumulator).
Each full block is copied to the host once (never per token), ``ray.put`` by the generator, noted
in the store's ledger (``expect_block``, fire-and-forget), and passed as a top-level ref to an
SAE worker, round-robin. At most ``max_inflight`` blocks are in flight; at the bound the token
loop waits in ``ray.wait`` for the oldest to finish — explicit back-pressure, measured as
``backlog_waits``.

Faults:
* a worker dies (``RayActorError``): the block's object is still owned by this generator, so it
  is re-sent to the next worker — the store's batch ids make a repeat harmless;
* encoding fails for another reason, or every retry is used up: the block is recorded in
  ``missing_blocks`` with the reason;
* this generator dies: its ``ray.put`` objects die with it (Ray cannot hand ownership over); the
  driver then calls ``StoreActor.abandon_request``, which turns the ledger's unstored blocks of
  that request into ``missing_blocks`` rows. A gap is always explained.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from engine.services.sae_blocks import BlockAccumulator, BlockMeta, HiddenBlock
from engine.model.backend import ForwardRecord

__all__ = ["RaySAESink", "HandoffStats"]

log = logging.getLogger("raylens.handoff")

_WORKER_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)


@dataclass
class _InFlight:
    hidden_ref: Any
    meta: BlockMeta
    worker: int
    attempts: int


@dataclass
class HandoffStats:
    blocks_submitted: int = 0
    blocks_stored: int = 0
    blocks_missing: int = 0
    resubmitted: int = 0
    rows_written: int = 0
    backlog_waits: int = 0
    max_inflight_seen: int = 0


class RaySAESink:
    def __init__(self, workers: list[Any], store: Any, *, layer: int, block_steps: int, max_inflight: int,
                 skip_first_position: bool = True, max_attempts: int = 3, timeout_s: float = 120.0) -> None:
        self.workers = list(workers)
        self.store = store
        self.max_inflight = max_inflight
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.stats = HandoffStats()
        self.blocks = BlockAccumulator(layer, self._submit, block_steps=block_steps,
                                       skip_first_position=skip_first_position)
        self._inflight: dict[Any, _InFlight] = {}
        self._next_worker = 0
        self._lock = threading.Lock()

    # HiddenSink
    def on_forward(self, request_id: str, step: int, record: ForwardRecord) -> None:
        self.blocks.on_forward(request_id, step, record)

    def finish(self, request_id: str) -> None:
        self.blocks.finish(request_id)

    @property
    def backlog(self) -> int:
        return len(self._inflight)

    def _submit(self, block: HiddenBlock) -> None:
        tensor = block.hidden().detach()
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; float32 holds it exactly
            tensor = tensor.float()
        hidden = tensor.cpu().numpy()  # one device→host copy per block, never per token
        meta = block.meta()
        self.store.expect_block.remote(**meta.ledger())
        hidden_ref = ray.put(hidden)
        while len(self._inflight) >= self.max_inflight:
            self.stats.backlog_waits += 1
            self._collect(block_until_one=True)
        with self._lock:
            self._send(_InFlight(hidden_ref, meta, self._next_worker, 0))
            self.stats.blocks_submitted += 1
            self.stats.max_inflight_seen = max(self.stats.max_inflight_seen, len(self._inflight))
        self._collect(block_until_one=False)

    def _send(self, item: _InFlight) -> None:
        worker = item.worker % len(self.workers)
        self._next_worker = worker + 1
        task = self.workers[worker].encode.remote(item.hidden_ref, item.meta)
        self._inflight[task] = _InFlight(item.hidden_ref, item.meta, worker, item.attempts + 1)

    def _collect(self, *, block_until_one: bool) -> None:
        """Settle finished hand-offs (no waiting unless ``block_until_one``)."""
        with self._lock:
            pending = list(self._inflight)
        if not pending:
            return
        ready, _ = ray.wait(pending, num_returns=1 if block_until_one else len(pending),
                            timeout=self.timeout_s if block_until_one else 0)
        for task in ready:
            with self._lock:
                item = self._inflight.pop(task, None)
            if item is not None:
                self._settle(task, item)

    def _settle(self, task: Any, item: _InFlight) -> None:
        try:
            self.stats.rows_written += ray.get(task, timeout=self.timeout_s)
            self.stats.blocks_stored += 1
            return
        except _WORKER_GONE as err:
            if item.attempts < self.max_attempts:
                self.stats.resubmitted += 1
                log.warning("SAE worker %d failed on block %s (%s); sending it to another worker", item.worker,
                            item.meta.batch_id, type(err).__name__)
                with self._lock:
                    self._send(_InFlight(item.hidden_ref, item.meta, item.worker + 1, item.attempts))
                return
            reason = f"every SAE worker attempt failed ({item.attempts}): {type(err).__name__}: {err}"
        except Exception as err:  # the encoding itself failed: retrying elsewhere would fail alike
            reason = f"{type(err).__name__}: {err}"
        self.stats.blocks_missing += 1
        self.store.record_missing.remote(**item.meta.ledger(), reason=reason[:2000])

    def drain(self) -> None:
        """Wait until every handed-off block is stored or recorded missing."""
        self.blocks.finish_all()
        while self._inflight:
            self._collect(block_until_one=True)
