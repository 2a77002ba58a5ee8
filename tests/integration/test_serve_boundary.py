"""Malformed input at the HTTP boundary gets a coded 4xx naming what is wrong, and the server stays
healthy: bodies that do not parse (truncated, not UTF-8, nested too deep), a chunked body past the
size limit (no Content-Length to refuse it by), a boolean where an integer belongs, a vanishing
temperature. Bounded: one request per case on a loopback server."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(300)

PROMPT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def http(engine):
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(max_message_bytes=64 * 1024, max_new_tokens=8)
    with serve_in_thread(build_app(engine, settings)) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def _chat(model_id: str, **fields) -> bytes:
    return json.dumps({"model": model_id, "messages": PROMPT, "max_tokens": 2, **fields}).encode()


@pytest.mark.parametrize(("name", "body", "status", "param", "says"), [
    ("truncated JSON", b'{"model": "x", "messages": [', 400, "body", "must be valid JSON"),
    ("invalid UTF-8", b'{"model": "\xff\xfe", "messages": []}', 400, "body", "UTF-8"),
    ("absurd nesting", b"[" * 30_000 + b"]" * 30_000, 400, "body", "nested"),
])
def test_a_body_that_cannot_be_parsed_is_a_coded_400(http, name, body, status, param, says):
    reply = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == status, (name, reply.text)
    error = reply.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == param and says in error["message"], error


def test_a_chunked_body_past_the_limit_is_413_not_a_parse_error(http):
    def chunks():
        for _ in range(100):  # 100 KiB, past the 64 KiB limit, with no Content-Length
            yield b" " * 1024

    reply = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"]["code"] == "message_too_large"


def test_a_boolean_is_not_taken_as_an_integer(http, engine):
    model = engine.backend.info.model_id
    reply = http.post("/v1/chat/completions", content=_chat(model, max_tokens=True),
                      headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens", reply.text
    ws_like = http.post("/api/v1/generate", json={"input_ids": engine.encode("hi"), "max_new_tokens": True})
    assert ws_like.status_code == 400 and ws_like.json()["parameter"] == "max_new_tokens", ws_like.text


def test_a_vanishing_temperature_is_refused_not_sampled_into_nan(http, engine):
    reply = http.post("/v1/chat/completions", content=_chat(engine.backend.info.model_id, temperature=1e-300),
                      headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "temperature" and "0 (greedy) or >=" in reply.json()["error"]["message"]


def test_the_server_stays_healthy_and_answers_after_every_bad_input(http, engine):
    assert http.get("/health").json()["ok"] is True
    assert http.get("/version").json()["version"]
    good = http.post("/v1/chat/completions", content=_chat(engine.backend.info.model_id, temperature=0),
                     headers={"content-type": "application/json"})
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize(("options", "stream", "param"), [
    ({"include_usage": True}, False, "stream_options"),
    ({"include_usage": True, "continuous": True}, True, "stream_options.continuous"),
    ({"include_usage": "yes"}, True, "stream_options.include_usage"),
])
def test_stream_options_are_honoured_or_refused_never_ignored(http, engine, options, stream, param):
    reply = http.post("/v1/chat/completions", content=_chat(engine.backend.info.model_id, stream=stream,
                                                            stream_options=options),
                      headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_a_mod_whose_top_level_code_never_returns_is_refused_and_the_server_stays_healthy(engine):
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(allow_mod_registration=True, mod_load_timeout_s=2.0)
    forever = {"name": "spin", "language": "python", "entrypoint": "m",
               "source": "while True:\n    pass\n\ndef m(event, tokenizer):\n    return None\n"}
    fine = {**forever, "name": "fine", "source": "def m(event, tokenizer):\n    return None\n"}
    with serve_in_thread(build_app(engine, settings)) as url, httpx.Client(base_url=url, timeout=60) as http:
        reply = http.post("/v1/mods", json=forever)  # answered at all: the probe was stopped
        assert reply.status_code == 400 and "must return within 2 s" in reply.json()["error"]["message"], reply.text
        assert http.post("/v1/mods", json=fine).status_code == 200  # positive control
        assert http.get("/health").status_code == 200
