"""A bounded load test: several WebSocket clients at once, each with a full greedy generation.

Every client must get the same tokens as a client alone (requests must not see each other's
state), the server must serve them all without refusing any, and their requests must share the
engine's steps (batched, not served one after another). Bounded in clients, tokens and
time (one overall deadline).
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.slow

CLIENTS = 6
NEW_TOKENS = 6
DEADLINE_S = 400


async def _one(url: str, ids: list[int], request_id: str) -> tuple[list[int], dict]:
    import websockets

    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "generate", "request_id": request_id, "input_ids": ids,
                                  "max_new_tokens": NEW_TOKENS, "temperature": 0, "return_attention": True}))
        tokens = []
        while True:
            message = json.loads(await ws.recv())
            if message["type"] == "token":
                assert message["request_id"] == request_id, message["request_id"]
                tokens.append(message["token"]["token_id"])
            else:
                return tokens, message


def test_concurrent_websocket_clients_each_get_their_own_greedy_tokens(engine):
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    prompts = ["Name a fruit.", "Name a planet."]
    ids = {p: engine.encode(p) for p in prompts}
    expected = {p: [t for t in engine.generate(input_ids=ids[p], max_tokens=NEW_TOKENS, temperature=0).output_ids]
                for p in prompts}
    assert expected[prompts[0]] != expected[prompts[1]], "positive control: the two prompts must differ"
    settings = ServeSettings(max_new_tokens=NEW_TOKENS, max_ws_connections=CLIENTS, request_timeout_s=DEADLINE_S)
    with serve_in_thread(build_app(engine, settings)) as url:
        ws_url = url.replace("http://", "ws://") + "/api/v1/generate/stream"

        async def all_clients():
            jobs = [_one(ws_url, ids[prompts[i % 2]], f"load-{i}") for i in range(CLIENTS)]
            return await asyncio.wait_for(asyncio.gather(*jobs), DEADLINE_S)

        steps_before = engine.loop.stats.steps
        results = asyncio.run(all_clients())
        steps = engine.loop.stats.steps - steps_before
    # one at a time would take CLIENTS x (NEW_TOKENS + 1) steps; sockets' requests share steps
    assert steps <= CLIENTS * (NEW_TOKENS + 1) // 2, f"{steps} steps for {CLIENTS} clients: they were not batched"
    for i, (tokens, done) in enumerate(results):
        assert done["type"] == "done", done
        assert tokens == expected[prompts[i % 2]], f"client {i}: {tokens} != {expected[prompts[i % 2]]}"
