"""The issue's crashing request over HTTP: a chat completion whose Lark grammar chains 5,000 rules
gets a 400 naming ``response_format.grammar`` — refused by the rule limit with the default config,
and, with the limits raised so that it reaches the compiler, after it killed a compile child — while
a neighbour's stream that was in flight completes with exactly the text it has alone, and the next
request succeeds. Bounded: a handful of requests of at most 32 tokens on a loopback server."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from tests.serve_helpers import openai_client, openai_server
from tests.helpers import lark_chain as chain

pytestmark = pytest.mark.timeout(600)

NEIGHBOUR = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]


def _neighbour(client, model_id: str, started: threading.Event | None = None) -> tuple[str, int]:
    """The neighbour's streamed text (greedy, 32 tokens) and how many chunks it had when ``started`` was set."""
    parts: list[str] = []
    stream = client.chat.completions.create(model=model_id, messages=NEIGHBOUR, max_tokens=32, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            if started is not None and not started.is_set():
                started.set()
    return "".join(parts), len(parts)


def _grammar_body(model_id: str, grammar: str) -> dict:
    return {"model": model_id, "messages": [{"role": "user", "content": "Write a."}], "max_tokens": 8,
            "response_format": {"type": "grammar", "grammar": grammar}}


@pytest.fixture(scope="module")
def open_engine(engine):
    """An engine on the session's model whose grammar limits let the 5,000-rule chain reach the
    compiler (it shares the model and the step loop; closing it leaves both running)."""
    from engine import Engine
    from engine.config import StructuredConfig

    limits = StructuredConfig(max_grammar_rules=100_000, max_grammar_bytes=1_000_000)
    with Engine(dataclasses.replace(engine.config, structured=limits), backend=engine.backend) as eng:
        yield eng


@pytest.mark.parametrize("limits", ["default", "raised"])
def test_the_5000_rule_grammar_is_a_400_a_neighbours_stream_is_unchanged_and_the_next_request_succeeds(
        engine, open_engine, model_id, limits):
    import httpx

    served = engine if limits == "default" else open_engine
    with openai_server(served, max_new_tokens=64, request_timeout_s=300) as url, \
            openai_client(url, timeout=300) as client, httpx.Client(base_url=url, timeout=300) as http:
        alone, _ = _neighbour(client, model_id)  # the reference: the neighbour's text with nothing beside it
        started, outcome = threading.Event(), {}
        thread = threading.Thread(target=lambda: outcome.update(text=_neighbour(client, model_id, started)))
        thread.start()
        assert started.wait(120), "the neighbour's stream never started"
        reply = http.post("/v1/chat/completions", json=_grammar_body(model_id, chain(5000)))
        thread.join(300)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == "response_format.grammar" and error["code"] == "invalid_request", error
        assert error["type"] == "invalid_request_error" and "mod" not in error["message"]
        says = "must define at most 2000 rules" if limits == "default" else "crashed the grammar compiler"
        assert says in error["message"], error["message"]
        text, chunks = outcome["text"]
        assert text == alone, f"the neighbour's stream changed beside the crash: {text!r} != {alone!r}"
        assert chunks > 1
        if limits == "raised":
            assert served.processor.grammars.pool.crashes == 1  # it did reach, and kill, a compile child
        after = http.post("/v1/chat/completions", json=_grammar_body(model_id, 'start: "a" "b"'))
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["message"]["content"] == "ab"
        assert http.get("/health").status_code == 200
