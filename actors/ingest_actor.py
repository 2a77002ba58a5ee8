"""IngestActor: batches observability payloads to the ingest backend.

``submit`` only enqueues. A flusher thread sends when ``batch_size`` payloads wait or every
``flush_interval_s``, through the one pooled client of :class:`engine.services.ingest_client.IngestClient`
(retries with backoff; what still fails is spooled to disk). Spooled payloads are replayed after
every successful send and on start — a restarted actor picks up what its predecessor spooled.
Delivery is at-least-once, keyed by request_id (the backend upserts). ``stats`` (what ``raylens
status`` shows) counts the payloads waiting in the spool and those given up on in
``spool/rejected/`` (refused, or the same failure ``ingest.reject_after`` times).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import ray

from engine.config import IngestConfig
from engine.services.ingest_client import DeliveryLedger, IngestClient, rejected_count, spooled_count

from .versioning import code_version

__all__ = ["IngestActor"]


@ray.remote
class IngestActor:
    def __init__(self, ingest: dict[str, Any], batch_size: int, flush_interval_s: float) -> None:
        self.config = IngestConfig(**ingest)
        self.client = IngestClient(self.config) if self.config.url else None
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self._queue: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._counts = {"submitted": 0, "delivered": 0, "spooled": 0, "dropped_without_url": 0}
        self._ledger = DeliveryLedger()  # per request id, so a job counts its own payloads
        if self.client is not None:
            self._replay()
            threading.Thread(target=self._flusher, name="raylens-ingest-flusher", daemon=True).start()

    def version(self) -> str:
        return code_version()

    def submit(self, payload: dict[str, Any]) -> None:
        with self._lock:
            self._counts["submitted"] += 1
            if self.client is None:  # no backend configured: payloads stay in the results only
                self._counts["dropped_without_url"] += 1
                self._ledger.record(payload, "dropped_without_url")
                return
            self._ledger.record(payload, "queued")
            self._queue.append(payload)
            if len(self._queue) >= self.batch_size:
                self._wake.set()

    def _take(self) -> list[dict[str, Any]]:
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()
        return batch

    def _replay(self) -> None:
        assert self.client is not None
        self.client.replay_spool()  # counted by the client (a send's own replays included)

    def flush(self) -> dict[str, Any]:
        """Send everything queued now (also called by the flusher thread)."""
        if self.client is None:
            return self.stats()
        for payload in self._take():
            delivery = self.client.send(payload)  # replays the spool after a success
            outcome = "delivered" if delivery.delivered else "spooled"
            with self._lock:
                self._counts[outcome] += 1
                self._ledger.record(payload, outcome)
        return self.stats()

    def _flusher(self) -> None:
        while True:
            self._wake.wait(timeout=self.flush_interval_s)
            self._wake.clear()
            self.flush()
            if self._spooled_files():
                self._replay()

    def _spooled_files(self) -> int:
        return spooled_count(self.config.spool_dir)

    def outcomes(self, request_ids: list[str]) -> dict[str, int]:
        """How the payloads of these request ids ended: a job's own delivered/spooled counts."""
        with self._lock:
            return self._ledger.counts(request_ids)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            queued = len(self._queue)
            counts = dict(self._counts)
        spool_files = self._spooled_files()  # before `replayed`: a file is counted before it goes
        replayed = self.client.replayed if self.client is not None else 0
        return {**counts, "replayed": replayed, "queued": queued, "spool_files": spool_files,
                "rejected_files": rejected_count(self.config.spool_dir), "url": self.config.url}
