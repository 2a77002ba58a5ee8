"""Every OpenAI answer, and every streamed chunk, validates against the official ``openai`` client's
own models (``model_validate``, which checks what the client's lenient parsing does not).

Bodies are read raw over a real loopback server. Completions differ in two places between the
SDK's ``Completion`` model and the wire format OpenAI itself sends and documents: a streamed chunk
has ``finish_reason`` null until the last, and an echoed prompt's first token has a null log-prob
and null alternatives (nothing comes before it). Those chunks and bodies are validated against the
SDK's models widened at exactly those fields (:func:`wire_completion`); every other completions
body, and every final chunk, against ``Completion`` itself.
"""

from __future__ import annotations

import json
from typing import Dict, List, Literal, Optional

import pytest

from tests.serve_helpers import openai_server

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name a primary colour."}]
PROMPT = "The capital of France is"


def wire_completion():
    """``Completion`` widened where OpenAI's wire format has nulls its SDK model does not allow."""
    from openai.types import Completion, CompletionChoice
    from openai.types.completion_choice import Logprobs

    class WireLogprobs(Logprobs):
        token_logprobs: Optional[List[Optional[float]]] = None
        top_logprobs: Optional[List[Optional[Dict[str, float]]]] = None

    class WireChoice(CompletionChoice):
        finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None
        logprobs: Optional[WireLogprobs] = None

    class WireCompletion(Completion):
        choices: List[WireChoice]

    return WireCompletion


@pytest.fixture(scope="module")
def server(engine):
    with openai_server(engine, mods=("lookup", "refuse"), max_new_tokens=64, request_timeout_s=120) as url:
        yield url



def post(server, path, body):
    import httpx

    response = httpx.post(f"{server}{path}", json=body, timeout=120)
    return response.status_code, response.json()


def stream(server, path, body):
    """The ``data:`` events of a streamed answer, parsed; the last must be ``[DONE]``."""
    import httpx

    with httpx.stream("POST", f"{server}{path}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


CHAT_CASES = {
    "plain": {"max_tokens": 6, "temperature": 0},
    "logprobs": {"max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    "n": {"max_tokens": 4, "temperature": 1.0, "n": 3, "seed": 2},
    "stop": {"max_tokens": 8, "temperature": 0, "stop": [" "]},
}


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_chat_bodies_and_chunks_validate(server, model_id, case):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    body = {"model": model_id, "messages": MESSAGES, **CHAT_CASES[case]}
    status, answer = post(server, "/v1/chat/completions", body)
    assert status == 200
    reply = ChatCompletion.model_validate(answer)
    assert len(reply.choices) == body.get("n", 1)
    chunks = [ChatCompletionChunk.model_validate(c)
              for c in stream(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    assert sorted(c.choices[0].index for c in chunks[:-1] if c.choices[0].finish_reason) == list(range(body.get("n", 1)))


def test_chat_tool_call_via_a_mod_validates(server, model_id):
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    tools = [{"type": "function", "function": {"name": "query_database", "parameters": {"type": "object"}}}]
    body = {"model": f"{model_id}/lookup", "messages": MESSAGES, "tools": tools, "max_tokens": 6, "temperature": 0}
    status, answer = post(server, "/v1/chat/completions", body)
    reply = ChatCompletion.model_validate(answer)
    assert status == 200 and reply.choices[0].message.tool_calls[0].function.name == "query_database"
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream(server, "/v1/chat/completions", body)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


COMPLETION_CASES = {
    "plain": {"max_tokens": 6, "temperature": 0},
    "logprobs": {"max_tokens": 4, "temperature": 0, "logprobs": 3},
    "n_and_prompts": {"prompt": [PROMPT, [504, 3575]], "max_tokens": 4, "temperature": 1.0, "n": 2, "seed": 4},
    "echo": {"max_tokens": 3, "temperature": 0, "echo": True},
}


@pytest.mark.parametrize("case", sorted(COMPLETION_CASES))
def test_completion_bodies_and_chunks_validate(server, model_id, case):
    from openai.types import Completion

    body = {"model": model_id, "prompt": PROMPT, **COMPLETION_CASES[case]}
    status, answer = post(server, "/v1/completions", body)
    assert status == 200
    reply = Completion.model_validate(answer)  # the SDK's own model, unwidened
    events = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    wire = wire_completion()
    chunks = [wire.model_validate(e) for e in events]
    finals = [e for e, c in zip(events, chunks) if c.choices and c.choices[0].finish_reason]
    assert len(finals) == len(reply.choices)
    for final in finals + [events[-1]]:  # the finishing chunks and the usage chunk: the SDK's own model
        Completion.model_validate(final)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_echoed_prompt_logprobs_validate_on_the_wire_model(server, model_id):
    from openai.types import Completion
    from pydantic import ValidationError

    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    status, answer = post(server, "/v1/completions", body)
    assert status == 200
    reply = wire_completion().model_validate(answer)
    assert reply.choices[0].logprobs.token_logprobs[0] is None  # OpenAI's null for the first token
    with pytest.raises(ValidationError, match="token_logprobs"):  # the one place the SDK's model disagrees
        Completion.model_validate(answer)
    for event in stream(server, "/v1/completions", body):
        wire_completion().model_validate(event)


def test_embeddings_validate(server, model_id):
    from openai.types import CreateEmbeddingResponse

    for encoding in ("float", "base64"):
        status, answer = post(server, "/v1/embeddings", {"model": model_id, "input": ["a b", "c"],
                                                         "encoding_format": encoding})
        assert status == 200
        if encoding == "float":
            CreateEmbeddingResponse.model_validate(answer)
        else:  # the SDK's model holds floats; its client decodes base64 into them before validating
            import base64

            import numpy as np

            for item in answer["data"]:
                item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist()
            CreateEmbeddingResponse.model_validate(answer)


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 9}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "model": "{model}/refuse"}, 400, None),
    ("/v1/completions", {"prompt": PROMPT, "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, 400, "best_of"),
    ("/v1/embeddings", {"input": "x", "dimensions": 2}, 400, "dimensions"),
    ("/v1/chat/completions", {"messages": MESSAGES, "audio": {"voice": "alloy"}}, 400, "audio"),
    ("/v1/chat/completions", {"messages": MESSAGES, "modalities": ["text", "audio"]}, 400, "modalities"),
    ("/v1/completions", {"prompt": PROMPT, "functions": [{"name": "f"}]}, 400, "functions"),
])
def test_error_bodies_are_openai_errors(server, model_id, path, body, status, param):
    from openai.types import ErrorObject

    body = {"model": model_id, **body}
    body["model"] = body["model"].replace("{model}", model_id)
    got, answer = post(server, path, body)
    assert got == status
    error = ErrorObject.model_validate(answer["error"])
    assert error.param == param and error.message


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_error_after_the_stream_started_is_a_valid_final_chunk(server, model_id, path):
    from openai.types import ErrorObject
    from openai.types.chat import ChatCompletionChunk

    chat = path == "/v1/chat/completions"
    body = {"model": f"{model_id}/refuse", "max_tokens": 3, **({"messages": MESSAGES} if chat else {"prompt": PROMPT})}
    events = stream(server, path, body)
    for event in events:
        (ChatCompletionChunk if chat else wire_completion()).model_validate(event)
    assert events[-1]["choices"] == []
    assert "refused by policy" in ErrorObject.model_validate(events[-1]["error"]).message
