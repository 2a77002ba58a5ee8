"""Engine-level behaviour: concurrency, chat input, payload delivery to a real loopback server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from engine import Engine
from mods import Added, mod
from tests.helpers import assert_payload_valid, build_config, loopback_http_server

PROMPTS = ("What is the capital of France?", "Name a primary colour.")


def printing_mod(tag: str):
    @mod
    def announce(event, actions, tokenizer):
        if isinstance(event, Added):
            print(f"{tag}:{event.step}")

    announce.__name__ = f"announce_{tag}"
    return announce


def test_concurrent_generations_keep_outputs_and_mod_logs_apart(engine):
    sequential = [engine.generate(p, max_tokens=10, temperature=0.0).output_ids for p in PROMPTS]
    results: dict[int, object] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(PROMPTS))

    def work(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = engine.generate(PROMPTS[i], mods=[printing_mod(f"req{i}")], max_tokens=10, temperature=0.0)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i, result in results.items():
        assert result.output_ids == sequential[i], "a concurrent request changed another's tokens"
        logs = "".join(entry["log_message"] for entry in result.payload["mod_logs"])
        other = f"req{1 - i}:"
        assert f"req{i}:0" in logs and other not in logs, f"request {i} got foreign mod logs"
        assert_payload_valid(result.payload)


def test_messages_and_prompt_give_the_same_tokens(engine):
    assert engine.encode("Hi there") == engine.encode(messages=[{"role": "user", "content": "Hi there"}])
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        engine.generate(messages=[{"content": "no role"}])


def test_payload_records_mod_calls_logs_and_actions_with_timing(engine):
    @mod
    def nudger(event, actions, tokenizer):
        if isinstance(event, Added) and event.step == 1:
            print("forcing now")
            return actions.force_tokens(tokenizer.encode(" indeed", add_special_tokens=False))

    result = engine.generate("What is the capital of France?", mods=[nudger], max_tokens=12, temperature=0.0,
                             payload_top_tokens=True)
    payload = result.payload
    assert_payload_valid(payload)
    (call,) = payload["mod_calls"]
    assert call["mod_name"] == "nudger" and call["event_type"] == "Added" and call["execution_time_ms"] >= 0
    assert payload["events"][call["event_sequence_order"]]["event_type"] == "Added"
    assert payload["mod_logs"][0]["log_message"] == "forcing now\n"
    (action,) = payload["actions"]
    assert action["action_type"] == "ForceTokens" and action["token_count"] == len(action["tokens"])
    forward = next(e for e in payload["events"] if e["event_type"] == "ForwardPass")
    assert len(forward["top_tokens"]) == 20 and forward["input_text"]
    assert payload["request"]["final_text"] == result.output_text
    assert payload["request"]["mod_text"] == "nudger"


class _Collector(BaseHTTPRequestHandler):
    received: list[dict] = []
    status = 201

    def do_POST(self):  # noqa: N802 (http.server naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).received.append(json.loads(body))
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def collector():
    _Collector.received = []
    with loopback_http_server(_Collector) as server:
        yield server


def test_payload_is_posted_when_an_ingest_url_is_set_and_spooled_when_down(engine, collector, tmp_path):
    url = f"http://127.0.0.1:{collector.server_address[1]}/v1/ingest"
    cfg = build_config()
    cfg = type(cfg)(backend=cfg.backend, generation=cfg.generation,
                    ingest=type(cfg.ingest)(url=url, retries=1, timeout_s=5, spool_dir=str(tmp_path / "spool")))
    sender = Engine(cfg, backend=engine.backend)  # share the loaded model
    try:
        delivered = sender.generate("Hello", max_tokens=3, temperature=0.0)
        assert delivered.metadata["ingest"]["delivered"]
        assert _Collector.received[-1]["request"]["request_id"] == delivered.request_id
        # a payload that is sent lists each step's top tokens by default (generation.payload_top_tokens)
        forwards = [e for e in _Collector.received[-1]["events"] if e["event_type"] == "ForwardPass"]
        assert forwards and all(len(e["top_tokens"]) == 20 for e in forwards)
        _Collector.status = 503  # the backend falls over
        kept = sender.generate("Hello", max_tokens=3, temperature=0.0)
        assert not kept.metadata["ingest"]["delivered"]
        assert json.loads(open(kept.metadata["ingest"]["spooled_to"]).read())["request"]["request_id"] == kept.request_id
        _Collector.status = 201  # back up: the next delivery replays the spool
        sender.generate("Hello", max_tokens=3, temperature=0.0)
        ids = [p["request"]["request_id"] for p in _Collector.received]
        assert kept.request_id in ids and not list((tmp_path / "spool").glob("*.json"))
    finally:
        _Collector.status = 201
        sender.close()
