"""The feature browser's JSON routes over a store with known rows, on a loopback server, with and
without an engine: contexts, histogram, firing frequency, requests, coded errors, bounds."""

from __future__ import annotations

import httpx
import pytest

from engine.services.store import ActivationStore
from tests.feature_rows import ERASED, FEATURE_7, REQUESTS, TOK, fill_store, token_count
from tests.helpers import scripted_engine

NEURONPEDIA = "https://np.example"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("browse") / "activations.duckdb"
    with ActivationStore(path, threads=1) as store:
        fill_store(store)
    return path


@pytest.fixture(scope="module")
def client(store_path):
    """The engine-free browser app on a read-only open of the store, with token text."""
    from pipelines.serve.app import build_browser_app
    from pipelines.serve.local import serve_in_thread

    with ActivationStore(store_path, read_only=True) as store:
        app = build_browser_app(store, tokenizer=TOK, neuronpedia_url=NEURONPEDIA)
        with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
            yield http


def _error(response, status, code):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error_code"] == code, body
    return body


def test_a_features_top_contexts_highlight_the_token_with_its_activation(client):
    data = client.get("/api/v1/features/7", params={"window": 4}).json()
    contexts = data["contexts"]
    assert [(c["request_id"], c["position"], c["activation"]) for c in contexts] == sorted(
        FEATURE_7, key=lambda f: -f[2])
    top = contexts[0]
    assert top["token"] == {"position": 4, "token_id": TOK.encode("c")[0], "text": "c"}
    assert "".join(t["text"] for t in top["before"]) == "The "  # 4 tokens either side
    assert "".join(t["text"] for t in top["after"]) == "at s"
    dog = contexts[1]
    assert "".join(t["text"] for t in dog["before"]) == "A " and dog["token"]["text"] == "d"


def test_a_features_frequency_and_histogram_count_the_stored_tokens(client):
    data = client.get("/api/v1/features/7", params={"buckets": 4}).json()
    assert data["tokens_fired"] == len(FEATURE_7) and data["tokens"] == token_count()
    assert data["frequency"] == pytest.approx(len(FEATURE_7) / token_count(), rel=1e-9)
    assert data["max_activation"] == pytest.approx(9.5) and data["mean_activation"] == pytest.approx(15.75 / 3)
    # 2.0, 4.25 and 9.5 in 4 equal bins over [2.0, 9.5]: 1, 1, 0, 1
    assert [b["count"] for b in data["histogram"]] == [1, 1, 0, 1]
    assert data["histogram"][0]["low"] == pytest.approx(2.0) and data["histogram"][-1]["high"] == pytest.approx(9.5)
    everywhere = client.get("/api/v1/features/3").json()
    assert everywhere["tokens_fired"] == everywhere["tokens"] == token_count() and everywhere["frequency"] == 1.0
    assert sum(b["count"] for b in everywhere["histogram"]) == token_count()


def test_neuronpedia_links_come_from_the_saes_id_mapping(client):
    links = client.get("/api/v1/features/7").json()["neuronpedia"]
    assert links == [{"sae_release": "llama_scope_lxr_8x", "sae_layer": 12,
                      "url": f"{NEURONPEDIA}/llama3.1-8b/12-llamascope-res-32k/7"}]


def test_a_feature_that_never_fired_is_an_empty_answer(client):
    data = client.get("/api/v1/features/99").json()
    assert (data["tokens_fired"], data["contexts"], data["histogram"]) == (0, [], [])
    assert data["tokens"] == token_count() and data["frequency"] == 0.0


@pytest.mark.parametrize("path", ["/api/v1/features/-1", "/api/v1/features/abc", f"/api/v1/features/{2**40}",
                                  "/api/v1/features/7?limit=0", "/api/v1/features/7?limit=100000",
                                  "/api/v1/features/7?window=65", "/api/v1/requests?limit=501",
                                  "/api/v1/requests/req-cat?feature=-3", "/api/v1/requests/" + "r" * 600])
def test_bad_ids_and_limits_are_coded_400s(client, path):
    _error(client.get(path), 400, "INVALID_REQUEST")


def test_the_newest_requests_come_first_with_their_counts(client):
    rows = client.get("/api/v1/requests").json()["requests"]
    assert [r["request_id"] for r in rows] == ["req-dog", "req-cat"]
    dog = rows[0]
    assert dog["prompt_preview"] == "A dog ran" and dog["output_preview"] == " home." and dog["tokens"] == 15
    assert dog["activation_rows"] == 15 + 1  # feature 3 everywhere, feature 7 once
    assert [r["request_id"] for r in client.get("/api/v1/requests", params={"limit": 1}).json()["requests"]] == [
        "req-dog"]


def test_a_requests_tokens_carry_their_strongest_features_and_the_chosen_one(client):
    data = client.get("/api/v1/requests/req-cat", params={"feature": 7, "top": 2}).json()
    prompt, output = REQUESTS["req-cat"]
    assert "".join(t["text"] for t in data["tokens"]) == prompt + output  # the erased "X" is left out
    assert data["tokens"][ERASED[1]]["step"] == ERASED[2] + 1
    assert data["prompt_tokens"] == len(prompt) and data["finish_reason"] == "stop"
    by_position = {t["position"]: t for t in data["tokens"]}
    assert by_position[4]["feature_activation"] == pytest.approx(9.5)
    assert by_position[19]["feature_activation"] == pytest.approx(2.0)
    assert sum(t["feature_activation"] > 0 for t in data["tokens"]) == 2
    assert [f["feature_id"] for f in by_position[4]["features"]] == [7, 3]
    assert by_position[4]["features"][1]["activation"] == pytest.approx(0.54)
    plain = client.get("/api/v1/requests/req-cat").json()
    assert plain["feature"] is None and "feature_activation" not in plain["tokens"][0]
    assert [f["feature_id"] for f in plain["tokens"][0]["features"]] == [3]


def test_dense_features_are_flagged_and_a_requests_features_rank_by_specificity(client):
    """Feature 3 fires at every stored token (dense: it says nothing about a request); feature 7 at
    three. A request lists its features most specific first — peak activation over the feature's
    store-wide mean — and flags the dense one wherever it appears."""
    assert client.get("/api/v1/features/3").json()["dense"] is True
    assert client.get("/api/v1/features/7").json()["dense"] is False
    data = client.get("/api/v1/requests/req-cat").json()
    ranked = data["features"]
    assert [(f["feature_id"], f["dense"]) for f in ranked] == [(7, False), (3, True)]
    n = token_count()
    assert ranked[0]["specificity"] == pytest.approx(9.5 / (sum(v for _, _, v in FEATURE_7) / n))
    assert ranked[0]["store_frequency"] == pytest.approx(len(FEATURE_7) / n) and ranked[1]["store_frequency"] == 1.0
    assert ranked[1]["specificity"] < 2 < ranked[0]["specificity"]
    by_position = {t["position"]: t for t in data["tokens"]}
    assert [(f["feature_id"], f["dense"]) for f in by_position[4]["features"]] == [(7, False), (3, True)]
    assert client.get("/api/v1/requests/req-cat", params={"features": 1}).json()["features"][0]["feature_id"] == 7


def test_an_unknown_request_is_not_found(client):
    body = _error(client.get("/api/v1/requests/no-such-request"), 404, "NOT_FOUND")
    assert body["parameter"] == "request_id"


def test_the_browser_page_is_served_without_an_engine(client):
    home = client.get("/")
    assert home.status_code == 200 and 'src="static/features.js"' in home.text
    assert client.get("/features").text == home.text
    assert client.get("/static/features.js").status_code == 200
    assert client.get("/healthz").json()["model"] is None


def test_without_a_tokenizer_tokens_have_ids_and_no_text(store_path):
    from pipelines.serve.app import build_browser_app
    from pipelines.serve.local import serve_in_thread

    with ActivationStore(store_path, read_only=True) as store, serve_in_thread(build_browser_app(store)) as url:
        data = httpx.get(f"{url}/api/v1/features/7", timeout=30).json()
    assert data["contexts"][0]["token"] == {"position": 4, "token_id": TOK.encode("c")[0], "text": None}
    assert data["neuronpedia"] == []  # no Neuronpedia URL configured: no links


def test_no_store_is_a_coded_error_and_an_engines_app_reads_the_store_it_is_given(store_path):
    from pipelines.serve.app import build_app, build_browser_app
    from pipelines.serve.local import serve_in_thread

    with serve_in_thread(build_browser_app(None)) as url:
        for path in ("/api/v1/features/7", "/api/v1/requests", "/api/v1/requests/req-cat"):
            _error(httpx.get(url + path, timeout=30), 404, "NO_STORE")
    engine = scripted_engine()
    assert engine.store is None
    with serve_in_thread(build_app(engine)) as url:
        _error(httpx.get(f"{url}/api/v1/features/7", timeout=30), 404, "NO_STORE")
        assert 'href="features"' in httpx.get(url, timeout=30).text  # the viewer links to the browser
    with ActivationStore(store_path, read_only=True) as store, serve_in_thread(build_app(engine, store=store)) as url:
        data = httpx.get(f"{url}/api/v1/features/7", timeout=30).json()
        assert data["contexts"][0]["token"]["text"] == "c"  # the engine's tokenizer gives the text
        assert httpx.get(f"{url}/healthz", timeout=30).json()["model"] == engine.backend.info.model_id


def test_the_routes_sit_behind_the_api_key(store_path):
    from pipelines.serve.app import build_browser_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    with ActivationStore(store_path, read_only=True) as store, \
            serve_in_thread(build_browser_app(store, ServeSettings(api_key="k" * 12))) as url:
        _error(httpx.get(f"{url}/api/v1/features/7", timeout=30), 401, "UNAUTHORIZED")
        assert httpx.get(f"{url}/api/v1/features/7", params={"api_key": "k" * 12}, timeout=30).status_code == 200


def test_a_request_id_is_data_never_sql(client):
    _error(client.get("/api/v1/requests/req-cat' OR '1'='1"), 404, "NOT_FOUND")
