"""Delivering ingest payloads: one pooled httpx client, retries, and a disk spool.

Retry policy: httpx's transport retries only connection errors, so this loop retries connect
and read failures, 5xx and 429 (honouring ``Retry-After`` up to a cap) with exponential backoff.
A payload that still cannot be delivered is written to the spool directory and replayed after
the next successful delivery (or by :meth:`IngestClient.replay_spool`). A 4xx other than 429
means the backend rejects the payload itself: it goes to ``<spool>/rejected/`` with the
response, for a person to look at. Nothing is dropped.

Not every 5xx says "later": a database refusing a value answers 500 every time. An unreachable
backend, a 429 or a 502/503/504 is transient (a replay stops there and waits); any other 5xx is an
answer about that payload: the replay goes on with the next file, and a payload that got the same
status ``ingest.reject_after`` times (counted on disk, in ``<spool>/attempts/``, so restarts and
other processes count too) goes to ``rejected/`` with the backend's last answer. Before any post,
text Postgres cannot store (NUL, lone surrogates) is replaced and the payload says so
(:mod:`engine.services.payload_text`).

Delivery is at-least-once: the backend upserts by ``request_id``, so a replay after an
ambiguous failure is harmless. One replay runs at a time per client (a second caller, e.g. a send's
replay while a flusher thread replays, skips it rather than posting the same files again), and
:attr:`IngestClient.replayed` counts a spooled payload when its post succeeds, before its file
goes: whoever sees the spool empty sees every replayed payload counted.

Spool file names are ``<readable part of the id>-<hash of the whole id>.json``: the readable part
alone maps different ids to one file (``a/b`` and ``a_b``, or two long ids with one prefix), and
one payload would overwrite the other. Bodies are strict JSON (:mod:`engine.services.strict_json`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import httpx

from engine.config import IngestConfig
from engine.services.payload_text import storable
from engine.services.strict_json import dumps

__all__ = ["IngestClient", "Delivery", "spool_path", "spooled_count", "rejected_count"]

log = logging.getLogger("raylens.ingest")

_MAX_BACKOFF_S = 2.0
_MAX_RETRY_AFTER_S = 5.0
#: statuses that say "not now" (overloaded, a proxy without its upstream): never held against a payload
_TRANSIENT_STATUSES = frozenset({429, 502, 503, 504})


@dataclass(frozen=True)
class Delivery:
    """What became of one payload."""

    request_id: str
    delivered: bool
    status: int | None = None
    spooled_to: str | None = None
    error: str | None = None


def spool_path(spool_dir: str | Path, request_id: str, *, rejected: bool = False) -> Path:
    """The spool file of a request: one file per request id, never shared by two ids. The id is
    not trusted as a path: only ``[A-Za-z0-9._-]`` of it (at most 80 characters) is kept for
    readers, and a hash of the whole id makes the name unique."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", request_id)[:80].lstrip(".") or "request"
    digest = hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    root = Path(spool_dir) / "rejected" if rejected else Path(spool_dir)
    return root / f"{safe}-{digest}.json"


def _write_atomic(path: Path, payload: dict[str, Any], note: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # unique per writer (process and thread), so two writers never share a staging file
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    body = payload if note is None else {"payload": payload, "rejected_because": note}
    staging.write_text(dumps(body), encoding="utf-8")
    staging.replace(path)


def spooled_count(spool_dir: str | Path) -> int:
    """Payloads waiting in the spool (rejected ones, in ``rejected/``, are not waiting)."""
    root = Path(spool_dir)
    return len(list(root.glob("*.json"))) if root.is_dir() else 0


def rejected_count(spool_dir: str | Path) -> int:
    """Payloads given up on, kept in ``rejected/`` with the backend's answer."""
    root = Path(spool_dir) / "rejected"
    return len(list(root.glob("*.json"))) if root.is_dir() else 0


def _oldest_first(path: Path) -> float:
    """Sort key of spool files by age; one removed meanwhile (another process replayed it) sorts last."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


class IngestClient:
    def __init__(self, config: IngestConfig, *, transport: httpx.BaseTransport | None = None) -> None:
        if not config.url:
            raise ValueError("IngestClient needs ingest.url (QUOTE_LOG_INGEST_URL)")
        self.config = config
        self._client = httpx.Client(timeout=httpx.Timeout(config.timeout_s, connect=min(2.0, config.timeout_s)),
                                    transport=transport, headers={"Content-Type": "application/json"})
        self._replaying = threading.Lock()
        self._count_lock = threading.Lock()
        self._replayed = 0

    @property
    def replayed(self) -> int:
        """Spooled payloads delivered so far, by :meth:`replay_spool` or after a :meth:`send`."""
        with self._count_lock:
            return self._replayed

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "IngestClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _post(self, payload: dict[str, Any]) -> tuple[int | None, str | None, bool]:
        """One delivery with retries → (status, error, retryable)."""
        error: str | None = None
        status: int | None = None
        body = dumps(payload)
        for attempt in range(self.config.retries + 1):
            delay = min(_MAX_BACKOFF_S, 0.25 * 2**attempt)
            try:
                response = self._client.post(self.config.url, content=body)
            except httpx.TransportError as err:
                status, error = None, f"{type(err).__name__}: {err}"
            else:
                status = response.status_code
                if status < 300:
                    return status, None, False
                error = f"HTTP {status}: {response.text[:500]}"
                if status != 429 and status < 500:
                    return status, error, False
                retry_after = response.headers.get("Retry-After", "")
                if retry_after.replace(".", "", 1).isdigit():
                    delay = min(_MAX_RETRY_AFTER_S, float(retry_after))
            if attempt < self.config.retries:
                time.sleep(delay)
        return status, error, True

    def send(self, payload: dict[str, Any]) -> Delivery:
        payload = storable(payload)
        request_id = str(payload.get("request", {}).get("request_id", "request"))
        status, error, retryable = self._post(payload)
        if error is None:
            self.replay_spool()
            return Delivery(request_id, True, status)
        path = spool_path(self.config.spool_dir, request_id, rejected=not retryable)
        _write_atomic(path, payload, None if retryable else error)
        if retryable and _answered(status):
            path = self._held_against(path, payload, status, error)  # type: ignore[arg-type]
        log.warning("ingest of %s failed (%s); payload kept in %s", request_id, error, path)
        return Delivery(request_id, False, status, str(path), error)

    def _held_against(self, path: Path, payload: dict[str, Any], status: int, error: str | None) -> Path:
        """The backend answered ``status`` (a non-transient 5xx) for the payload spooled at
        ``path``: count it; the ``reject_after``-th answer with that status moves the payload to
        ``rejected/`` with the answer. Where the payload is now."""
        ledger = Path(self.config.spool_dir) / "attempts" / path.name
        try:
            seen = json.loads(ledger.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            seen = {}
        count = int(seen.get("count", 0)) + 1 if seen.get("status") == status else 1
        if count < self.config.reject_after:
            ledger.parent.mkdir(parents=True, exist_ok=True)
            ledger.write_text(json.dumps({"status": status, "count": count, "answer": error}), encoding="utf-8")
            return path
        rejected = Path(self.config.spool_dir) / "rejected" / path.name
        _write_atomic(rejected, payload, f"the backend answered HTTP {status} {count} times "
                                         f"(ingest.reject_after = {self.config.reject_after}); last: {error}")
        path.unlink(missing_ok=True)
        ledger.unlink(missing_ok=True)
        log.error("ingest gave up on %s after %d identical answers; kept in %s", path.name, count, rejected)
        return rejected

    def replay_spool(self) -> tuple[int, int]:
        """Send spooled payloads, oldest first → (delivered, still spooled). Stops at the first
        failure; delivers nothing when another replay of this client is running."""
        if not self._replaying.acquire(blocking=False):
            return 0, spooled_count(self.config.spool_dir)
        try:
            delivered = self._replay_files(Path(self.config.spool_dir))
        finally:
            self._replaying.release()
        return delivered, spooled_count(self.config.spool_dir)

    def _replay_files(self, root: Path) -> int:
        files = sorted(root.glob("*.json"), key=_oldest_first) if root.is_dir() else []
        delivered = 0
        for path in files:
            try:
                payload = storable(json.loads(path.read_text(encoding="utf-8")))  # spooled by an older version too
            except FileNotFoundError:  # replayed meanwhile by another process sharing the spool
                continue
            except (OSError, json.JSONDecodeError) as err:
                log.error("spool file %s is unreadable (%s); leaving it for inspection", path, err)
                continue
            status, error, retryable = self._post(payload)
            if error is None:
                with self._count_lock:  # counted before the file goes (see the module docstring)
                    self._replayed += 1
                path.unlink(missing_ok=True)
                (root / "attempts" / path.name).unlink(missing_ok=True)
                delivered += 1
            elif retryable and not _answered(status):
                break  # the backend is unreachable or says "not now": the rest waits too
            elif retryable:
                self._held_against(path, payload, status, error)  # type: ignore[arg-type]
            else:
                _write_atomic(root / "rejected" / path.name, payload, error)  # keeps its unique name
                path.unlink(missing_ok=True)
                (root / "attempts" / path.name).unlink(missing_ok=True)
        return delivered


def _answered(status: int | None) -> bool:
    """The backend answered about this payload (a 5xx that is not "not now"), rather than being
    unreachable or busy."""
    return status is not None and status >= 500 and status not in _TRANSIENT_STATUSES


class DeliveryLedger:
    """What became of each request's payload (``queued``, ``delivered``, ``spooled`` or
    ``dropped_without_url``), so a job can count its own payloads while other jobs share the
    sender. Holds the newest ``capacity`` request ids; older ones are forgotten first."""

    OUTCOMES = ("queued", "delivered", "spooled", "dropped_without_url")

    def __init__(self, capacity: int = 100_000) -> None:
        from collections import OrderedDict

        self.capacity = capacity
        self._outcomes: "OrderedDict[str, str]" = OrderedDict()

    def record(self, payload: dict[str, Any], outcome: str) -> None:
        request_id = (payload.get("request") or {}).get("request_id")
        if not isinstance(request_id, str):
            return
        self._outcomes[request_id] = outcome
        self._outcomes.move_to_end(request_id)
        while len(self._outcomes) > self.capacity:
            self._outcomes.popitem(last=False)

    def counts(self, request_ids: Sequence[str]) -> dict[str, int]:
        """How many of ``request_ids`` ended each way (``unknown``: never seen, or forgotten)."""
        out = {outcome: 0 for outcome in self.OUTCOMES}
        out["unknown"] = 0
        for request_id in request_ids:
            out[self._outcomes.get(request_id, "unknown")] += 1
        return out
