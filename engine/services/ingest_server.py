"""A development ingest server: the Concordance backend's ``POST /v1/ingest`` contract, locally.

For users without the Rust backend, and for tests. It checks each payload as the backend does
(the JSON schema, then the position cross-references the schema cannot express), refuses what the
backend's Postgres refuses to store — a NUL character or a lone surrogate in any string — with
the same 500 (raylens' client replaces those before sending), and keeps it in a DuckDB file,
upserting by ``request_id`` so a re-sent payload replaces the earlier one.

    POST /v1/ingest           201 (empty body) | 400 {"error": …} | 411 without Content-Length
                              | 413 over 75 MiB | 415 without a JSON content type
                              | 500 text the database cannot store
    GET  /v1/ingest           {"count": N, "request_ids": [...]}
    GET  /v1/ingest/<id>      the stored payload | 404
    GET  /healthz             {"ok": true}

Listens on 127.0.0.1 by default. Hardened as a shared dev service must be:

* a listen backlog of :data:`LISTEN_BACKLOG` (``socketserver``'s default is 5: a burst of
  concurrent posts overflowed it, and the overflowing clients were reset or left hanging);
* a read timeout per connection (``read_timeout_s``), so a client that stalls mid-request is
  dropped instead of holding a thread for ever;
* a malformed request gets a 4xx and the connection is then closed (its unread body must not be
  parsed as the next request): a ``Content-Length`` that is not a non-negative integer, nesting
  deeper than :data:`MAX_DEPTH` (serde_json's own limit), ``NaN``/``Infinity`` or a number out of
  float range — everything a strict JSON parser such as the backend's refuses.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import duckdb

from engine.errors import ConfigError
from engine.schemas import payload_validator
from engine.services.payload_text import unstorable_fields
from engine.services.strict_json import dumps

__all__ = ["IngestServer", "check_payload", "parse_strict_json", "MalformedJSON"]

log = logging.getLogger("raylens.ingest_server")

MAX_BODY = 75 * 1024 * 1024  # the backend's body limit
MAX_DEPTH = 128  # serde_json's recursion limit: the backend refuses deeper documents
LISTEN_BACKLOG = 128  # connections the kernel queues while every thread is busy
READ_TIMEOUT_S = 10.0


class MalformedJSON(ValueError):
    """A request body that a strict JSON parser refuses."""


def _no_constant(name: str) -> Any:
    raise MalformedJSON(f"{name} is not JSON (a strict parser refuses NaN and Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise MalformedJSON(f"number {text[:40]} is out of range")
    return value


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def parse_strict_json(body: bytes) -> Any:
    """Parse ``body`` as a strict JSON parser does, or raise :class:`MalformedJSON` saying why."""
    try:
        value = json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise MalformedJSON(f"nesting deeper than {MAX_DEPTH} levels") from None
    except MalformedJSON:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MalformedJSON(str(err)) from None
    if _depth(value) > MAX_DEPTH:
        raise MalformedJSON(f"nesting deeper than {MAX_DEPTH} levels")
    return value


def check_payload(payload: Any) -> str | None:
    """None if the backend would take ``payload``, else why not."""
    errors = sorted(payload_validator().iter_errors(payload), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.path) or "(root)"
        return f"invalid payload at {where}: {first.message}"
    events = payload.get("events") or []
    calls = payload.get("mod_calls") or []
    for call in calls:
        if not 0 <= call["event_sequence_order"] < len(events):
            return f"bad request: Invalid event_sequence_order: {call['event_sequence_order']}"
    for entry in (payload.get("mod_logs") or []) + (payload.get("actions") or []):
        if not 0 <= entry["mod_call_sequence"] < len(calls):
            return f"bad request: Invalid mod_call_sequence: {entry['mod_call_sequence']}"
    return None


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def setup(self) -> None:
        # StreamRequestHandler applies it to the socket; the class's default, per connection here
        self.timeout = self.server.read_timeout_s  # type: ignore[misc]
        super().setup()

    def _reply(self, status: int, body: Any = None, *, close: bool = False) -> None:
        """Answer; ``close`` when the request's body was not read (it must not be taken for the
        next request on this connection)."""
        data = b"" if body is None else dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        try:
            self._post()
        except (TimeoutError, ConnectionError):
            raise  # http.server drops the connection (a stalled or vanished client)
        except Exception as err:  # a bug here must not look like a network failure to the client
            log.exception("ingest server failed on a request")
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {type(err).__name__}"},
                        close=True)

    def _post(self) -> None:
        if self.path.rstrip("/") != "/v1/ingest":
            return self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"}, close=True)
        if "json" not in (self.headers.get("Content-Type") or ""):
            return self._reply(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": "Content-Type must be application/json"},
                               close=True)
        raw = self.headers.get("Content-Length")
        if raw is None:
            chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
            return self._reply(HTTPStatus.LENGTH_REQUIRED, {"error": "Content-Length is required" + (
                " (chunked bodies are not supported)" if chunked else "")}, close=True)
        raw = raw.strip()
        if not (raw.isascii() and raw.isdigit()):
            return self._reply(HTTPStatus.BAD_REQUEST, {
                "error": f"Content-Length must be a non-negative integer, got {raw[:40]!r}"}, close=True)
        length = int(raw)
        if length > MAX_BODY:
            return self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": "payload over 75 MiB"}, close=True)
        body = self.rfile.read(length)
        if len(body) < length:  # the client closed mid-body: nobody to answer
            self.close_connection = True
            return None
        try:
            payload = parse_strict_json(body)
        except MalformedJSON as err:
            return self._reply(HTTPStatus.BAD_REQUEST, {"error": f"malformed JSON: {err}"})
        problem = check_payload(payload)
        if problem is not None:
            return self._reply(HTTPStatus.BAD_REQUEST, {"error": problem})
        unstorable = unstorable_fields(payload)
        if unstorable:  # Postgres: "unsupported Unicode escape sequence", answered as a 500
            return self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, {
                "error": f"database error: unsupported Unicode escape sequence (\\u0000 or a lone surrogate cannot "
                         f"be converted to text) at {unstorable[0]}"})
        self.server.store(payload)
        self._reply(HTTPStatus.CREATED)

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.rstrip("/")
        if path == "/healthz":
            return self._reply(HTTPStatus.OK, {"ok": True})
        if path == "/v1/ingest":
            ids = self.server.request_ids()
            return self._reply(HTTPStatus.OK, {"count": len(ids), "request_ids": ids})
        if path.startswith("/v1/ingest/"):
            payload = self.server.fetch(unquote(path[len("/v1/ingest/"):]))
            if payload is None:
                return self._reply(HTTPStatus.NOT_FOUND, {"error": "unknown request_id"})
            return self._reply(HTTPStatus.OK, payload)
        self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})

    def log_message(self, format: str, *args: Any) -> None:  # keep test and CLI output quiet
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG  # socketserver's default of 5 overflows under a burst

    def __init__(self, address: tuple[str, int], db_path: Path, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.read_timeout_s = read_timeout_s
        db_path.parent.mkdir(parents=True, exist_ok=True)
        self._con = duckdb.connect(str(db_path))
        self._con.execute("CREATE TABLE IF NOT EXISTS ingested (request_id VARCHAR PRIMARY KEY, payload JSON NOT NULL, "
                          "received_at TIMESTAMPTZ NOT NULL, times_received INTEGER NOT NULL)")
        self._lock = threading.Lock()
        super().__init__(address, _Handler)

    def store(self, payload: dict[str, Any]) -> None:
        rid = payload["request"]["request_id"]
        with self._lock:
            self._con.execute(
                "INSERT INTO ingested VALUES (?, ?, ?, 1) ON CONFLICT (request_id) DO UPDATE SET "
                "payload = excluded.payload, received_at = excluded.received_at, "
                "times_received = ingested.times_received + 1",
                [rid, dumps(payload), datetime.now(timezone.utc)])

    def fetch(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            rows = self._con.execute("SELECT payload FROM ingested WHERE request_id = ?", [request_id]).fetchall()
        return json.loads(rows[0][0]) if rows else None

    def request_ids(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._con.execute("SELECT request_id FROM ingested ORDER BY received_at").fetchall()]

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            self._con.close()


class IngestServer:
    """``read_timeout_s``: how long one read from a client may wait before the connection is
    dropped (a stalled client otherwise holds its thread for ever)."""

    def __init__(self, db_path: str | Path, *, host: str = "127.0.0.1", port: int = 6767,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        if not read_timeout_s > 0:
            raise ConfigError(f"`read_timeout_s` must be > 0, got {read_timeout_s!r}", parameter="read_timeout_s",
                              value=read_timeout_s)
        self._server = _Server((host, port), Path(db_path), read_timeout_s)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        assert isinstance(host, str)  # an AF_INET server's address is (host, port)
        return f"http://{host}:{port}/v1/ingest"

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def start(self) -> "IngestServer":
        self._thread = threading.Thread(target=self._server.serve_forever, name="raylens-ingest-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
