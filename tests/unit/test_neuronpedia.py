"""Neuronpedia enrichment against a local stub server (no internet): fetched once, then cached."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler

import pytest

from engine.services.neuronpedia import NeuronpediaClient, NeuronpediaError, explain_features
from engine.services.store import ActivationStore
from tests.helpers import loopback_http_server


class Stub(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802
        type(self).hits.append(self.path)
        parts = self.path.strip("/").split("/")  # api feature <model> <sae> <index>
        index = int(parts[-1])
        if index == 404:
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps({"modelId": parts[2], "layer": parts[3], "index": str(index),
                           "explanations": [{"description": f"feature {index} of {parts[3]}"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Stub.hits = []
    with loopback_http_server(Stub) as srv:
        yield f"http://127.0.0.1:{srv.server_address[1]}"


def test_explanations_are_fetched_once_and_cached_in_the_store(server, tmp_path):
    client = NeuronpediaClient(server)
    with ActivationStore(tmp_path / "a.duckdb") as store:
        kwargs = dict(sae_release="llama_scope_lxr_8x", sae_layer=16,
                      neuronpedia_id="llama3.1-8b/16-llamascope-res-32k")
        first = explain_features(store, client, feature_ids=[12, 404, 7], **kwargs).to_pylist()
        assert first == [{"feature_id": 7, "explanation": "feature 7 of 16-llamascope-res-32k"},
                         {"feature_id": 12, "explanation": "feature 12 of 16-llamascope-res-32k"},
                         {"feature_id": 404, "explanation": None}]
        assert sorted(Stub.hits) == sorted(f"/api/feature/llama3.1-8b/16-llamascope-res-32k/{i}" for i in (7, 12, 404))
        again = explain_features(store, client, feature_ids=[7, 12, 404], **kwargs).to_pylist()
        assert again == first and len(Stub.hits) == 3  # all answered from the cache
        explain_features(store, client, feature_ids=[7], refresh=True, **kwargs)
        assert len(Stub.hits) == 4
    client.close()


def test_an_sae_without_a_neuronpedia_id_and_an_unreachable_server_are_clear(tmp_path):
    client = NeuronpediaClient("http://127.0.0.1:9", timeout_s=0.5)  # nothing listens on port 9
    with ActivationStore(tmp_path / "a.duckdb") as store:
        with pytest.raises(NeuronpediaError, match="has no Neuronpedia id"):
            explain_features(store, client, sae_release="mine", sae_layer=16, neuronpedia_id=None, feature_ids=[1])
        with pytest.raises(NeuronpediaError, match="cannot reach Neuronpedia"):
            explain_features(store, client, sae_release="x", sae_layer=1, neuronpedia_id="m/s", feature_ids=[1])
    client.close()
