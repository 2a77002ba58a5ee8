"""Several generator replicas behind one endpoint, on a real local Ray head bound to 127.0.0.1:
cache-aware routing against one replica and against round-robin, ``/metrics`` against the
``usage`` the responses report, a replica's process killed under load, and ``raylens scale``.

Two replicas with small CPU shares on this machine. The prefix-cache test gives every replica a
small KV pool (``kv_cache_tokens``) that holds one system prompt's blocks beside a running request
but not two, and compares with one replica holding the pool of both — the same KV memory in all:
routing by prefix keeps each system prompt on one replica, taking turns makes both evict each
other's. Every request is greedy and sequential, so the hit counts are the same on every run.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading

import pytest

from tests.e2e.conftest import end_namespace, ray_config, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

POOL_TOKENS = 1024  # per replica: one ~650-token chat reserved, plus about 350 tokens of cached blocks


def _config(tmp_path, *, router: str = "affinity", generators: int = 2, pool: int = POOL_TOKENS, **ray):
    config = ray_config(tmp_path, generators=generators, router=router, generator_num_cpus=0.5,
                        generator_max_concurrency=4, **ray)
    config = dataclasses.replace(config, sae=dataclasses.replace(config.sae, enabled=False),
                                 backend=dataclasses.replace(config.backend, kv_cache_tokens=pool,
                                                             extract_attention=False, extract_hidden_states=False))
    return config.with_paths_under(tmp_path)


def _remote(config):
    from pipelines.serve.remote_engine import RemoteEngine

    return RemoteEngine.connect(config)


def _run_chats(config, order, systems) -> tuple[int, int, dict]:
    """The chats one after another through the server's engine; (prefix-hit tokens, prompt tokens,
    router decisions) summed over the replicas."""
    from engine.core.inputs import GenerationRequest

    engine = _remote(config)
    try:
        for chat in order:
            request = GenerationRequest(messages=chat.prompt(0, systems[chat.system]), max_tokens=2, temperature=0)
            engine.submit(request).result(timeout=300)
        metrics = engine.replica_metrics()
        assert all(m is not None for m in metrics.values()), f"a replica did not answer: {metrics}"
        return (sum(m.prefix_cache_hits for m in metrics.values()), sum(m.prompt_tokens for m in metrics.values()),
                engine.router_stats().decisions)
    finally:
        engine.replicas.close()
        end_namespace(config.ray.namespace)


def test_affinity_routing_keeps_most_of_one_replicas_prefix_hits_and_round_robin_does_not(ray_head, tmp_path):
    from pipelines.bench.chat_workload import chats, interleaved, system_prompt

    systems = [system_prompt(0), system_prompt(1)]
    order = interleaved(chats(2, 8, 1), run=2)  # 16 chats: A A B B A A …
    one, one_prompt, _ = _run_chats(_config(tmp_path / "one", generators=1, pool=2 * POOL_TOKENS), order, systems)
    affinity, aff_prompt, decisions = _run_chats(_config(tmp_path / "aff"), order, systems)
    turns, rr_prompt, _ = _run_chats(_config(tmp_path / "rr", router="round_robin"), order, systems)
    assert one_prompt == aff_prompt == rr_prompt, "the three runs must send the same prompts"
    assert one > one_prompt // 2, f"one replica must reuse the system prompts: {one} hit of {one_prompt} tokens"
    assert affinity >= 0.8 * one, (f"affinity routing must reach 80% of one replica's prefix hits: {affinity} vs "
                                   f"{one} tokens ({affinity / one:.0%}); decisions {decisions}")
    assert turns < 0.8 * one, (f"round-robin must fall below that bar (positive control): {turns} vs {one} tokens "
                               f"({turns / one:.0%})")
    assert sum(n for (_, reason), n in decisions.items() if reason == "prefix") >= 12, decisions


def _sse_chat(url: str, model: str, messages, out: dict, key: str, max_tokens: int) -> None:
    """One streamed chat completion; ``out[key]`` gets its parsed chunks (and ``[DONE]``)."""
    import json

    import httpx

    chunks: list = []
    out[key] = chunks
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                chunks.append(data if data == "[DONE]" else json.loads(data))


def test_a_replica_killed_under_load_loses_no_request_and_rejoins(ray_head, tmp_path):
    """SIGKILL of one replica's process while it streams two SSE chats and prefills a third
    request, and the other replica serves two more: the streams under way end with a clean
    UNAVAILABLE error event and ``[DONE]``; the request that had sent no token runs again on the
    other replica and completes; the other replica's requests complete; nothing hangs or goes
    missing. Ray restarts the replica; the router takes it back and it serves again."""
    import ray

    from engine.core.inputs import GenerationRequest
    from engine.errors import ReplicaLostError
    from pipelines.bench.chat_workload import system_prompt
    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    config = _config(tmp_path, pool=None)
    system = system_prompt(0)
    engine = _remote(config)
    try:
        warm = engine.submit(GenerationRequest(messages=[{"role": "system", "content": system},
                                                         {"role": "user", "content": "Hello"}], max_tokens=1))
        warm.result(timeout=300)
        victim, survivor = warm.replica, next(n for n in engine.replicas.handles if n != warm.replica)
        handle = engine.replicas.handles[victim]
        old_pid = ray.get(handle.stats.remote(), timeout=120)["pid"]
        wait_until(lambda: engine.router_stats().replicas[victim].cached_blocks > 0, timeout=60,
                   what="the victim to report the system prompt's blocks")
        model = engine.backend.info.model_id
        streams: dict = {}
        with serve_in_thread(build_app(engine, ServeSettings(max_new_tokens=256, request_timeout_s=300))) as url:
            sse = [threading.Thread(target=_sse_chat, args=(url, model, [
                {"role": "system", "content": system}, {"role": "user", "content": f"Tell me story {i}."}], streams,
                f"sse{i}", 200)) for i in range(2)]
            for thread in sse:
                thread.start()
            wait_until(lambda: len(streams) == 2 and all(any(isinstance(c, dict) and c.get("choices") and
                                                             c["choices"][0]["delta"].get("content")
                                                             for c in s) for s in streams.values()),
                       timeout=300, what="both SSE streams to carry tokens")
            others = [engine.submit(GenerationRequest(prompt=f"Count to {n}.", max_tokens=24, ignore_eos=True,
                                                      temperature=0)) for n in (5, 9)]
            long_question = " ".join(f"item{i}" for i in range(700))
            fresh = engine.submit(GenerationRequest(messages=[{"role": "system", "content": system},
                                                              {"role": "user", "content": long_question}],
                                                    max_tokens=4, temperature=0))
            assert fresh.replica == victim, "the long request must go where its system prompt is cached"
            assert not fresh.streamed, "the long request must still be in its prefill when the replica dies"
            os.kill(old_pid, signal.SIGKILL)
            for thread in sse:
                thread.join(300)
            assert not any(t.is_alive() for t in sse), "an SSE stream hangs after its replica died"
        outcomes = {}
        for name, h in [("fresh", fresh), *((f"other{i}", h) for i, h in enumerate(others))]:
            try:
                outcomes[name] = h.result(timeout=300)
            except ReplicaLostError as err:
                outcomes[name] = err
        assert len(outcomes) == 3
        assert not isinstance(outcomes["fresh"], Exception) and outcomes["fresh"].request_id.endswith("-retry1"), \
            outcomes["fresh"]
        assert fresh.reruns == 1 and fresh.replica == survivor
        for name in ("other0", "other1"):  # on the survivor, or on the victim before a token: either way they end well
            assert not isinstance(outcomes[name], Exception), (name, outcomes[name])
            assert len(outcomes[name].output_ids) == 24
        for key, chunks in streams.items():
            assert chunks[-1] == "[DONE]", f"{key} did not end with [DONE]: {chunks[-3:]}"
            error = chunks[-2].get("error") if isinstance(chunks[-2], dict) else None
            assert error and error["code"] == "unavailable", f"{key} must end with a clean error event: {chunks[-3:]}"
        assert engine.reruns >= 1

        def back() -> bool:
            status = engine.router_stats().replicas.get(victim)
            return bool(status and status.up)

        wait_until(back, timeout=300, what="the killed replica to restart and rejoin the router")
        assert ray.get(handle.stats.remote(), timeout=120)["pid"] != old_pid
        placed = []
        for n in range(4):  # no full block to match (8 tokens): least loaded, ties taking turns
            h = engine.submit(GenerationRequest(input_ids=[100 + n + i for i in range(8)], max_tokens=2,
                                                temperature=0))
            h.result(timeout=300)
            placed.append(h.replica)
        assert victim in placed, f"the rejoined replica got none of {placed}"
    finally:
        engine.replicas.close()
        end_namespace(config.ray.namespace)


def _scrape(url: str) -> dict[tuple, float]:
    """``/metrics`` parsed by prometheus_client: (sample name, sorted labels without model_name) -> value."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    reply = httpx.get(f"{url}/metrics", timeout=120)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain"), reply.text[:300]
    samples = {}
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def _grew(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_parse_and_their_token_counters_equal_the_usage_responses_report(ray_head, tmp_path):
    import httpx

    from pipelines.serve.app import build_app
    from pipelines.serve.local import serve_in_thread
    from pipelines.serve.settings import ServeSettings

    config = _config(tmp_path, pool=None)
    engine = _remote(config)
    labels = [engine.replicas.label(n) for n in engine.replicas.handles]
    assert labels == ["0", "1"]
    model = engine.backend.info.model_id
    try:
        with serve_in_thread(build_app(engine, ServeSettings(max_new_tokens=64, request_timeout_s=300))) as url, \
                httpx.Client(base_url=url, timeout=300) as http:
            before = _scrape(url)
            usage = []
            for i, question in enumerate(("Name a colour.", "Name a fruit.", "Name a river.", "Name a city.")):
                body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 3 + i,
                        "temperature": 0}
                if i % 2:  # streamed, with the usage chunk at the end
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                    import json

                    lines = [line[6:] for line in http.post("/v1/chat/completions", json=body).text.splitlines()
                             if line.startswith("data: {")]
                    usage.append(json.loads(lines[-1])["usage"])
                else:
                    usage.append(http.post("/v1/chat/completions", json=body).json()["usage"])
            after = _scrape(url)
            for name, field in (("vllm:prompt_tokens_total", "prompt_tokens"),
                                ("vllm:generation_tokens_total", "completion_tokens")):
                want = sum(u[field] for u in usage)
                total = _grew(before, after, name, replica="total")
                per_replica = sum(_grew(before, after, name, replica=label) for label in labels)
                assert total == per_replica == want, f"{name}: total {total}, replicas {per_replica}, usage {want}"
            assert _grew(before, after, "vllm:e2e_request_latency_seconds_count", replica="total") == 4
            assert _grew(before, after, "vllm:time_to_first_token_seconds_count", replica="total") == 4
            assert _grew(before, after, "vllm:prefix_cache_queries_total", replica="total") == sum(
                u["prompt_tokens"] for u in usage)
            for label in labels:
                assert ("vllm:kv_cache_usage_perc", (("replica", label),)) in after
                assert after[("raylens:replica_up", (("replica", label),))] == 1.0
            decisions = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "raylens:router_decisions_total")
            assert decisions == 4
            assert ("raylens:ingest_delivered_total", ()) in after

            # n = 2: both choices on one replica, as one group
            reply = http.post("/v1/chat/completions", json={"model": model, "n": 2, "max_tokens": 3, "temperature": 1.0,
                                                            "seed": 5, "messages": [{"role": "user", "content": "Hi"}]})
            assert reply.status_code == 200 and len(reply.json()["choices"]) == 2, reply.text
            last = _scrape(url)
            finished = {label: sum(v - after.get(k, 0.0) for k, v in last.items()
                                   if k[0] == "vllm:request_success_total" and ("replica", label) in k[1])
                        for label in labels}
            assert sorted(finished.values()) == [0, 2], f"the two choices ran on {finished}"
            assert sum(v - after.get(k, 0.0) for k, v in last.items()
                       if k[0] == "raylens:router_decisions_total" and ("reason", "group") in k[1]) == 1
    finally:
        engine.replicas.close()
        end_namespace(config.ray.namespace)


def test_raylens_scale_adds_and_removes_replicas_without_dropping_a_request(ray_head, tmp_path, capsys):
    """Requests flow the whole time (two at once); `raylens scale 2` adds a replica the server's
    router starts using, `raylens scale 1` drains it and ends it: every request completes."""
    import json

    import yaml

    from engine.core.inputs import GenerationRequest
    from pipelines.cli import main
    from pipelines.cluster.scaling import running_replicas

    config = _config(tmp_path, generators=1, pool=None)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    engine = _remote(config)
    stop, outcomes, lock = threading.Event(), [], threading.Lock()

    def load(worker: int) -> None:
        n = 0
        while not stop.is_set() and n < 400:  # bounded, whatever happens
            n += 1
            handle = engine.submit(GenerationRequest(input_ids=[200 + worker, 300 + n % 50, 7, 8], max_tokens=4,
                                                     temperature=0, ignore_eos=True))
            try:
                result = handle.result(timeout=300)
                outcome = (handle.replica, len(result.output_ids))
            except Exception as err:  # recorded; the test fails on it below
                outcome = (handle.replica, err)
            with lock:
                outcomes.append(outcome)

    workers = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(2)]
    try:
        for w in workers:
            w.start()
        assert main(["scale", "2", "--config", str(path)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["replicas"] == [0, 1] and report["added"] == [1] and report["removed"] == []
        new = next(n for n in running_replicas(config).values() if n.endswith("-1"))
        wait_until(lambda: any(replica == new for replica, _ in list(outcomes)), timeout=300,
                   what="the server's router to send requests to the added replica")
        assert main(["scale", "1", "--config", str(path)]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["replicas"] == [0] and report["removed"] == [1] and report["still_draining"] == []
        count = len(outcomes)
        wait_until(lambda: len(outcomes) >= count + 4, timeout=300, what="requests after the scale-down")
        stop.set()
        for w in workers:
            w.join(300)
        assert not any(w.is_alive() for w in workers), "a request hangs"
        failed = [o for o in outcomes if not isinstance(o[1], int) or o[1] != 4]
        assert not failed, f"{len(failed)} of {len(outcomes)} requests failed across the scaling: {failed[:3]}"
        assert {replica for replica, _ in outcomes} == {new, next(iter(running_replicas(config).values()))}

        def replica_set_matches() -> bool:
            # The set is looked at again when it is used (routing, stats, a metrics scrape), never by a
            # thread of its own; the load has stopped here, so the test uses it as an idle server's
            # scrape would (waiting on `handles` alone would wait on a view nobody refreshes).
            engine.replicas.stats()
            return list(engine.replicas.handles) == list(running_replicas(config).values())

        wait_until(replica_set_matches, timeout=60, what="the server's replica set to drop the removed replica")
    finally:
        stop.set()
        for w in workers:  # a failed check must not leave threads calling Ray into the next test
            if w.ident is not None:
                w.join(300)
        engine.replicas.close()
        end_namespace(config.ray.namespace)
