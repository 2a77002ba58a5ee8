"""The OpenAI-compatible API through the official ``openai`` client, over a real loopback server.

The reference for content is the in-process engine (same weights, greedy); mod tests compare with
the same request without the mod (positive control).
"""

from __future__ import annotations

import pytest

from tests.serve_helpers import mod_payload, openai_client, openai_server

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Name a primary colour."}]
KEY = "test-key-0123456789"


@pytest.fixture(scope="module")
def server(engine):
    with openai_server(engine, allow_mod_registration=True, max_new_tokens=64, request_timeout_s=120) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def registered(server):
    import httpx

    for body in map(mod_payload, ("lookup", "shout", "refuse")):
        response = httpx.post(f"{server}/v1/mods", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json() == {"name": body["name"], "replaced": False, "description": None}


def test_models_lists_the_model(client, model_id):
    assert model_id in [m.id for m in client.models.list().data]


def test_plain_completion_equals_the_in_process_engine(client, engine, model_id):
    reply = client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=8, temperature=0)
    expected = engine.generate(messages=PROMPT, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.message.content == expected.output_text
    assert choice.finish_reason == str(expected.finish_reason)
    assert reply.usage.prompt_tokens == len(engine.encode(messages=PROMPT))
    assert reply.usage.completion_tokens == len(expected.output_ids)


def test_streamed_completion_concatenates_to_the_plain_one(client, model_id):
    plain = client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2, "tokens must arrive one by one"
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    # usage only when asked, on a last chunk of its own with no choices (OpenAI's shape)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    unasked = list(client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=8, temperature=0,
                                                  stream=True))
    assert all(c.usage is None for c in unasked) and unasked[-1].choices[0].finish_reason
    assert plain.system_fingerprint.startswith("raylens-") and plain.choices[0].message.refusal is None


def test_logprobs_are_reported_per_token(client, model_id):
    reply = client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=5, temperature=0, logprobs=True,
                                           top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the chosen token is the best


def test_stop_string_cuts_the_text_before_it(client, model_id):
    plain = client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=12, temperature=0)
    text = plain.choices[0].message.content
    stop = text.split()[1]  # a word that occurs after the start
    cut = client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=12, temperature=0,
                                              stop=[stop], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]


def test_registered_mod_selected_by_suffix_forces_the_output(client, model_id, registered):
    plain = client.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=10, temperature=0)
    forced = client.chat.completions.create(model=f"{model_id}/shout", messages=PROMPT, max_tokens=10, temperature=0)
    assert forced.choices[0].message.content == " [FORCED]"
    assert plain.choices[0].message.content != " [FORCED]"
    streamed = list(client.chat.completions.create(model=f"{model_id}/shout", messages=PROMPT, max_tokens=10,
                                                   temperature=0, stream=True))
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert f"{model_id}/shout" in [m.id for m in client.models.list().data]


def test_tool_call_mod_returns_openai_tool_calls(client, model_id, registered):
    tools = [{"type": "function", "function": {"name": "query_database", "description": "look things up",
                                               "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    reply = client.chat.completions.create(model=f"{model_id}/lookup", messages=PROMPT, tools=tools, max_tokens=10,
                                           temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("call_db", "query_database", '{"q": "colours"}')
    chunks = list(client.chat.completions.create(model=f"{model_id}/lookup", messages=PROMPT, tools=tools,
                                                 max_tokens=10, temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["query_database"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_emit_error_mod_becomes_an_openai_error(client, model_id, registered):
    import openai

    with pytest.raises(openai.BadRequestError, match="refused by policy"):
        client.chat.completions.create(model=f"{model_id}/refuse", messages=PROMPT, max_tokens=5)
    with pytest.raises(openai.APIError, match="refused by policy"):
        list(client.chat.completions.create(model=f"{model_id}/refuse", messages=PROMPT, max_tokens=5, stream=True))


def test_unknown_model_or_mod_is_not_found(client, model_id):
    import openai

    with pytest.raises(openai.NotFoundError, match="registered"):
        client.chat.completions.create(model=f"{model_id}/no-such-mod", messages=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=PROMPT, max_tokens=2)


def test_bad_parameters_are_rejected_with_400(client, model_id):
    import openai

    for kwargs in ({"n": 0}, {"temperature": 5}, {"max_tokens": 100000}, {"presence_penalty": 5},
                   {"logit_bias": {"1": 101}}, {"tool_choice": "required"}):
        with pytest.raises(openai.BadRequestError, match="must"):
            client.chat.completions.create(model=model_id, messages=PROMPT, **kwargs)


def test_mod_registration_is_off_by_default(engine):
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread

    with serve_in_thread(build_app(engine)) as url:
        response = httpx.post(f"{url}/v1/mods", json={**mod_payload("shout"), "name": "x"}, timeout=30)
    assert response.status_code == 403 and "--allow-mod-registration" in response.json()["error"]["message"]


def test_api_key_guards_every_route_but_healthz(engine, model_id):
    import httpx
    import openai

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    with serve_in_thread(build_app(engine, ServeSettings(api_key=KEY, max_new_tokens=8))) as url:
        assert httpx.get(f"{url}/healthz").status_code == 200
        for path in ("/", "/v1/models", "/api/v1/model/info", "/openapi.json"):
            assert httpx.get(f"{url}{path}").status_code == 401, path
        assert httpx.get(f"{url}/api/v1/model/info", headers={"X-API-Key": "wrong-key-123"}).status_code == 401
        assert httpx.get(f"{url}/api/v1/model/info", params={"api_key": KEY}).status_code == 200
        with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong-key-123", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
        with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as right:
            assert right.chat.completions.create(model=model_id, messages=PROMPT, max_tokens=2).choices


def test_settings_refuse_a_non_loopback_bind_or_mod_registration_without_a_key():
    from engine.errors import ConfigError
    from pipelines.serve.settings import ServeSettings

    with pytest.raises(ConfigError, match="api key|API key"):
        ServeSettings(host="0.0.0.0", allow_mod_registration=True)
    with pytest.raises(ConfigError, match="must come with an API key") as err:  # a non-loopback bind needs a key
        ServeSettings(host="0.0.0.0")
    assert err.value.parameter == "host" and "--insecure-no-auth" in str(err.value)
    open_host = ServeSettings(host="0.0.0.0", insecure_no_auth=True)  # only when asked, and loudly
    assert any("NO authentication" in note for note in open_host.startup_warnings())
    assert not ServeSettings(host="0.0.0.0", api_key=KEY).startup_warnings()
    assert not ServeSettings(host="127.0.0.1").startup_warnings()
