"""The engine's generation fields over HTTP, through the official ``openai`` client on a loopback
server: enforced ``response_format`` (JSON schema, streamed or not, on chat and completions),
``tool_choice`` turning the answer into a tool call, ``logit_bias`` changing it, and
``stream_options.continuous_usage_stats``. Every answer and chunk validates against the client's
own models; each change is shown against a control without the field.
"""

from __future__ import annotations

import json

import pytest

from tests.serve_helpers import openai_client, openai_server

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Describe a cat in one short sentence."}]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server(engine):
    with openai_server(engine, max_new_tokens=96, request_timeout_s=240) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server, timeout=240) as c:
        yield c



def _schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_answers_parse_and_validate_at_temperature(client, model_id, seed):
    import jsonschema
    from openai.types.chat import ChatCompletion

    answer = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=80, temperature=0.9,
                                            seed=seed, response_format=_schema_format(PERSON))
    ChatCompletion.model_validate(answer.model_dump())
    jsonschema.validate(json.loads(answer.choices[0].message.content), PERSON)
    assert answer.choices[0].finish_reason == "stop"
    free = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=30, temperature=0.9, seed=seed)
    with pytest.raises(ValueError):  # control: the same request without the format is prose
        json.loads(free.choices[0].message.content)


def test_streamed_json_schema_and_continuous_usage(client, model_id):
    import jsonschema
    from openai.types.chat import ChatCompletionChunk

    chunks = list(client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=80, temperature=0, response_format=_schema_format(PERSON),
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk.model_dump())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] > 0
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == counts[-1]
    assert final.usage.prompt_tokens == chunks[0].usage.prompt_tokens > 0
    plain = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]  # control: usage only at the end


def test_tool_choice_required_answers_with_a_valid_call(client, model_id):
    import jsonschema
    from openai.types.chat import ChatCompletion

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    answer = client.chat.completions.create(model=model_id, messages=messages, max_tokens=60, temperature=0,
                                            tools=[WEATHER_TOOL], tool_choice="required")
    ChatCompletion.model_validate(answer.model_dump())
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    free = client.chat.completions.create(model=model_id, messages=messages, max_tokens=60, temperature=0,
                                          tools=[WEATHER_TOOL], tool_choice="none")
    assert free.choices[0].finish_reason != "tool_calls" and free.choices[0].message.tool_calls is None


def test_logit_bias_changes_the_answer(client, model_id, engine):
    plain = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3, temperature=0,
                                           logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    first_id = engine.tokenizer.convert_tokens_to_ids(engine.tokenizer.tokenize(first))[0]
    biased = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3, temperature=0,
                                            logprobs=True, logit_bias={str(first_id): -100})
    assert biased.choices[0].logprobs.content[0].token != first
    again = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3, temperature=0)
    assert again.choices[0].message.content == plain.choices[0].message.content  # control: greedy is stable


def test_completions_take_the_same_fields(client, model_id):
    import jsonschema
    from openai.types import Completion

    answer = client.completions.create(model=model_id, prompt="A person as JSON:", max_tokens=80, temperature=0.7,
                                       seed=3, extra_body={"response_format": _schema_format(PERSON), "min_tokens": 5})
    Completion.model_validate(answer.model_dump())
    jsonschema.validate(json.loads(answer.choices[0].text), PERSON)
    assert answer.usage.completion_tokens >= 5


def test_unenforceable_schema_is_a_400_naming_the_keyword(client, model_id):
    import openai

    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=8,
                                       response_format=_schema_format(schema))


def test_prefix_cache_flag_is_taken_and_checked(client, model_id, engine):
    import openai

    before = engine.cache_stats()["prompt_tokens"]
    off = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, temperature=0,
                                         extra_body={"prefix_cache": False})
    assert engine.cache_stats()["prompt_tokens"] == before  # it did not look the prefix up
    on = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4, temperature=0)
    assert engine.cache_stats()["prompt_tokens"] > before  # control: the default looks it up
    assert off.choices[0].message.content == on.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="prefix_cache"):
        client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=4,
                                       extra_body={"prefix_cache": "no"})
