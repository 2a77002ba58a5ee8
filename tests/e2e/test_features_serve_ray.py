"""The feature browser under Ray Serve: the store belongs to the StoreActor (DuckDB lets no other
process open its file), so the replica's routes ask that actor. A request served over HTTP is
encoded by the SAE workers into the store, and the browser's three routes show it: the request
list, its tokens with their features, and a feature's contexts. The store's typed errors cross
the actor boundary as coded answers (an unknown request is ``NOT_FOUND``, a feature id out of
range ``INVALID_REQUEST``), never ``NO_STORE`` or a 500."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import free_port, kill_namespace_actors, ray_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def served(ray_head, tmp_path_factory):
    import ray
    from ray import serve

    from pipelines.cluster.actor_specs import actor_roles
    from pipelines.serve.deployment import APP_NAME, deploy
    from pipelines.serve.settings import ServeSettings

    settings = ServeSettings(host="127.0.0.1", port=free_port(), max_new_tokens=64, request_timeout_s=120)
    config = ray_config(tmp_path_factory.mktemp("features-serve"))  # the committed SAE on, on SAE workers
    try:
        url = deploy(config, settings)
        generator = ray.get_actor(actor_roles(config)["raylens-generator"], namespace=config.ray.namespace)
        yield url, generator
    finally:
        serve.delete(APP_NAME)
        serve.shutdown()
        kill_namespace_actors(config)


def test_the_browser_reads_the_store_through_its_actor(served):
    import httpx
    import ray

    url, generator = served
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "embedded:smollm2-135m-instruct", "messages": [{"role": "user", "content": "Tell me about dragons"}], "max_tokens": 8,
        "temperature": 0})
    assert answer.status_code == 200, answer.text
    ray.get(generator.drain.remote(), timeout=120)  # every SAE block stored before browsing

    listed = httpx.get(f"{url}/api/v1/requests", timeout=60)
    assert listed.status_code == 200, listed.text
    requests = listed.json()["requests"]
    assert len(requests) == 1 and requests[0]["activation_rows"] > 0, requests
    request_id = requests[0]["request_id"]

    detail = httpx.get(f"{url}/api/v1/requests/{request_id}", timeout=60).json()
    assert detail["output_text"] == answer.json()["choices"][0]["message"]["content"]
    tokens = [t for t in detail["tokens"] if t["features"]]
    assert tokens and all(t["text"] is not None for t in tokens), "token text comes from the replica's tokenizer"
    feature_id = tokens[-1]["features"][0]["feature_id"]

    feature = httpx.get(f"{url}/api/v1/features/{feature_id}", timeout=60).json()
    assert feature["tokens_fired"] >= 1 and feature["histogram"], feature
    assert request_id in {c["request_id"] for c in feature["contexts"]}
    coloured = httpx.get(f"{url}/api/v1/requests/{request_id}", params={"feature": feature_id}, timeout=60).json()
    assert max(t["feature_activation"] for t in coloured["tokens"]) > 0

    missing = httpx.get(f"{url}/api/v1/requests/no-such-request", timeout=60)
    assert missing.status_code == 404 and missing.json()["error_code"] == "NOT_FOUND", missing.text
    out_of_range = httpx.get(f"{url}/api/v1/features/{2**40}", timeout=60)
    assert out_of_range.status_code == 400 and out_of_range.json()["error_code"] == "INVALID_REQUEST", \
        out_of_range.text
