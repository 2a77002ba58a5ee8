"""Ingest delivery: retries, spooling, replay and rejection, with httpx.MockTransport."""

from __future__ import annotations

import json

import httpx

from engine.config import IngestConfig
from engine.services.ingest_client import IngestClient, spool_path


def payload(rid: str) -> dict:
    return {"request": {"request_id": rid}, "events": [], "mod_calls": [], "mod_logs": [], "actions": []}


def client(tmp_path, handler, retries=2) -> IngestClient:
    cfg = IngestConfig(url="http://127.0.0.1:9/v1/ingest", retries=retries, spool_dir=str(tmp_path / "spool"))
    return IngestClient(cfg, transport=httpx.MockTransport(handler))


def test_delivers_on_201(tmp_path):
    seen = []

    def handler(request):
        seen.append(json.loads(request.content))
        return httpx.Response(201)

    with client(tmp_path, handler) as c:
        assert c.send(payload("r1")).delivered
    assert seen[0]["request"]["request_id"] == "r1"


def test_retries_5xx_then_succeeds(tmp_path):
    statuses = iter([503, 502, 201])

    with client(tmp_path, lambda r: httpx.Response(next(statuses))) as c:
        assert c.send(payload("r2")).delivered


def test_spools_when_the_backend_stays_down_and_replays_later(tmp_path):
    up = {"value": False}
    delivered = []

    def handler(request):
        if not up["value"]:
            raise httpx.ConnectError("refused")
        delivered.append(json.loads(request.content)["request"]["request_id"])
        return httpx.Response(201)

    with client(tmp_path, handler, retries=1) as c:
        first = c.send(payload("down/1"))  # a request id is never trusted as a path
        assert not first.delivered and first.spooled_to == str(spool_path(tmp_path / "spool", "down/1"))
        assert json.loads(open(first.spooled_to).read())["request"]["request_id"] == "down/1"
        up["value"] = True
        assert c.send(payload("up-2")).delivered
    assert delivered == ["up-2", "down/1"]  # the spooled payload was replayed after the next success
    assert list((tmp_path / "spool").glob("*.json")) == []


def test_a_rejected_payload_is_kept_for_inspection(tmp_path):
    with client(tmp_path, lambda r: httpx.Response(400, text="bad request: Invalid mod_call_sequence: 9")) as c:
        result = c.send(payload("bad"))
    assert not result.delivered and "rejected" in result.spooled_to
    kept = json.loads(open(result.spooled_to).read())
    assert "Invalid mod_call_sequence" in kept["rejected_because"] and kept["payload"]["request"]["request_id"] == "bad"


def test_request_ids_that_sanitise_alike_get_their_own_spool_files(tmp_path):
    # `a/b` and `a_b` read the same once made path-safe, and so do two long ids with one prefix
    long_a, long_b = "x" * 200 + "-a", "x" * 200 + "-b"
    ids = ["a/b", "a_b", "a:b", long_a, long_b]
    assert len({spool_path(tmp_path, rid) for rid in ids}) == len(ids)
    up = {"value": False}
    delivered = []

    def handler(request):
        if not up["value"]:
            raise httpx.ConnectError("refused")
        delivered.append(json.loads(request.content)["request"]["request_id"])
        return httpx.Response(201)

    with client(tmp_path, handler, retries=0) as c:
        for rid in ids:
            assert not c.send(payload(rid)).delivered
        assert len(list((tmp_path / "spool").glob("*.json"))) == len(ids)  # none overwrote another
        up["value"] = True
        assert c.replay_spool() == (len(ids), 0)
    assert sorted(delivered) == sorted(ids)


def test_a_payload_with_nan_is_sent_and_spooled_as_strict_json(tmp_path):
    bodies = []

    def handler(request):
        bodies.append(request.content)
        return httpx.Response(503)

    body = payload("nan")
    body["events"] = [{"event_type": "ForwardPass", "step": 1, "sequence_order": 0,
                       "top_tokens": [{"token": 3, "logprob": float("-inf"), "prob": 0.0}]}]
    with client(tmp_path, handler, retries=0) as c:
        result = c.send(body)

    def refuse(name):
        raise AssertionError(f"{name} written as JSON")

    sent = json.loads(bodies[0], parse_constant=refuse)
    spooled = json.loads(open(result.spooled_to).read(), parse_constant=refuse)
    assert sent["events"][0]["top_tokens"][0]["logprob"] is None and spooled == sent


def test_the_delivery_ledger_counts_only_the_asked_request_ids_and_forgets_the_oldest():
    from engine.services.ingest_client import DeliveryLedger

    ledger = DeliveryLedger(capacity=3)
    for rid, outcome in [("a", "queued"), ("b", "spooled"), ("a", "delivered"), ("c", "delivered")]:
        ledger.record({"request": {"request_id": rid}}, outcome)
    assert ledger.counts(["a", "b"]) == {"queued": 0, "delivered": 1, "spooled": 1, "dropped_without_url": 0,
                                         "unknown": 0}
    ledger.record({"request": {"request_id": "d"}}, "delivered")  # over capacity: the oldest (b) goes
    assert ledger.counts(["b", "c", "d", "zz"])["unknown"] == 2
    ledger.record({"no": "request"}, "delivered")  # a payload without an id is not counted
    assert ledger.counts(["c", "d"])["delivered"] == 2


def _refusing_until_up(up: dict):
    """A backend that refuses connections until ``up["value"]`` is set, then answers 201."""
    def handler(request):
        if not up["value"]:
            raise httpx.ConnectError("refused")
        return httpx.Response(201)
    return handler


def _spool_while_down(c: IngestClient, up: dict, ids: list[str]) -> None:
    for rid in ids:
        assert not c.send(payload(rid)).delivered
    up["value"] = True


def test_a_replayed_payload_is_counted_before_its_spool_file_goes(tmp_path, monkeypatch):
    # The actor reports `replayed` beside `spool_files`; whoever sees a file gone must see it counted.
    from pathlib import Path

    up = {"value": False}
    with client(tmp_path, _refusing_until_up(up), retries=0) as c:
        _spool_while_down(c, up, ["a", "b", "c"])
        seen_at_unlink = []
        unlink = Path.unlink

        def watched_unlink(self, missing_ok=False):
            if self.parent == tmp_path / "spool":
                seen_at_unlink.append(c.replayed)
            unlink(self, missing_ok=missing_ok)

        monkeypatch.setattr(Path, "unlink", watched_unlink)
        assert c.replay_spool() == (3, 0)
        assert seen_at_unlink == [1, 2, 3] and c.replayed == 3


def test_payloads_replayed_after_a_successful_send_are_counted(tmp_path):
    up = {"value": False}
    with client(tmp_path, _refusing_until_up(up), retries=0) as c:
        _spool_while_down(c, up, ["down-1", "down-2"])
        assert c.replayed == 0
        assert c.send(payload("up")).delivered  # its success replays the spool
        assert c.replayed == 2 and list((tmp_path / "spool").glob("*.json")) == []


def test_a_second_replay_while_one_runs_posts_no_payload_twice(tmp_path):
    import threading

    up = {"value": False}
    posted = []
    entered, release = threading.Event(), threading.Event()

    def handler(request):
        if not up["value"]:
            raise httpx.ConnectError("refused")
        posted.append(json.loads(request.content)["request"]["request_id"])
        entered.set()
        assert release.wait(timeout=30), "the test never released the first replay"
        return httpx.Response(201)

    with client(tmp_path, handler, retries=0) as c:
        _spool_while_down(c, up, ["p", "q", "r"])
        first = threading.Thread(target=c.replay_spool)
        first.start()
        try:
            assert entered.wait(timeout=30)
            assert c.replay_spool() == (0, 3)  # the running replay owns the spool: nothing posted here
        finally:
            release.set()
            first.join(timeout=30)
        assert not first.is_alive()
        assert sorted(posted) == ["p", "q", "r"] and c.replayed == 3


def test_a_spool_file_another_process_replayed_meanwhile_is_skipped_quietly(tmp_path, caplog):
    # Two clients (an engine and an actor, say) sharing one spool: while the first posts its oldest
    # file, the second replays everything; the first then finds the rest gone and is not alarmed.
    up = {"value": False}
    other = client(tmp_path, _refusing_until_up(up), retries=0)
    first_posts = []

    def handler(request):
        if not up["value"]:
            raise httpx.ConnectError("refused")
        first_posts.append(json.loads(request.content)["request"]["request_id"])
        if len(first_posts) == 1:
            assert other.replay_spool() == (3, 0)  # the other process empties the spool
        return httpx.Response(201)

    with client(tmp_path, handler, retries=0) as c, other:
        _spool_while_down(c, up, ["s1", "s2", "s3"])
        with caplog.at_level("ERROR", logger="raylens.ingest"):
            assert c.replay_spool() == (1, 0)
    assert len(first_posts) == 1 and other.replayed == 3
    assert not [r for r in caplog.records if "unreadable" in r.getMessage()]
