"""``raylens serve``'s deployment on Ray Serve, on a loopback Ray head: HTTP, SSE and WebSocket
reach the replica that owns the engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.e2e.conftest import free_port
from tests.helpers import build_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(ray_head):
    from ray import serve

    from pipelines.serve.deployment import APP_NAME, deploy
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(host="127.0.0.1", port=free_port(), max_new_tokens=16, request_timeout_s=120)
    config = build_config()
    url = deploy(config, settings)  # returns once the replica is running (its model loaded)
    try:
        yield url, config
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()


def test_openai_and_attention_routes_answer_through_ray_serve(served):
    import httpx
    import openai
    import websockets

    url, config = served
    assert httpx.get(f"{url}/healthz", timeout=60).json()["ok"] is True
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        assert model == config.backend.model_id
        plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0)
        streamed = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                       max_tokens=4, temperature=0, stream=True))
    assert plain.choices[0].message.content
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == plain.choices[0].message.content

    ids = httpx.post(f"{url}/api/v1/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                     timeout=60).json()["token_ids"]

    async def stream():
        async with websockets.connect(url.replace("http://", "ws://") + "/api/v1/generate/stream") as ws:
            await ws.send(json.dumps({"type": "generate", "input_ids": ids, "max_new_tokens": 3, "temperature": 0,
                                      "return_attention": True}))
            out = []
            while not out or out[-1]["type"] not in ("done", "error"):
                out.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
            return out

    messages = asyncio.run(stream())
    assert messages[-1]["type"] == "done", messages[-1]
    tokens = [m for m in messages if m["type"] == "token"]
    assert tokens and tokens[0]["attention"]["shape"][-1] == len(ids)
    rest = httpx.post(f"{url}/api/v1/generate", json={"input_ids": ids, "max_new_tokens": 3, "temperature": 0},
                      timeout=120).json()
    assert [t["token_id"] for t in rest["generated_tokens"]] == [m["token"]["token_id"] for m in tokens]
