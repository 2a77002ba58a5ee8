"""The ``raylens`` body extension over a real loopback server: SAE features per token, steering by
SAE feature, named captures of a token window — on an engine whose SAE encodes inline.

References: the same request's token events read from the in-process engine (features), the
same request without steering or with scale 0 (steering's controls), and ``Engine.capture`` of
the same tokens (captures).
"""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest

from tests.serve_helpers import openai_server

from tests.helpers import build_config

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Tell me about the ocean and the ships that sail on it."}]


@pytest.fixture(scope="module")
def inline(engine, tmp_path_factory):
    from engine import Engine

    tmp = tmp_path_factory.mktemp("inline")
    cfg = build_config()
    cfg = dataclasses.replace(
        cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp / "store.duckdb")),
        sae=dataclasses.replace(cfg.sae, enabled=True, mode="inline"))
    with Engine(cfg, backend=engine.backend) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(inline):
    with openai_server(inline, max_new_tokens=64, request_timeout_s=120) as url:
        yield url


def chat(server, model, **fields):
    import httpx
    from openai.types.chat import ChatCompletion

    response = httpx.post(f"{server}/v1/chat/completions", json={"model": model, "messages": MESSAGES,
                                                                 "temperature": 0, **fields}, timeout=120)
    assert response.status_code == 200, response.text
    body = response.json()
    ChatCompletion.model_validate(body)  # the extension rides beside OpenAI's fields
    return body


def test_sae_features_per_token_are_the_engines_stream_features(server, inline):
    from engine.core.stream import TokenEvent

    model = inline.backend.info.model_id
    body = chat(server, model, max_tokens=6, logprobs=True, raylens={"sae_features": 4})
    (choice,) = body["choices"]
    features = choice["raylens"]["sae_features"]
    assert [f["token"] for f in features] == [e["token"] for e in choice["logprobs"]["content"]]
    events = [e for e in inline.stream(messages=MESSAGES, max_tokens=6, temperature=0) if isinstance(e, TokenEvent)]
    for entry, event in zip(features, events):
        ids, values = event.sae_features.ids[:4], event.sae_features.values[:4]
        assert [f["id"] for f in entry["features"]] == [int(i) for i, v in zip(ids, values) if v > 0]
        assert [f["value"] for f in entry["features"]] == pytest.approx([float(v) for v in values if v > 0], rel=1e-5)
    assert any(entry["features"] for entry in features)
    plain = chat(server, model, max_tokens=6)
    assert "raylens" not in plain["choices"][0]  # off unless asked


def test_streamed_chunks_carry_each_tokens_features(server, inline):
    import json

    import httpx
    from openai.types.chat import ChatCompletionChunk

    model = inline.backend.info.model_id
    whole = chat(server, model, max_tokens=5, raylens={"sae_features": 2})["choices"][0]["raylens"]["sae_features"]
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={
            "model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 5, "stream": True,
            "raylens": {"sae_features": 2}}, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = []
    for event in events:
        ChatCompletionChunk.model_validate(event)
        streamed += event["choices"][0].get("raylens", {}).get("sae_features", [])
    assert streamed == whole


def test_steering_by_feature_changes_the_text_and_scale_zero_does_not(server, inline):
    model = inline.backend.info.model_id
    plain = chat(server, model, max_tokens=12)["choices"][0]["message"]["content"]
    first = chat(server, model, max_tokens=2, raylens={"sae_features": 1})["choices"][0]["raylens"]["sae_features"]
    feature = first[0]["features"][0]["id"]
    zero = chat(server, model, max_tokens=12, raylens={"steer": [{"feature": feature, "scale": 0.0}]})
    strong = chat(server, model, max_tokens=12, raylens={"steer": [{"feature": feature, "scale": 200.0}]})
    assert zero["choices"][0]["message"]["content"] == plain
    assert strong["choices"][0]["message"]["content"] != plain


def test_captures_equal_engine_capture_over_the_window(server, inline):
    model = inline.backend.info.model_id
    names = ["blocks.2.hook_resid_post", "blocks.1.attn.hook_pattern"]
    body = chat(server, model, max_tokens=4, raylens={"capture": {"names": names, "start": -5, "end": -1}})
    captured = body["choices"][0]["raylens"]["captures"]
    prompt = inline.encode(messages=MESSAGES)
    result = inline.generate(messages=MESSAGES, max_tokens=4, temperature=0)
    sequence = prompt + [t for t in result.output_ids if t not in inline.backend.info.eos_token_ids]
    start, end = len(sequence) - 5, len(sequence) - 1
    assert captured["window"] == [start, end] and captured["token_ids"] == sequence[start:end]
    expected = inline.capture(input_ids=sequence, names=names)
    for name in names:
        info = captured["tensors"][name]
        got = np.frombuffer(base64.b64decode(info["data"]), dtype="<f4").reshape(info["shape"])
        reference = expected[name].float().numpy()
        reference = reference[:, start:end] if name.endswith("hook_pattern") else reference[start:end]
        assert got.shape == reference.shape
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6 * float(np.abs(reference).max()))


@pytest.mark.parametrize("raylens, param", [
    ({"steer": [{"feature": "x", "scale": 1.0}]}, "raylens.steer[0].feature"),
    ({"steer": [{"feature": 1}]}, "raylens.steer[0]"),
    ({"sae_features": 99}, "raylens.sae_features"),
    ({"capture": {"names": ["blocks.99.hook_resid_post"]}}, "raylens.capture.names"),
    ({"capture": {"names": ["blocks.*.hook_resid_post"]}}, "raylens.capture.names"),
    ({"capture": {"names": ["blocks.0.hook_resid_post"], "start": "0"}}, "raylens.capture.start"),
    ({"colour": 1}, "raylens.colour"),
])
def test_bad_extension_fields_are_400_naming_them(server, inline, raylens, param):
    import httpx

    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "Hi"})):
        response = httpx.post(f"{server}{path}", json={"model": inline.backend.info.model_id, "max_tokens": 2,
                                                       "raylens": raylens, **body}, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_features_and_steering_need_an_inline_sae(engine):
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread

    with serve_in_thread(build_app(engine)) as url:
        for raylens in ({"sae_features": 2}, {"steer": [{"feature": 1, "scale": 1.0}]}):
            response = httpx.post(f"{url}/v1/chat/completions", json={
                "model": engine.backend.info.model_id, "messages": MESSAGES, "max_tokens": 2, "raylens": raylens},
                timeout=60)
            assert response.status_code == 501 and "inline" in response.json()["error"]["message"]
        captured = httpx.post(f"{url}/v1/completions", json={  # captures need no SAE
            "model": engine.backend.info.model_id, "prompt": "Hi there", "max_tokens": 2, "temperature": 0,
            "raylens": {"capture": {"names": ["blocks.0.hook_resid_post"]}}}, timeout=60)
        assert captured.status_code == 200
        assert captured.json()["choices"][0]["raylens"]["captures"]["tensors"]["blocks.0.hook_resid_post"]["shape"][1] \
            == engine.backend.info.hidden_size
