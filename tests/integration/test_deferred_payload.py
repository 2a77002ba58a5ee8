"""A payload the engine sends nowhere (no ingest URL) is built when the result's ``payload`` is
first read, once, whoever reads it — and reads as if it had been built when the request ended."""

from __future__ import annotations

import pickle
import threading
import time
from datetime import datetime

import engine.services.ingest_payload as ingest_payload
from tests.helpers import assert_payload_valid


def test_a_payload_sent_nowhere_is_built_on_first_read_once_with_the_finish_time(engine, monkeypatch):
    built: list[str] = []
    original = ingest_payload.PayloadBuilder.build

    def counting(self, **kwargs):
        built.append(threading.current_thread().name)
        return original(self, **kwargs)

    monkeypatch.setattr(ingest_payload.PayloadBuilder, "build", counting)
    result = engine.generate("What is the capital of France?", max_tokens=6, temperature=0.0)
    finished = time.time()
    assert built == [], "the payload was built though nothing sends it and nobody read it"
    time.sleep(1.1)  # a read well after the end
    payloads: list[dict] = []
    readers = [threading.Thread(target=lambda: payloads.append(result.payload)) for _ in range(4)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(30)
    assert len(built) == 1 and len(payloads) == 4 and all(p is payloads[0] for p in payloads)
    payload = payloads[0]
    assert_payload_valid(payload)
    assert payload["request"]["final_text"] == result.output_text
    completed = datetime.fromisoformat(payload["request"]["completed_at"].replace("Z", "+00:00")).timestamp()
    assert completed <= finished, "completed_at is the time the payload was read, not when the request ended"
    assert result.payload is payload and len(built) == 1
    copied = pickle.loads(pickle.dumps(result))  # what a Ray result carries: the payload itself
    assert copied.payload == payload and len(built) == 1


def test_a_result_pickled_before_its_payload_was_read_carries_the_built_payload(engine):
    result = engine.generate("Name a colour.", max_tokens=4, temperature=0.0)
    copied = pickle.loads(pickle.dumps(result))
    assert isinstance(copied.payload, dict) and copied.payload == result.payload
    assert_payload_valid(copied.payload)


def test_a_mod_free_requests_step_records_are_made_when_its_payload_is_built(engine, monkeypatch):
    """A request nobody watched step by step gets its events when it ends; their payload records
    wait for the payload's build (with no ingest URL, its first read), in the events' order."""
    recorded: list[str] = []
    original = ingest_payload.PayloadBuilder.event

    def counting(self, event, top=None, at=None):
        recorded.append(type(event).__name__)
        return original(self, event, top, at)

    monkeypatch.setattr(ingest_payload.PayloadBuilder, "event", counting)
    result = engine.generate("What is the capital of France?", max_tokens=6, temperature=0.0)
    assert "Sampled" not in recorded and "Added" not in recorded, "step records were made at finish"
    payload = result.payload
    assert [e["event_type"] for e in payload["events"]] == [type(e).__name__ for e in result.events]
    assert [e["sequence_order"] for e in payload["events"]] == list(range(len(result.events)))
    assert sum(e["event_type"] == "ForwardPass" for e in payload["events"]) == len(result.output_ids)
    assert_payload_valid(payload)
