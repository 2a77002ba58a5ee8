"""A development ingest server: the Concordance backend's ``POST /v1/ingest`` contract, locally.

For users without the Rust backend, and for tests. It checks each payload as the backend does
(the JSON schema, then the position cross-references the schema cannot express) and keeps it in
a DuckDB file, upserting by ``request_id`` so a re-sent payload replaces the earlier one.

    POST /v1/ingest           201 (empty body) | 400 {"error": …} | 415 without a JSON content type
    GET  /v1/ingest           {"count": N, "request_ids": [...]}
    GET  /v1/ingest/<id>      the stored payload | 404
    GET  /healthz             {"ok": true}

Listens on 127.0.0.1 by default.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import duckdb

from engine.schemas import payload_validator

__all__ = ["IngestServer", "check_payload"]

MAX_BODY = 75 * 1024 * 1024  # the backend's body limit


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

    def _reply(self, status: int, body: Any = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") != "/v1/ingest":
            return self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})
        if "json" not in (self.headers.get("Content-Type") or ""):
            return self._reply(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, {"error": "Content-Type must be application/json"})
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            return self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": "payload over 75 MiB"})
        try:
            payload = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return self._reply(HTTPStatus.BAD_REQUEST, {"error": f"malformed JSON: {err}"})
        problem = check_payload(payload)
        if problem is not None:
            return self._reply(HTTPStatus.BAD_REQUEST, {"error": problem})
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

    def __init__(self, address: tuple[str, int], db_path: Path) -> None:
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
                [rid, json.dumps(payload), datetime.now(timezone.utc)])

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
    def __init__(self, db_path: str | Path, *, host: str = "127.0.0.1", port: int = 6767) -> None:
        self._server = _Server((host, port), Path(db_path))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
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
