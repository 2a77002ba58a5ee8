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
