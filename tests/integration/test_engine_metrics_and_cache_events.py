"""The two engine interfaces replicas are routed and watched by, on the embedded model:
``Engine.cache_events`` reports exactly the blocks the prefix index holds (and a reader of it
predicts the next hit), and ``Engine.metrics`` counts what the results report; ``/metrics`` of the
in-process server renders them under vLLM's names and parses back."""

from __future__ import annotations

import pytest

from engine.cache_events import apply_events, leading_block_keys
from tests.helpers import build_config

pytestmark = pytest.mark.slow

BLOCK = 16
SYSTEM = ("You are a careful assistant for a small public library. Answer questions about opening hours, "
          "borrowing rules, the reading room and events for children. Keep every answer to two sentences "
          "and name the desk a visitor should go to when you are not sure.")


@pytest.fixture(scope="module")
def eng():
    from engine import Engine

    with Engine(build_config(kv_block_size=BLOCK, extract_attention=False)) as e:
        yield e


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_cache_events_follow_the_prefix_index_and_predict_the_next_hit(eng):
    view: set[bytes] = set()
    answer = eng.cache_events(None)
    apply_events(view, answer.events)
    cursor = answer.cursor
    assert answer.block_size == BLOCK
    first = eng.generate(messages=_chat("When do you open?"), max_tokens=3, temperature=0)
    answer = eng.cache_events(cursor)
    apply_events(view, answer.events)
    assert not answer.resync and answer.events, "the first request's blocks must be reported stored"
    assert view == set(eng.loop.scheduler.kv.index._by_key), "the reader's set must equal the index's keys"
    keys = leading_block_keys(eng.encode(messages=_chat("Can I borrow films?")), BLOCK)
    predicted = 0
    for key in keys:  # the run of this prompt's leading blocks the reader knows to be cached
        if key not in view:
            break
        predicted += 1
    assert predicted > 0 and predicted < len(keys), f"the shared system prompt must match, the question not: " \
                                                    f"{predicted} of {len(keys)}"
    hits_before = eng.cache_stats()["hit_tokens"]
    eng.generate(messages=_chat("Can I borrow films?"), max_tokens=3, temperature=0)
    assert eng.cache_stats()["hit_tokens"] - hits_before == predicted * BLOCK
    assert first.prompt_ids  # (the first request ran)


def test_metrics_count_the_tokens_the_results_report(eng):
    before = eng.metrics()
    results = [eng.generate(messages=_chat(q), max_tokens=n, temperature=0)
               for q, n in (("Is there wifi?", 4), ("Where is the reading room?", 2))]
    after = eng.metrics()
    assert after.prompt_tokens - before.prompt_tokens == sum(len(r.prompt_ids) for r in results)
    assert after.generation_tokens - before.generation_tokens == sum(len(r.output_ids) for r in results)
    assert after.e2e_request_latency.count - before.e2e_request_latency.count == 2
    assert after.time_to_first_token.count - before.time_to_first_token.count == 2
    tokens = sum(len(r.sequence_ids) for r in results)  # one commit per sampled token, the first timed as TTFT
    assert after.inter_token_latency.count - before.inter_token_latency.count == tokens - 2
    assert after.steps > before.steps and after.running == 0 and after.waiting == 0
    assert after.prefix_cache_queries - before.prefix_cache_queries == sum(len(r.prompt_ids) for r in results)
    assert after.prefix_cache_hits > before.prefix_cache_hits  # the shared system prompt was reused
    assert sum(after.requests_finished.values()) - sum(before.requests_finished.values()) == 2
    assert after.sae is None and after.ingest is None  # this engine has neither


def test_mod_calls_and_errors_are_counted(eng):
    from mods import ForwardPass, mod

    @mod
    def fails_once(event, actions, tokenizer):
        if isinstance(event, ForwardPass) and event.step == 1:
            raise RuntimeError("a mod that raises once")
        return actions.noop()

    before = eng.metrics()
    result = eng.generate(messages=_chat("Hello"), max_tokens=3, temperature=0, ignore_eos=True, mods=[fails_once])
    after = eng.metrics()
    calls = after.mod_calls - before.mod_calls
    assert calls >= result.metadata["steps"], f"{calls} mod calls for {result.metadata['steps']} steps"
    assert after.mod_errors - before.mod_errors == 1
    assert after.mod_seconds > before.mod_seconds
    assert after.mod_seconds_per_step.count - before.mod_seconds_per_step.count == 1
    plain = eng.metrics()  # positive control: a request without mods adds no call
    eng.generate(messages=_chat("Hello"), max_tokens=2, temperature=0)
    assert eng.metrics().mod_calls == plain.mod_calls


def test_the_in_process_server_renders_metrics_that_parse_and_match_usage(eng):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    def scrape(url: str) -> dict[tuple[str, str], float]:
        text = httpx.get(f"{url}/metrics", timeout=60).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if "le" not in s.labels and "finished_reason" not in s.labels:
                    samples[(s.name, s.labels.get("replica", ""))] = s.value
        return samples

    with serve_in_thread(build_app(eng, ServeSettings(max_new_tokens=16))) as url:
        before = scrape(url)
        usage = [httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": eng.backend.info.model_id, "messages": _chat(q), "max_tokens": 3, "temperature": 0}).json()["usage"]
            for q in ("Do you have maps?", "Are dogs allowed?")]
        after = scrape(url)
    for name, field in (("vllm:prompt_tokens_total", "prompt_tokens"),
                        ("vllm:generation_tokens_total", "completion_tokens")):
        for replica in ("0", "total"):
            got = after[(name, replica)] - before[(name, replica)]
            assert got == sum(u[field] for u in usage), f"{name}{{replica={replica}}} grew {got}, usage says {usage}"
    assert after[("vllm:e2e_request_latency_seconds_count", "total")] - \
        before[("vllm:e2e_request_latency_seconds_count", "total")] == 2
    assert 0.0 <= after[("vllm:kv_cache_usage_perc", "0")] <= 1.0


def test_metrics_sit_behind_the_api_key_like_every_route_but_health(eng):
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    key = "metrics-key-0123456789"
    with serve_in_thread(build_app(eng, ServeSettings(api_key=key, max_new_tokens=8))) as url:
        assert httpx.get(f"{url}/metrics", timeout=60).status_code == 401
        scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert scraped.status_code == 200 and "vllm:num_requests_running" in scraped.text
