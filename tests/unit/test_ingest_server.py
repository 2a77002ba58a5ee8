"""The development ingest server: the backend's validation and status codes, on loopback."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.services.ingest_server import IngestServer
from tests.helpers import SHARED_DOCS


@pytest.fixture
def server(tmp_path):
    srv = IngestServer(tmp_path / "ingest.duckdb", port=0).start()
    yield srv
    srv.stop()


def payload(rid="r1", **overrides):
    body = {"request": {"request_id": rid}, "events": [{"event_type": "Prefilled", "step": 0, "sequence_order": 0}],
            "mod_calls": [{"event_sequence_order": 0, "mod_name": "m", "event_type": "Prefilled", "step": 0}],
            "mod_logs": [{"mod_call_sequence": 0, "mod_name": "m", "log_message": "hi"}], "actions": []}
    body.update(overrides)
    return body


def test_valid_payloads_are_stored_and_resending_replaces(server):
    with httpx.Client(timeout=10) as client:
        assert client.post(server.url, json=payload()).status_code == 201
        updated = payload(request={"request_id": "r1", "final_text": "second"})
        assert client.post(server.url, json=updated).status_code == 201
        assert client.get(server.url).json() == {"count": 1, "request_ids": ["r1"]}
        assert client.get(f"{server.url}/r1").json()["request"]["final_text"] == "second"
        assert client.get(f"{server.url}/nope").status_code == 404
        assert client.get(server.url.replace("/v1/ingest", "/healthz")).json() == {"ok": True}


def test_the_backends_sample_payload_is_accepted(server):
    sample = SHARED_DOCS / "sample_payload.json"
    if not sample.exists():
        pytest.skip("shared/docs is not beside this checkout")
    with httpx.Client(timeout=10) as client:
        assert client.post(server.url, content=sample.read_bytes(),
                           headers={"Content-Type": "application/json"}).status_code == 201


@pytest.mark.parametrize("body,message", [
    (payload(request={}), "request_id"),
    (payload(events=[{"event_type": "Bogus", "step": 0, "sequence_order": 0}]), "Bogus"),
    (payload(mod_calls=[{"event_sequence_order": 5, "mod_name": "m", "event_type": "Prefilled", "step": 0}]),
     "Invalid event_sequence_order: 5"),
    (payload(mod_logs=[{"mod_call_sequence": -1, "mod_name": "m", "log_message": "x"}]),
     "Invalid mod_call_sequence: -1"),
])
def test_invalid_payloads_get_400_with_the_reason(server, body, message):
    with httpx.Client(timeout=10) as client:
        response = client.post(server.url, json=body)
    assert response.status_code == 400 and message in response.json()["error"]


def test_malformed_json_and_wrong_content_type(server):
    with httpx.Client(timeout=10) as client:
        assert client.post(server.url, content=b"{nope", headers={"Content-Type": "application/json"}).status_code == 400
        assert client.post(server.url, content=json.dumps(payload()), headers={"Content-Type": "text/plain"}
                           ).status_code == 415


def test_the_packaged_schema_matches_the_shared_one():
    from engine.schemas import ingest_payload_schema

    shared = SHARED_DOCS / "ingest-payload.schema.json"
    if not shared.exists():
        pytest.skip("shared/docs is not beside this checkout")
    assert ingest_payload_schema() == json.loads(shared.read_text())


# ----------------------------------------------------------------------- hostile or broken clients


def _address(srv: IngestServer) -> tuple[str, int]:
    host, port = srv.url.split("//")[1].split("/")[0].split(":")
    return host, int(port)


def _raw(srv: IngestServer, request: bytes, *, timeout: float = 30.0) -> tuple[int, bytes]:
    """Send raw bytes on a fresh connection → (status, body); the server must answer, not hang up."""
    import socket

    with socket.create_connection(_address(srv), timeout=timeout) as sock:
        sock.sendall(request)
        return _read_response(sock)


def _read_response(sock) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer (got {data!r})"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next((line.split(b":", 1)[1] for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), b"0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-answer"
        body += chunk
    return int(head.split(b" ")[1]), body


def _post_bytes(body: bytes, *, length: str | None = None) -> bytes:
    return (b"POST /v1/ingest HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body) if length is None else length}\r\n".encode()
            + b"Connection: close\r\n\r\n" + body)


def test_a_burst_of_connections_waits_in_the_backlog_and_every_post_is_answered(tmp_path):
    import socket

    burst = 64
    srv = IngestServer(tmp_path / "ingest.duckdb", port=0)  # listening, not yet accepting: all must queue
    sockets = []
    try:
        for i in range(burst):
            sock = socket.socket()
            sock.settimeout(5)
            try:
                sock.connect(_address(srv))
            except OSError as err:
                sock.close()
                pytest.fail(f"connection {i + 1} of a burst of {burst} was not queued ({err!r}): the listen "
                            "backlog is too small (ingest_server.LISTEN_BACKLOG)")
            sockets.append(sock)
        srv.start()
        for i, sock in enumerate(sockets):
            sock.settimeout(30)
            sock.sendall(_post_bytes(json.dumps(payload(f"burst-{i}")).encode()))
        statuses = [_read_response(sock)[0] for sock in sockets]
        assert statuses == [201] * burst
        with httpx.Client(timeout=10) as client:
            assert client.get(srv.url).json()["count"] == burst
    finally:
        for sock in sockets:
            sock.close()
        srv.stop()


def test_concurrent_posts_are_all_stored(server):
    from concurrent.futures import ThreadPoolExecutor

    with httpx.Client(timeout=30, limits=httpx.Limits(max_connections=64)) as client:  # 64 connections at once
        with ThreadPoolExecutor(max_workers=64) as pool:
            statuses = list(pool.map(lambda i: client.post(server.url, json=payload(f"c-{i}")).status_code,
                                     range(64)))
        assert statuses == [201] * 64
        assert client.get(server.url).json()["count"] == 64


@pytest.mark.parametrize("partial", [
    b"POST /v1/ingest HTTP/1.1\r\nHost: test\r\n",  # stalls in the headers
    _post_bytes(b'{"request": ', length="100")[:-1],  # stalls in the body
])
def test_a_stalled_client_is_dropped_after_the_read_timeout_and_others_are_served(tmp_path, partial):
    import socket

    srv = IngestServer(tmp_path / "ingest.duckdb", port=0, read_timeout_s=0.5).start()
    try:
        with socket.create_connection(_address(srv), timeout=30) as stalled:
            stalled.sendall(partial)
            with httpx.Client(timeout=10) as client:  # served while the stalled client holds its thread
                assert client.post(srv.url, json=payload("meanwhile")).status_code == 201
            try:
                closed = stalled.recv(1024) == b""
            except ConnectionResetError:
                closed = True
            except socket.timeout:
                pytest.fail("the server kept a stalled client for 30 s; its read timeout is 0.5 s")
            assert closed
    finally:
        srv.stop()


@pytest.mark.parametrize("request_bytes,status,message", [
    (_post_bytes(b"{}", length="abc"), 400, "Content-Length must be a non-negative integer"),
    (_post_bytes(b"{}", length="-5"), 400, "Content-Length must be a non-negative integer"),
    (b"POST /v1/ingest HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n", 411,
     "Content-Length is required"),
    (_post_bytes(b"[" * 100_000 + b"]" * 100_000), 400, "nesting deeper than 128"),
    (_post_bytes(b'{"request": {"request_id": "n", "x": ' + b"[" * 200 + b"]" * 200 + b"}}"), 400,
     "nesting deeper than 128"),
    (_post_bytes(json.dumps(payload("nan", events=[{"event_type": "Prefilled", "step": 0, "sequence_order": 0,
                                                    "details": {"v": float("nan")}}])).encode()), 400,
     "NaN is not JSON"),
    (_post_bytes(b'{"request": {"request_id": "inf", "temperature": Infinity}}'), 400, "Infinity is not JSON"),
    (_post_bytes(b'{"request": {"request_id": "big", "temperature": 1e999}}'), 400, "out of range"),
])
def test_malformed_bodies_get_a_4xx_not_a_closed_connection(server, request_bytes, status, message):
    got, body = _raw(server, request_bytes)
    assert got == status and message in json.loads(body)["error"], (got, body[:200])


def test_nesting_within_the_backends_limit_is_accepted(server):
    # positive control for the nesting bound: 100 levels in a free-form field are fine
    deep = payload("deep", events=[{"event_type": "Prefilled", "step": 0, "sequence_order": 0,
                                    "details": json.loads("[" * 100 + "]" * 100)}])
    got, body = _raw(server, _post_bytes(json.dumps(deep).encode()))
    assert got == 201, body


@pytest.mark.parametrize("text", ["a\x00b", "lone \ud800 surrogate"])
def test_text_postgres_cannot_store_is_a_500_as_the_backend_answers_and_nothing_is_stored(server, text):
    from engine.services.strict_json import dumps

    with httpx.Client(timeout=10) as client:
        body = payload("bad", mod_logs=[{"mod_call_sequence": 0, "mod_name": "m", "log_message": text}])
        reply = client.post(server.url, content=dumps(body).encode("utf-8", "surrogatepass"),
                            headers={"Content-Type": "application/json"})
        assert reply.status_code == 500 and "mod_logs[0].log_message" in reply.json()["error"], reply.text
        assert client.get(server.url).json()["count"] == 0
        assert client.post(server.url, json=payload("good")).status_code == 201  # positive control
