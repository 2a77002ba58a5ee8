"""Ingest never wedges: a NUL a mod logged is made storable before sending (and the payload says
so), so a loopback stand-in that refuses NUL as Postgres does (500) stores it once and it is never
posted again; a payload the backend keeps refusing with the same 5xx goes to ``spool/rejected/``
after ``ingest.reject_after`` deliveries instead of being re-posted for ever (and no longer holds
up the payloads behind it); a transient 5xx is never held against a payload; the request's
finish reason, error and tool calls go where the backend stores them (``inference_stats``)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from engine.config import IngestConfig
from engine.services.ingest_client import IngestClient, rejected_count, spooled_count
from engine.services.ingest_payload import PayloadBuilder
from tests.helpers import CharTokenizer, assert_payload_valid, loopback_http_server

pytestmark = pytest.mark.timeout(300)


class PostgresLikeBackend(BaseHTTPRequestHandler):
    """Stores a payload unless its JSON holds a ``\\u0000`` escape, which Postgres cannot turn into
    text: then 500, as the real backend answers. Counts every post per request id. (It reads the
    raw body, independently of raylens' own checks.)"""

    posts: Counter = Counter()
    stored: dict = {}
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        rid = json.loads(body)["request"]["request_id"]
        with self.lock:
            self.posts[rid] += 1
        if b"\\u0000" in body.lower():
            status, reply = 500, b'{"error": "unsupported Unicode escape sequence"}'
        else:
            with self.lock:
                self.stored[rid] = json.loads(body)
            status, reply = 201, b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def backend():
    PostgresLikeBackend.posts = Counter()
    PostgresLikeBackend.stored = {}
    with loopback_http_server(PostgresLikeBackend) as server:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/ingest"


def test_a_nul_in_mod_logs_is_stored_once_and_never_posted_again(backend, tmp_path):
    from engine import Engine
    from engine.config import RaylensConfig
    from mods import Prefilled, mod
    from tests.helpers import ScriptedBackend, build_generation_cfg

    @mod
    def nul_logger(event, actions, tokenizer):
        if isinstance(event, Prefilled):
            print("before\x00after")

    ingest = IngestConfig(url=backend, retries=1, spool_dir=str(tmp_path / "spool"))
    config = RaylensConfig(generation=build_generation_cfg(temperature=0.0, max_tokens=4), ingest=ingest)
    with Engine(config, backend=ScriptedBackend("ok")) as eng:
        first = eng.generate(prompt="q", mods=[nul_logger], request_id="nul-1")
        # control: the payload as built holds the NUL, and the stand-in refuses it as it is
        assert any("\x00" in e["log_message"] for e in first.payload["mod_logs"])
        raw = httpx.post(backend, content=json.dumps({**first.payload, "request": {
            **first.payload["request"], "request_id": "raw"}}), headers={"Content-Type": "application/json"})
        assert raw.status_code == 500
        assert first.metadata["ingest"]["delivered"] is True, first.metadata["ingest"]
        second = eng.generate(prompt="q", request_id="clean-2")
        assert second.metadata["ingest"]["delivered"] is True
    assert PostgresLikeBackend.posts["nul-1"] == 1, PostgresLikeBackend.posts  # stored once, never re-posted
    stored = PostgresLikeBackend.stored["nul-1"]
    assert_payload_valid(stored)
    logs = [e["log_message"] for e in stored["mod_logs"]]
    assert any("before\u2400after" in m for m in logs), logs
    note = [e for e in stored["mod_logs"] if e["log_message"].startswith("[raylens] replaced 1 NUL")]
    assert len(note) == 1 and note[0]["log_level"] == "WARNING" and note[0]["mod_name"] == "nul_logger", logs
    replaced = stored["request"]["inference_stats"]["text_replaced"]
    assert replaced["nul"] == 1 and replaced["fields"][0].startswith("mod_logs["), replaced
    assert spooled_count(tmp_path / "spool") == 0 and rejected_count(tmp_path / "spool") == 0


def _payload(rid: str) -> dict:
    return {"request": {"request_id": rid}, "events": [], "mod_calls": [], "mod_logs": [], "actions": []}


def _client(tmp_path, handler, **config) -> IngestClient:
    cfg = IngestConfig(url="http://127.0.0.1:9/v1/ingest", retries=0, spool_dir=str(tmp_path / "spool"), **config)
    return IngestClient(cfg, transport=httpx.MockTransport(handler))


def test_the_same_500_reject_after_times_sends_a_payload_to_rejected_and_it_is_not_posted_again(tmp_path):
    posts: Counter = Counter()

    def handler(request):
        rid = json.loads(request.content)["request"]["request_id"]
        posts[rid] += 1
        if rid.startswith("poison"):  # e.g. a value over a column's length: the database refuses it every time
            return httpx.Response(500, text=f"value too long for type character varying(255) (try {posts[rid]})")
        return httpx.Response(201)

    spool = tmp_path / "spool"
    with _client(tmp_path, handler, reject_after=3) as c:
        held = c.send(_payload("poison"))
        assert not held.delivered and spooled_count(spool) == 1
        for i in range(6):  # each success replays the spool: the poison is posted until its third answer
            assert c.send(_payload(f"ok-{i}")).delivered
    assert posts["poison"] == 3, posts
    assert spooled_count(spool) == 0 and rejected_count(spool) == 1
    [kept] = (spool / "rejected").glob("*.json")
    reason = json.loads(kept.read_text())["rejected_because"]
    assert "answered HTTP 500 3 times (ingest.reject_after = 3)" in reason and "try 3" in reason, reason
    assert not any((spool / "attempts").glob("*")), "the attempt ledger of a rejected payload is removed"


def test_a_payload_the_backend_keeps_refusing_no_longer_holds_up_the_ones_behind_it(tmp_path):
    up, delivered = {"value": False}, []

    def handler(request):
        rid = json.loads(request.content)["request"]["request_id"]
        if not up["value"]:
            raise httpx.ConnectError("down")
        if rid == "poison":
            return httpx.Response(500, text="database error")
        delivered.append(rid)
        return httpx.Response(201)

    with _client(tmp_path, handler, reject_after=5) as c:
        c.send(_payload("poison"))  # spooled first: the oldest file
        c.send(_payload("waiting"))
        up["value"] = True
        assert c.replay_spool() == (1, 1)  # the poison failed (counted), the next file went on
    assert delivered == ["waiting"]


@pytest.mark.parametrize("status", [502, 503, 504, 429])
def test_a_transient_answer_is_never_held_against_a_payload(tmp_path, status):
    with _client(tmp_path, lambda r: httpx.Response(status), reject_after=1) as c:
        for _ in range(3):
            assert not c.send(_payload("later")).delivered
            c.replay_spool()
    spool = tmp_path / "spool"
    assert spooled_count(spool) == 1 and rejected_count(spool) == 0


def test_the_requests_finish_reason_error_and_tool_calls_go_into_inference_stats():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    builder = PayloadBuilder("r1", tokenizer=CharTokenizer(), request={}, limits=IngestConfig())
    payload = builder.build(final_ids=[], final_text="", finish_reason="tool_calls", prompt_tokens=2,
                            extra={"tool_calls": [call], "error": None})
    assert_payload_valid(payload)
    stats = payload["request"]["inference_stats"]
    assert stats["finish_reason"] == "tool_calls" and stats["tool_calls"] == [call] and "error" not in stats
    assert not {"finish_reason", "tool_calls", "error"} & set(payload["request"]), "the backend would drop these"
    failed = PayloadBuilder("r2", tokenizer=CharTokenizer(), request={}, limits=IngestConfig()).build(
        final_ids=[], final_text="", finish_reason="error", prompt_tokens=2, extra={"error": "mod x failed"})
    assert failed["request"]["inference_stats"]["error"] == "mod x failed"
