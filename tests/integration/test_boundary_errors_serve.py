"""The issue's "unclear now" cases over HTTP, each a coded 4xx naming its field in ``param``: chat
``content: null`` (was a 500), a string ``logit_bias`` value (was accepted), ``n: 2`` with the
largest seed (was refused naming a seed the caller never sent: now choice ``i`` is seeded
``(seed + i) mod 2**64``), a prompt larger than the whole KV pool (ran for seconds and ended as a
mod error: now refused on arrival naming ``backend.kv_cache_tokens``), and a grammar that fails at
a step (was ``mod_error`` with ``param: null``: now ``invalid_request`` naming its field). Bounded:
one or two requests of at most 8 tokens per case."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import build_config
from tests.serve_helpers import openai_server

pytestmark = pytest.mark.timeout(600)

HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def http(engine):
    import httpx

    with openai_server(engine, max_new_tokens=16, request_timeout_s=120) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        yield client


def _chat(http, model_id, **fields):
    return http.post("/v1/chat/completions", json={"model": model_id, "messages": HI, "max_tokens": 4, **fields})


def _refused(reply, param: str, code: str = "invalid_request") -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["code"] == code, error
    return error["message"]


def test_chat_content_null_is_a_400_naming_the_message_and_a_tool_call_turn_may_have_it(http, model_id):
    message = _refused(_chat(http, model_id, messages=[{"role": "user", "content": None}]), "messages[0].content")
    assert "must be a string" in message and "got null" in message
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}
    turns = [{"role": "user", "content": "Add one."}, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    assert _chat(http, model_id, messages=turns).status_code == 200  # positive control


@pytest.mark.parametrize("field,value,param", [
    ("logit_bias", {"17": "5"}, "logit_bias.17"),
    ("logit_bias", {"17": True}, "logit_bias.17"),
    ("temperature", "0.5", "temperature"),
    ("presence_penalty", "1", "presence_penalty"),
])
def test_a_number_sent_as_a_string_or_a_boolean_is_a_400_naming_the_field(http, model_id, field, value, param):
    _refused(_chat(http, model_id, **{field: value}), param)
    numeric = {"17": 5} if field == "logit_bias" else 0.5
    assert _chat(http, model_id, **{field: numeric}).status_code == 200  # positive control: the number works


def test_n_choices_with_the_largest_seed_run_each_choice_seeded_seed_plus_i_modulo_2_64(http, model_id):
    top = 2**64 - 1
    pair = _chat(http, model_id, n=2, seed=top, temperature=1.0, max_tokens=8)
    assert pair.status_code == 200, pair.text
    texts = [c["message"]["content"] for c in sorted(pair.json()["choices"], key=lambda c: c["index"])]
    alone = [_chat(http, model_id, seed=s, temperature=1.0, max_tokens=8).json()["choices"][0]["message"]["content"]
             for s in (top, 0)]
    assert texts == alone, f"choices {texts} should be the single requests seeded {top} and 0: {alone}"


def test_a_grammar_that_fails_at_a_step_is_a_400_naming_its_field_not_a_mod_error(engine, model_id):
    """With ``structured.step_max_items`` 5 the grammar compiles and takes its first step, then its
    second step needs more Earley items: the request fails naming ``response_format.grammar`` —
    before its stream starts a 400, once streaming an error chunk with the same ``param``."""
    import json

    import httpx

    from engine import Engine
    from engine.config import StructuredConfig

    grammar = "start: " + " | ".join(f"a{i}" for i in range(50)) + "\n" + "\n".join(
        f'a{i}: "w" "{i}"' for i in range(50))
    body = {"model": model_id, "messages": HI, "max_tokens": 8, "response_format": {"type": "grammar",
                                                                                     "grammar": grammar}}
    for limits, ok in ((StructuredConfig(), True), (StructuredConfig(step_max_items=5), False)):
        config = dataclasses.replace(engine.config, structured=limits)
        with Engine(config, backend=engine.backend) as eng, openai_server(eng, request_timeout_s=120) as url, \
                httpx.Client(base_url=url, timeout=120) as http:
            reply = http.post("/v1/chat/completions", json=body)
            if ok:  # positive control: the same grammar under the default limits
                assert reply.status_code == 200, reply.text
                continue
            message = _refused(reply, "response_format.grammar")
            assert "Too many items (limit 5" in message and "mod" not in message, message
            chunks = [json.loads(line[6:]) for line in http.post("/v1/chat/completions", json={**body, "stream": True})
                      .text.splitlines() if line.startswith("data: {")]
            assert chunks[-1]["error"]["param"] == "response_format.grammar", chunks[-1]


def test_a_prompt_larger_than_the_whole_kv_pool_is_refused_on_arrival_naming_the_pool(tokenizer):
    import httpx

    from engine import Engine
    from engine.errors import ContextOverflowError

    long_prompt = " ".join(["lighthouse"] * 80)
    with Engine(build_config(kv_cache_tokens=64, kv_block_size=16)) as small:
        assert small.generate(prompt="Hi", max_tokens=2).output_text  # positive control: a prompt that fits runs
        with pytest.raises(ContextOverflowError) as err:
            small.generate(prompt=long_prompt, max_tokens=2)
        assert err.value.parameter == "backend.kv_cache_tokens"
        assert "at most 63 tokens (backend.kv_cache_tokens = 64)" in str(err.value), str(err.value)
        with openai_server(small, request_timeout_s=60) as url:
            reply = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": small.backend.info.model_id, "messages": [{"role": "user", "content": long_prompt}]})
        _refused(reply, "backend.kv_cache_tokens", code="context_too_long")
