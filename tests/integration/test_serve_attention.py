"""The attention-streaming API over a real loopback server (uvicorn, in-process engine).

References are independent of the server: transformers' greedy ``generate`` for the tokens and an
eager-attention forward (``output_attentions``) of the same weights for every layer's attention.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from pipelines.serve.codec import decode_attention

pytestmark = pytest.mark.slow

ATTENTION_TOL = 2e-3  # float32 attention from cached keys vs the eager kernel (observed ~1e-6)
ROW_SUM_TOL = 1e-4
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def server(engine):
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(max_new_tokens=64, max_message_bytes=64 * 1024, max_ws_connections=4,
                             request_timeout_s=120)
    with serve_in_thread(build_app(engine, settings)) as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    import httpx

    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def prompt_ids(http):
    body = http.post("/api/v1/tokenize", json={"messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert body.status_code == 200, body.text
    return body.json()["token_ids"]


@pytest.fixture(scope="module")
def eager_model(engine):
    from transformers import AutoModelForCausalLM

    from engine.model.loading import resolve_model_path

    cfg = engine.config.backend
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model_id, cfg.model_cache_dir),
                                                attn_implementation="eager").eval()


def ws_url(server: str) -> str:
    return server.replace("http://", "ws://") + "/api/v1/generate/stream"


async def ws_generate(server: str, request: dict, *, binary: bool = False) -> list[dict]:
    """Every message of one WebSocket generation, up to done/error (binary frames attached)."""
    import websockets

    out: list[dict] = []
    async with websockets.connect(ws_url(server), max_size=None) as ws:
        await ws.send(json.dumps({"type": "generate", **request}))
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if binary and message.get("attention", {}).get("encoding") == "binary":
                message["_frame"] = await asyncio.wait_for(ws.recv(), 120)
            out.append(message)
            if message["type"] in ("done", "error"):
                return out


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


# --------------------------------------------------------------------------------- info/tokens


def test_model_info_reports_the_loaded_models_dimensions(http, engine):
    info = http.get("/api/v1/model/info").json()
    config = engine.backend.reference_model.config
    assert info["num_layers"] == config.num_hidden_layers
    assert info["num_attention_heads"] == config.num_attention_heads
    assert info["num_key_value_heads"] == config.num_key_value_heads
    assert info["vocab_size"] == engine.backend.info.vocab_size
    assert info["eos_token_id"] in engine.backend.info.eos_token_ids
    assert info["chat_template"] and info["special_tokens"]["eos_token"]


def test_tokenize_round_trips_through_detokenize(http):
    text = "Hello, how are you? Ça va — 東京."
    tokens = http.post("/api/v1/tokenize", json={"text": text, "add_special_tokens": False}).json()
    assert tokens["token_count"] == len(tokens["token_ids"]) == len(tokens["tokens"]) > 3
    assert [t["token_id"] for t in tokens["tokens"]] == tokens["token_ids"]
    back = http.post("/api/v1/detokenize", json={"token_ids": tokens["token_ids"]}).json()
    assert back["text"] == text


# --------------------------------------------------------------------------------- streaming


def test_streamed_greedy_tokens_equal_transformers_generate(server, engine, prompt_ids):
    messages = run(ws_generate(server, {"input_ids": prompt_ids, "max_new_tokens": NEW_TOKENS, "temperature": 0}))
    assert messages[-1]["type"] == "done", messages[-1]
    streamed = [m["token"]["token_id"] for m in messages if m["type"] == "token"]
    with torch.inference_mode():
        ref = engine.backend.reference_model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS,
                                                      do_sample=False)
    expected = [t for t in ref[0, len(prompt_ids):].tolist() if t not in engine.backend.info.eos_token_ids]
    assert streamed == expected, f"stream {streamed} != transformers greedy {expected}"
    assert messages[-1]["total_tokens"] == len(streamed)
    assert all(m["token"]["logprob"] <= 0 for m in messages if m["type"] == "token")


def test_streamed_attention_equals_eager_attention_for_every_layer_and_head(server, engine, prompt_ids, eager_model):
    messages = run(ws_generate(server, {"input_ids": prompt_ids, "max_new_tokens": NEW_TOKENS, "temperature": 0,
                                        "return_attention": True}))
    tokens = [m for m in messages if m["type"] == "token"]
    assert tokens, messages
    generated = [m["token"]["token_id"] for m in tokens]
    with torch.inference_mode():
        ref = eager_model(torch.tensor([prompt_ids + generated]), output_attentions=True).attentions
    config = engine.backend.reference_model.config
    for k, message in enumerate(tokens):
        info = message["attention"]
        context = len(prompt_ids) + k  # the forward that produced token k saw the prompt and k earlier tokens
        assert info["shape"] == [config.num_hidden_layers, config.num_attention_heads, context], info["shape"]
        assert info["format"] == "per_layer" and info["dtype"] == "float32" and info["encoding"] == "base64"
        got = decode_attention(info)
        sums = got.sum(-1)
        assert np.abs(sums - 1).max() < ROW_SUM_TOL, f"token {k}: rows sum to {sums.min()}..{sums.max()}"
        want = torch.stack([layer[0, :, context - 1, :context] for layer in ref]).numpy()  # (L, H, ctx)
        worst = np.abs(got - want).max(axis=(1, 2))
        assert worst.max() < ATTENTION_TOL, (f"token {k}: layer {int(worst.argmax())} differs from eager by "
                                            f"{worst.max():.2e} (bound {ATTENTION_TOL})")


def test_rest_generate_equals_the_stream(server, http, prompt_ids):
    request = {"input_ids": prompt_ids, "max_new_tokens": 4, "temperature": 0, "return_attention": True,
               "top_logprobs": 3}
    streamed = [m for m in run(ws_generate(server, request)) if m["type"] == "token"]
    body = http.post("/api/v1/generate", json=request)
    assert body.status_code == 200, body.text
    rest = body.json()
    assert [t["token_id"] for t in rest["generated_tokens"]] == [m["token"]["token_id"] for m in streamed]
    assert [t["top_logprobs"] for t in rest["generated_tokens"]] == [m["token"]["top_logprobs"] for m in streamed]
    assert len(rest["generated_tokens"][0]["top_logprobs"]) == 3
    for entry, message in zip(rest["attention_data"], streamed):
        np.testing.assert_array_equal(decode_attention(entry["attention"]), decode_attention(message["attention"]))
    assert rest["generated_text"] == "".join(t["text"] for t in rest["generated_tokens"])


def test_aggregated_float16_gzip_and_binary_encodings_decode_to_the_per_layer_values(server, prompt_ids):
    base = {"input_ids": prompt_ids, "max_new_tokens": 2, "temperature": 0, "return_attention": True}
    per_layer = decode_attention(run(ws_generate(server, base))[0]["attention"])
    mean = run(ws_generate(server, {**base, "attention_format": "aggregated", "aggregation_mode": "mean"}))[0]
    assert mean["attention"]["format"] == "aggregated" and mean["attention"]["shape"] == [per_layer.shape[-1]]
    np.testing.assert_allclose(decode_attention(mean["attention"]), per_layer.mean(axis=(0, 1)), atol=1e-6)
    top = run(ws_generate(server, {**base, "attention_format": "aggregated", "aggregation_mode": "max"}))[0]
    np.testing.assert_allclose(decode_attention(top["attention"]), per_layer.max(axis=(0, 1)), atol=1e-6)
    small = run(ws_generate(server, {**base, "attention_dtype": "float16", "attention_compression": "gzip"}))[0]
    assert small["attention"]["compression"] == "gzip" and small["attention"]["dtype"] == "float16"
    assert len(small["attention"]["data"]) < len(run(ws_generate(server, base))[0]["attention"]["data"]) / 2
    np.testing.assert_allclose(decode_attention(small["attention"]), per_layer, atol=1e-3)
    framed = run(ws_generate(server, {**base, "binary": True}, binary=True))[0]
    assert framed["attention"]["encoding"] == "binary" and "data" not in framed["attention"]
    np.testing.assert_array_equal(decode_attention(framed["attention"], framed["_frame"]), per_layer)


def test_banned_tokens_are_never_generated(server, prompt_ids):
    plain = [m["token"]["token_id"] for m in run(ws_generate(server, {"input_ids": prompt_ids, "max_new_tokens": 4,
                                                                      "temperature": 0})) if m["type"] == "token"]
    banned = sorted(set(plain))
    got = [m["token"]["token_id"] for m in run(ws_generate(server, {"input_ids": prompt_ids, "max_new_tokens": 4,
                                                                    "temperature": 0, "banned_tokens": banned}))
           if m["type"] == "token"]
    assert got and not set(got) & set(banned), f"banned {banned} but generated {got}"


def test_stop_token_ends_generation_and_is_not_sent(server, prompt_ids):
    plain = [m for m in run(ws_generate(server, {"input_ids": prompt_ids, "max_new_tokens": 4, "temperature": 0}))]
    third = plain[2]["token"]["token_id"]
    stopped = run(ws_generate(server, {"input_ids": prompt_ids, "max_new_tokens": 4, "temperature": 0,
                                       "stop_tokens": [third]}))
    assert [m["token"]["token_id"] for m in stopped if m["type"] == "token"] == [
        m["token"]["token_id"] for m in plain[:2]]
    assert stopped[-1] == {**stopped[-1], "type": "done", "finish_reason": "stop_token", "total_tokens": 2}


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("request_body, code", [
    ({"input_ids": [10**9]}, "INVALID_TOKEN"),
    ({"input_ids": [1, 2], "banned_tokens": [-1]}, "INVALID_TOKEN"),
    ({"input_ids": [1, 2], "stop_tokens": [10**9]}, "INVALID_TOKEN"),
    ({"input_ids": [1]}, "CONTEXT_TOO_LONG"),
    ({"input_ids": [1, 2], "max_new_tokens": 100000}, "INVALID_REQUEST"),
    ({"input_ids": []}, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "temperature": -1}, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "attention_format": "sparse"}, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "tempreature": 0.5}, "INVALID_REQUEST"),
    ({"input_ids": [1, 2], "sae_features": True}, "FEATURES_UNAVAILABLE"),
])
def test_bad_input_gets_a_coded_error_on_rest_and_websocket(server, http, engine, request_body, code):
    if code == "CONTEXT_TOO_LONG":  # exactly the model's context: one token too many
        request_body = {"input_ids": [1] * engine.backend.info.max_context}
    rest = http.post("/api/v1/generate", json=request_body)
    assert 400 <= rest.status_code < 600 and rest.status_code != 500, rest.text
    assert rest.json()["error_code"] == code, rest.json()
    (error,) = run(ws_generate(server, request_body))
    assert error["type"] == "error" and error["error_code"] == code, error
    assert "must" in error["error"], error["error"]


def test_oversized_websocket_message_is_refused_with_a_code(server):
    messages = run(ws_generate(server, {"input_ids": [1] * 40000}))
    assert messages[-1]["error_code"] == "MESSAGE_TOO_LARGE"


def test_connections_beyond_the_limit_get_too_many_connections(server):
    import websockets

    async def scenario():
        held = [await websockets.connect(ws_url(server)) for _ in range(4)]
        try:
            async with websockets.connect(ws_url(server)) as extra:
                refused = json.loads(await asyncio.wait_for(extra.recv(), 30))
        finally:
            for ws in held:
                await ws.close()
        return refused

    assert run(scenario())["error_code"] == "TOO_MANY_CONNECTIONS"


def test_request_past_the_time_limit_is_cancelled_with_timeout(engine, prompt_ids):
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(max_new_tokens=4000, request_timeout_s=1.0)
    with serve_in_thread(build_app(engine, settings)) as url:
        messages = run(ws_generate(url, {"input_ids": prompt_ids, "max_new_tokens": 4000, "ignore_eos": True}))
    assert messages[-1]["type"] == "error" and messages[-1]["error_code"] == "TIMEOUT", messages[-1]
    assert len(messages) - 1 < 4000


def test_client_disconnect_cancels_its_request(engine, prompt_ids):
    import time

    import websockets

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    async def leave_early(url):
        async with websockets.connect(ws_url(url)) as ws:
            await ws.send(json.dumps({"type": "generate", "input_ids": prompt_ids, "max_new_tokens": 4000,
                                      "ignore_eos": True, "request_id": "leaves-early"}))
            first = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert first["type"] == "token", f"the request must be running when its client leaves: {first}"

    def running() -> bool:
        """Whether the request still holds a slot in the engine's step loop."""
        return engine.loop.active > 0

    assert not running()
    with serve_in_thread(build_app(engine, ServeSettings(max_new_tokens=4000))) as url:
        run(leave_early(url))
        # no event announces a freed slot: poll, bounded far below the minutes 4000 tokens would take
        deadline = time.monotonic() + 60
        while running() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(), "the request kept running after its client left"


def test_each_streamed_token_carries_its_sae_features_when_the_engine_encodes_inline(engine, tmp_path):
    import dataclasses

    from engine import Engine
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings
    from tests.helpers import build_config

    cfg = build_config()
    cfg = dataclasses.replace(
        cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp_path / "f.duckdb")),
        sae=dataclasses.replace(cfg.sae, enabled=True, mode="inline"))
    with Engine(cfg, backend=engine.backend) as inline, \
            serve_in_thread(build_app(inline, ServeSettings(max_new_tokens=16))) as url:
        import httpx

        info = httpx.get(url + "/api/v1/model/info", timeout=60).json()
        assert info["sae_features_available"] is True
        ids = inline.encode("Tell me about the sea.")
        messages = asyncio.run(ws_generate(url, {"input_ids": ids, "max_new_tokens": 4, "temperature": 0.0,
                                                 "sae_features": True}))
    tokens = [m for m in messages if m["type"] == "token"]
    assert len(tokens) == 4 and messages[-1]["type"] == "done"
    k = cfg.sae.top_k
    for message in tokens:
        features = message["sae_features"]
        assert features["layer"] == cfg.sae.layer and len(features["ids"]) == len(features["values"]) == k
        assert features["values"] == sorted(features["values"], reverse=True) and features["values"][0] > 0
