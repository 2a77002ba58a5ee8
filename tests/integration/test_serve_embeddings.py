"""``POST /v1/embeddings`` over a real loopback server: equal to ``Engine.embed`` on the same input."""

from __future__ import annotations

import pytest

from tests.serve_helpers import openai_client, openai_server

pytestmark = pytest.mark.slow

TEXTS = ["The cat sat on the mat.", "Quantum chromodynamics", "a"]


@pytest.fixture(scope="module")
def server(engine):
    with openai_server(engine, request_timeout_s=120) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server, timeout=120) as c:
        yield c


def close(got, expected):
    """Equal up to float32 rounding, relative to the vectors' scale."""
    import numpy as np

    got, expected = np.asarray(got, dtype=np.float32), np.asarray(expected, dtype=np.float32)
    assert got.shape == expected.shape
    scale = float(np.abs(expected).max())
    assert float(np.abs(got - expected).max()) <= 1e-5 * scale


def test_floats_equal_engine_embed(server, engine):
    import httpx
    from openai.types import CreateEmbeddingResponse

    model = engine.backend.info.model_id
    body = httpx.post(f"{server}/v1/embeddings", json={"model": model, "input": TEXTS, "encoding_format": "float"},
                      timeout=120).json()
    reply = CreateEmbeddingResponse.model_validate(body)
    expected = engine.embed(TEXTS)
    assert [d.index for d in reply.data] == [0, 1, 2]
    close([d.embedding for d in reply.data], expected)
    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    one = CreateEmbeddingResponse.model_validate(httpx.post(f"{server}/v1/embeddings", json={
        "model": model, "input": TEXTS[0]}, timeout=120).json())
    close([one.data[0].embedding], expected[:1])


def test_base64_through_the_openai_client_and_token_ids(client, engine):
    import numpy as np

    model = engine.backend.info.model_id
    expected = engine.embed(TEXTS)
    reply = client.embeddings.create(model=model, input=TEXTS)  # the client asks for base64 and decodes it
    close([d.embedding for d in reply.data], expected)
    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    close([d.embedding for d in by_ids.data], expected)
    single = client.embeddings.create(model=model, input=ids[1], encoding_format="float")
    close([single.data[0].embedding], expected[1:2])
    width = engine.backend.info.hidden_size
    same = client.embeddings.create(model=model, input="x", dimensions=width)
    assert len(same.data[0].embedding) == width
    assert not np.allclose(expected[0], expected[1])  # positive control: different texts differ


@pytest.mark.parametrize("fields, param, status", [
    ({"dimensions": 8}, "dimensions", 400),
    ({"input": []}, "input", 400),
    ({"input": [""]}, "input[0]", 400),
    ({"input": [[1, 2], [10**9]]}, "input[1][0]", 400),
    ({"input": [1.5]}, "input", 400),
    ({"encoding_format": "int8"}, "encoding_format", 400),
    ({"model": "other-model"}, "model", 404),
])
def test_bad_fields_are_refused_naming_the_field(server, engine, fields, param, status):
    import httpx
    from openai.types import ErrorObject

    body = {"model": engine.backend.info.model_id, "input": "hello", **fields}
    response = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = ErrorObject.model_validate(response.json()["error"])
    assert error.param == param and "must" in error.message
