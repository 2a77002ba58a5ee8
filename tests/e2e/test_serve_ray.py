"""``raylens serve``'s deployment on Ray Serve, on a loopback Ray head: HTTP, SSE and WebSocket
reach the replica, and the replica's requests run in the config's shared GeneratorActor (the one a
Ray Job with the same config gets): streamed, recorded by its StoreActor and IngestActor, cancelled
there when the client leaves, and batched with a job's requests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid

import pytest

from engine.core.inputs import GenerationRequest
from tests.e2e.conftest import free_port, kill_namespace_actors, wait_until
from tests.helpers import build_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def served(ray_head, tmp_path_factory):
    import ray
    from ray import serve

    from pipelines.cluster.actor_specs import actor_roles
    from pipelines.serve.deployment import APP_NAME, deploy
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(host="127.0.0.1", port=free_port(), max_new_tokens=256, request_timeout_s=120,
                             allow_mod_registration=True)
    tmp = tmp_path_factory.mktemp("serve")
    cfg = build_config()
    config = dataclasses.replace(
        cfg,  # a private namespace and store: the actors this module creates are its own
        activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp / "store.duckdb"),
                                        parquet_path=str(tmp / "parquet")),
        ingest=dataclasses.replace(cfg.ingest, spool_dir=str(tmp / "spool")),
        ray=dataclasses.replace(cfg.ray, namespace=f"raylens-test-{uuid.uuid4().hex[:8]}", call_timeout_s=120))
    try:
        url = deploy(config, settings)  # returns once the replica is running (its actors started)
        roles = actor_roles(config)
        actors = {role: ray.get_actor(roles[role], namespace=config.ray.namespace)  # by name, as a Ray Job does
                  for role in ("raylens-generator", "raylens-store", "raylens-ingest")}
        yield url, config, actors
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
        kill_namespace_actors(config)


def _stats(actor) -> dict:
    import ray

    return ray.get(actor.stats.remote(), timeout=60)


def _prompt_ids(url: str) -> list[int]:
    import httpx

    return httpx.post(f"{url}/api/v1/tokenize", json={"messages": [{"role": "user", "content": "Tell me a story"}]},
                      timeout=60).json()["token_ids"]


def test_openai_and_attention_routes_answer_through_the_generator_actor(served):
    import httpx
    import openai
    import ray
    import websockets

    url, config, actors = served
    generator = actors["raylens-generator"]
    before = _stats(generator)
    ingested = _stats(actors["raylens-ingest"])["submitted"]
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
    assert plain.usage.prompt_tokens > 0 and plain.usage.completion_tokens == 4

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

    # all four ran in the shared generator and were recorded there: store rows, ingest payloads
    after = ray.get(generator.drain.remote(), timeout=120)
    assert after["requests"] - before["requests"] == 4 and after["streaming"] == 0
    assert ray.get(actors["raylens-store"].counts.remote(), timeout=60)["requests"] == after["requests"]
    assert _stats(actors["raylens-ingest"])["submitted"] - ingested == 4


def test_a_second_serve_on_the_cluster_is_refused_and_the_first_keeps_serving(served):
    import httpx

    from engine.errors import ServerAlreadyRunningError
    from pipelines.serve.deployment import deploy
    from pipelines.serve.settings import ServeSettings

    url, config, _ = served
    with pytest.raises(ServerAlreadyRunningError, match="must not already run on this cluster"):
        deploy(config, ServeSettings(host="127.0.0.1", port=free_port()))
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200  # the first is untouched


def test_input_the_engine_refuses_in_the_actor_comes_back_as_its_coded_error(served):
    import httpx

    url, _, _ = served
    info = httpx.get(f"{url}/api/v1/model/info", timeout=60).json()
    assert info["num_layers"] > 0 and info["architecture"] and info["sae_features_available"] is False
    refused = httpx.post(f"{url}/api/v1/tokenize", json={"messages": [{"content": "no role"}]}, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error_code"] == "INVALID_REQUEST" and refused.json()["parameter"] == "messages[0]"
    features = httpx.post(f"{url}/api/v1/generate", json={"input_ids": [1, 2], "sae_features": True}, timeout=60)
    assert features.status_code == 501 and features.json()["error_code"] == "FEATURES_UNAVAILABLE"


SHOUT = """
from quote_mod_sdk import Sampled, mod

@mod
def shout(event, actions, tokenizer):
    if isinstance(event, Sampled) and event.step == 2:
        return actions.force_output(tokens=tokenizer.encode(" [FORCED]", add_special_tokens=False))
"""


def test_a_registered_mod_travels_to_the_actor_as_its_payload(served):
    import httpx
    import openai

    url, config, _ = served
    body = {"name": "shout", "language": "python", "entrypoint": "shout", "source": SHOUT}
    assert httpx.post(f"{url}/v1/mods", json=body, timeout=60).status_code == 200
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        reply = client.chat.completions.create(model=f"{config.backend.model_id}/shout", max_tokens=10,
                                               messages=[{"role": "user", "content": "Hi"}], temperature=0)
    assert reply.choices[0].message.content == " [FORCED]"


def test_a_client_that_disconnects_mid_stream_cancels_its_request_in_the_actor(served):
    import httpx
    import websockets

    url, _, actors = served
    generator = actors["raylens-generator"]
    ids = _prompt_ids(url)
    before = _stats(generator)
    request_id = f"leaver-{uuid.uuid4().hex[:8]}"

    async def leave_after_two_tokens():
        async with websockets.connect(url.replace("http://", "ws://") + "/api/v1/generate/stream") as ws:
            await ws.send(json.dumps({"type": "generate", "input_ids": ids, "max_new_tokens": 256,
                                      "ignore_eos": True, "request_id": request_id}))
            seen = []
            while len(seen) < 2:
                message = json.loads(await asyncio.wait_for(ws.recv(), 120))
                assert message["type"] == "token", message
                seen.append(message)
            running = await asyncio.to_thread(_stats, generator)
            # the same id again while it runs: the actor's engine refuses it, with its coded error
            dup = await asyncio.to_thread(httpx.post, f"{url}/api/v1/generate", timeout=60,
                                          json={"input_ids": ids, "max_new_tokens": 2, "request_id": request_id})
            return running, dup  # leaving the block closes the socket mid-stream

    running, dup = asyncio.run(leave_after_two_tokens())
    assert running["streaming"] == 1
    assert dup.status_code == 400 and dup.json()["error_code"] == "INVALID_REQUEST", dup.text
    assert dup.json()["parameter"] == "request_id"
    after = wait_until(lambda: (s := _stats(generator))["streaming"] == 0 and s["requests"] > before["requests"] and s,
                       timeout=60, what="the actor to end the abandoned request")
    assert after["cancelled"] - before["cancelled"] == 1
    assert after["tokens"] - before["tokens"] < 256  # it stopped early, not at max_new_tokens


def test_a_job_request_on_the_named_generator_shares_steps_with_an_http_stream(served):
    import ray
    import websockets

    url, _, actors = served
    generator = actors["raylens-generator"]
    ids = _prompt_ids(url)
    assert _stats(generator)["batch"]["max_active"] <= 1, "earlier tests ran requests side by side"

    async def stream_while_a_job_runs():
        async with websockets.connect(url.replace("http://", "ws://") + "/api/v1/generate/stream") as ws:
            await ws.send(json.dumps({"type": "generate", "input_ids": ids, "max_new_tokens": 200,
                                      "ignore_eos": True}))
            first = json.loads(await asyncio.wait_for(ws.recv(), 120))
            assert first["type"] == "token", first
            job = generator.generate.remote(GenerationRequest(input_ids=ids, max_tokens=4, ignore_eos=True))
            result = await asyncio.to_thread(ray.get, job, timeout=120)
            await ws.send(json.dumps({"type": "cancel"}))
            while (message := json.loads(await asyncio.wait_for(ws.recv(), 120)))["type"] not in ("done", "error"):
                pass
            return result, message

    result, done = asyncio.run(stream_while_a_job_runs())
    assert str(result.finish_reason) == "length" and len(result.output_ids) == 4
    assert done["type"] == "done" and done["finish_reason"] == "cancelled", done
    stats = wait_until(lambda: (s := _stats(generator))["streaming"] == 0 and s, timeout=60, what="the stream to end")
    assert stats["batch"]["max_active"] >= 2


def test_a_generator_that_encodes_inline_streams_each_tokens_sae_features_and_stores_them(ray_head, tmp_path):
    """``sae.mode: inline`` in the actor: features exist before each step's events, so the
    replica's sockets carry them (the routes' engine is the actor, through RemoteEngine) and the
    same rows reach the StoreActor."""
    import ray
    import websockets

    from pipelines.cluster.actor_specs import actor_roles
    from pipelines.cluster.ending import listed_names
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.remote_engine import RemoteEngine
    from pipelines.serve.settings import ServeSettings
    from tests.e2e.conftest import ray_config

    base = ray_config(tmp_path, sae_workers=1, sae_worker_num_cpus=0.25)
    config = dataclasses.replace(base, sae=dataclasses.replace(base.sae, mode="inline"))
    try:
        engine = RemoteEngine.connect(config)  # creates the config's actors, as `raylens serve` does
        generator = engine.generators[0]
        store = ray.get_actor(actor_roles(config)["raylens-store"], namespace=config.ray.namespace)
        with serve_in_thread(build_app(engine, ServeSettings(max_new_tokens=8))) as url:
            info = json.loads(__import__("httpx").get(f"{url}/api/v1/model/info", timeout=60).text)
            assert info["sae_features_available"] is True

            async def stream():
                async with websockets.connect(url.replace("http://", "ws://") + "/api/v1/generate/stream") as ws:
                    await ws.send(json.dumps({"type": "generate", "input_ids": engine.encode("Tell me a story"),
                                              "max_new_tokens": 4, "temperature": 0, "sae_features": True,
                                              "request_id": "inline-sae"}))
                    out = []
                    while True:
                        message = json.loads(await asyncio.wait_for(ws.recv(), 120))
                        out.append(message)
                        if message["type"] != "token":
                            return out

            messages = asyncio.run(stream())
        assert messages[-1]["type"] == "done", messages[-1]
        tokens = [m for m in messages if m["type"] == "token"]
        assert len(tokens) == 4
        for message in tokens:
            features = message["sae_features"]
            assert len(features["ids"]) == config.sae.top_k == len(features["values"])
            assert features["values"] == sorted(features["values"], reverse=True) and features["values"][0] > 0
        stats = ray.get(generator.drain.remote(), timeout=120)
        assert stats["sae"]["mode"] == "inline" and stats["sae"]["rows_written"] > 0
        stored = ray.get(store.sql.remote("select count(*) from activations where request_id = ?", ["inline-sae"]),
                         timeout=60)
        assert stored[0][0] > 0, "the inline rows never reached the StoreActor"
        named = sorted(listed_names(config.ray.namespace))
        assert not [n for n in named if n.startswith("raylens-sae")], f"idle SAE workers were started: {named}"
    finally:
        kill_namespace_actors(config)


def test_a_lost_generator_fails_its_running_request_with_503_and_the_next_request_succeeds(ray_head, tmp_path):
    """The generator is killed for good mid-request (no restart), after the request's first tokens
    (before them, the request would run again on another replica): that request ends with a
    retryable 503 (``Retry-After``, code ``UNAVAILABLE``), never a 500; the next request resolves
    the config's actors again (creating a generator) and succeeds."""
    import threading

    import httpx
    import ray

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.remote_engine import RemoteEngine
    from pipelines.serve.settings import ServeSettings
    from tests.e2e.conftest import ray_config

    base = ray_config(tmp_path)
    config = dataclasses.replace(base, sae=dataclasses.replace(base.sae, enabled=False))
    try:
        engine = RemoteEngine.connect(config)
        first_generator = engine.generators[0]
        ids = engine.encode("Tell me a long story")
        with serve_in_thread(build_app(engine, ServeSettings(max_new_tokens=512, request_timeout_s=300))) as url, \
                httpx.Client(base_url=url, timeout=300) as http:
            answer: dict = {}
            running = threading.Thread(target=lambda: answer.update(reply=http.post(
                "/api/v1/generate", json={"input_ids": ids, "max_new_tokens": 512, "ignore_eos": True})))
            running.start()
            wait_until(lambda: ray.get(first_generator.metrics.remote(), timeout=60).inter_token_latency.count >= 4,
                       timeout=120, what="the request to stream its first tokens")
            ray.kill(first_generator, no_restart=True)
            running.join(300)
            reply = answer["reply"]
            assert reply.status_code == 503, reply.text
            assert reply.json()["error_code"] == "UNAVAILABLE" and int(reply.headers["Retry-After"]) > 0
            after = http.post("/api/v1/generate", json={"input_ids": ids, "max_new_tokens": 3, "ignore_eos": True})
            assert after.status_code == 200, after.text
            assert len(after.json()["generated_tokens"]) == 3
            assert engine.generators[0] != first_generator, "the server kept the dead generator's handle"
            assert http.get("/health").status_code == 200
    finally:
        kill_namespace_actors(config)
