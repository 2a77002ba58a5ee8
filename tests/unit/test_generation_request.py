"""The one request type, without a model: what building it checks, what it keeps, and that it
crosses process boundaries (pickling, as Ray sends it) unchanged."""

from __future__ import annotations

import pickle
import sys

import pytest

from engine.core.inputs import GenerationRequest, as_request
from engine.errors import InvalidRequestError, TokenOutOfVocabularyError


def test_building_a_request_imports_no_torch():
    import subprocess

    code = ("import sys; from engine.core.inputs import GenerationRequest; GenerationRequest(prompt='hi'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "the CLI and job drivers check requests without loading torch"


@pytest.mark.parametrize("fields", [{}, {"prompt": "a", "input_ids": [1]}, {"prompt": "a", "messages": [
    {"role": "user", "content": "b"}]}])
def test_exactly_one_prompt_source_is_required(fields):
    with pytest.raises(InvalidRequestError, match="exactly one of prompt, messages, input_ids") as err:
        GenerationRequest(**fields)
    assert err.value.parameter == "prompt"


@pytest.mark.parametrize(("fields", "parameter"), [
    ({"prompt": "  "}, "prompt"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0]"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 2.0]}, "input_ids[1]"),
    ({"input_ids": [True]}, "input_ids[0]"),
    ({"prompt": "x", "stop_tokens": "12"}, "stop_tokens"),
    ({"prompt": "x", "banned_tokens": [3, "4"]}, "banned_tokens[1]"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -1}, "top_k"),
    ({"prompt": "x", "seed": 2**64}, "seed"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "x", "attention": "some"}, "attention"),
    ({"prompt": "x", "request_id": ""}, "request_id"),
    ({"prompt": "x", "tools": [1]}, "tools"),
    ({"prompt": "x", "response_format": "json"}, "response_format"),
    ({"prompt": "x", "max_tokens": 65, "max_tokens_cap": 64}, "max_tokens"),
])
def test_a_bad_value_is_a_typed_error_naming_its_field(fields, parameter):
    with pytest.raises(InvalidRequestError) as err:
        GenerationRequest(**fields)
    assert err.value.parameter == parameter, str(err.value)
    assert f"`{parameter}`" in str(err.value) or parameter == "prompt"


def test_a_negative_token_id_is_out_of_the_vocabulary():
    with pytest.raises(TokenOutOfVocabularyError, match=r"`input_ids\[1\]` must be a token id >= 0, got -2"):
        GenerationRequest(input_ids=[1, -2])


def test_values_at_their_bounds_are_kept_as_given():
    req = GenerationRequest(input_ids=[0, 5], max_tokens=2**31 - 1, temperature=0, top_p=1, top_k=0,
                            seed=2**64 - 1, stop_tokens=[7], banned_tokens=[8], repetition_penalty=1.5,
                            top_logprobs=20, attention="all", request_id="r" * 255)
    assert req.input_ids == (0, 5) and req.stop_tokens == (7,) and req.banned_tokens == (8,)
    assert req.logprobs == 20 and GenerationRequest(prompt="x").logprobs == -1


def test_the_request_crosses_pickling_unchanged_and_is_frozen():
    req = GenerationRequest(messages=[{"role": "user", "content": "hi"}], mods=[{"language": "python",
                            "source": "def m(e, t):\n    return None\n", "entrypoint": "m"}], seed=3)
    back = pickle.loads(pickle.dumps(req))
    assert back == req and back.mods == req.mods
    with pytest.raises(AttributeError):
        req.seed = 4  # type: ignore[misc]


def test_replace_checks_again():
    req = GenerationRequest(prompt="x")
    assert req.replace(seed=5).seed == 5
    with pytest.raises(InvalidRequestError):
        req.replace(top_p=2.0)


def test_keyword_fields_build_the_request_and_an_unknown_one_is_named():
    assert as_request("hi", {"max_tokens": 3}) == GenerationRequest(prompt="hi", max_tokens=3)
    req = GenerationRequest(prompt="x")
    assert as_request(req, {}) is req
    with pytest.raises(InvalidRequestError, match="`max_new_tokens` is not a request field") as err:
        as_request("hi", {"max_new_tokens": 3})
    assert err.value.parameter == "max_new_tokens"
    with pytest.raises(InvalidRequestError, match="not both"):
        as_request(req, {"seed": 1})


def test_what_mods_and_the_payload_read_from_the_request():
    chat = GenerationRequest(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"}])
    assert chat.user_prompt == "q" and chat.conversation[1] == {"role": "user", "content": "q"}
    plain = GenerationRequest(prompt="hello")
    assert plain.user_prompt == "hello" and plain.conversation == [{"role": "user", "content": "hello"}]
    assert GenerationRequest(input_ids=[1]).conversation == [] and GenerationRequest(input_ids=[1]).user_prompt is None


@pytest.mark.parametrize(("fields", "parameter"), [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": []}}},
     "response_format.json_schema.schema"),
])
def test_malformed_tools_and_response_formats_are_refused_naming_the_field(fields, parameter):
    with pytest.raises(InvalidRequestError) as err:
        GenerationRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    assert err.value.parameter == parameter, str(err.value)


def test_well_formed_tools_and_response_formats_pass():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}
    req = GenerationRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool], response_format=fmt)
    assert req.tools == (tool,) and req.response_format == fmt
    for kind in ("text", "json_object"):
        assert GenerationRequest(prompt="x", response_format={"type": kind}).response_format == {"type": kind}
