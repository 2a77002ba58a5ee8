"""Benchmark: cache-aware routing against round-robin over replicas (``raylens bench --routing``).

The same chat workload (:mod:`pipelines.bench.chat_workload`: conversations sharing long system
prompts, several turns each, each turn carrying the whole conversation) runs through the server's
engine (:class:`~pipelines.serve.remote_engine.RemoteEngine`, the replica router in front of the
GeneratorActors) three times, each on fresh actors with cold caches:

* ``one replica`` with the KV pool of all replicas together (the same KV memory: the reference);
* ``affinity`` (``ray.router: affinity``) over ``replicas`` replicas;
* ``round_robin`` over the same replicas.

Per run: the prompt tokens found in the prefix cache (summed over replicas, from ``/metrics``'
source), their share of all prompt tokens, and TTFT p50/p90 as a client sees it (submission to the
first token event on the handle, routing included). ``concurrency`` conversations run at once,
each turn after the last one's answer. Each replica's KV pool is ``pool_tokens``: enough for the
running conversations and part of the system prompts' blocks, so where a system prompt's requests
land decides what stays cached — as on a GPU whose memory holds part of the working set.

Runs on a Ray instance of its own (``ray.init(address="local")``), never a running cluster.
"""

from __future__ import annotations

import dataclasses
import queue
import statistics
import threading
import time
import uuid
from typing import Any, Callable

__all__ = ["run_routing_bench", "format_routing"]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else 0.0


def _run_policy(config: Any, conversations: list[Any], systems: list[str], *, turns: int, concurrency: int,
                max_tokens: int) -> dict[str, Any]:
    from engine.core.inputs import GenerationRequest
    from pipelines.cluster.ending import end_named_actors, listed_names
    from pipelines.serve.remote_engine import RemoteEngine

    engine = RemoteEngine.connect(config)
    try:
        before = engine.replica_metrics()
        todo: queue.Queue = queue.Queue()
        for chat in conversations:
            todo.put(chat)
        ttfts: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()

        def worker() -> None:
            while True:
                try:
                    chat = todo.get_nowait()
                except queue.Empty:
                    return
                for turn in range(turns):
                    started, first = time.perf_counter(), None
                    try:
                        handle = engine.submit(GenerationRequest(messages=chat.prompt(turn, systems[chat.system]),
                                                                 max_tokens=max_tokens, temperature=0))
                        for _ in handle:
                            if first is None:
                                first = time.perf_counter() - started
                        result = handle.result(timeout=600)
                    except Exception as err:  # counted and reported (the row shows it); the run goes on
                        with lock:
                            errors.append(f"{type(err).__name__}: {err}")
                        break
                    chat.answer(turn, result.output_text)
                    with lock:
                        ttfts.append(first if first is not None else time.perf_counter() - started)

        started = time.perf_counter()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3600)
        seconds = time.perf_counter() - started
        after = engine.replica_metrics()
        stats = engine.router_stats()
    finally:
        engine.replicas.close()
        # the next run's replicas start on a cluster these no longer hold
        end_named_actors(config.ray.namespace, sorted(listed_names(config.ray.namespace)),
                         timeout_s=config.ray.call_timeout_s)
    hits = sum(after[k].prefix_cache_hits - before[k].prefix_cache_hits for k in after)
    prompt = sum(after[k].prefix_cache_queries - before[k].prefix_cache_queries for k in after)
    reasons: dict[str, int] = {}
    for (_, reason), n in stats.decisions.items():
        reasons[reason] = reasons.get(reason, 0) + n
    return {"requests": len(ttfts), "errors": errors, "prompt_tokens": prompt, "prefix_hit_tokens": hits,
            "hit_share": round(hits / prompt, 4) if prompt else 0.0, "seconds": round(seconds, 2),
            "ttft_p50_s": round(_percentile(ttfts, 0.5), 4), "ttft_p90_s": round(_percentile(ttfts, 0.9), 4),
            "ttft_mean_s": round(statistics.fmean(ttfts), 4) if ttfts else 0.0, "decisions": reasons}


def run_routing_bench(config: Any, *, replicas: int = 2, systems: int = 4, chats_per_system: int = 4,
                      turns: int = 3, concurrency: int = 2, max_tokens: int = 8, pool_tokens: int = 3072,
                      progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Defaults: 4 system prompts (~650 tokens each) over 2 replicas, whose pools hold the running
    conversations and about two system prompts' blocks each: half the system prompts per replica
    fit, all of them do not. Conversations start in the order A B C D A B …, so the ones running
    at once have different system prompts."""
    import ray

    from pipelines.bench.chat_workload import chats, interleaved, system_prompt

    texts = [system_prompt(i) for i in range(systems)]
    base = dataclasses.replace(
        config,
        backend=dataclasses.replace(config.backend, kv_cache_tokens=pool_tokens, prefix_caching=True,
                                    extract_attention=False, extract_hidden_states=False),
        activations=dataclasses.replace(config.activations, enabled=False),
        sae=dataclasses.replace(config.sae, enabled=False), ingest=dataclasses.replace(config.ingest, url=None),
        ray=dataclasses.replace(config.ray, generator_num_cpus=0.5, generator_max_concurrency=max(4, concurrency)))
    runs = [("one replica", 1, "affinity", pool_tokens * replicas), ("affinity", replicas, "affinity", pool_tokens),
            ("round_robin", replicas, "round_robin", pool_tokens)]
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,  # its own instance
             _node_ip_address="127.0.0.1")
    rows = []
    try:
        for name, count, policy, pool in runs:
            run_config = dataclasses.replace(
                base, backend=dataclasses.replace(base.backend, kv_cache_tokens=pool),
                ray=dataclasses.replace(base.ray, generators=count, router=policy,
                                        namespace=f"raylens-bench-{uuid.uuid4().hex[:6]}"))
            progress(f"routing bench: {name} ({count} replica(s), {pool} KV tokens each)…")
            conversations = interleaved(chats(systems, chats_per_system, turns), run=1)
            row = _run_policy(run_config, conversations, texts, turns=turns, concurrency=concurrency,
                              max_tokens=max_tokens)
            rows.append({"run": name, "replicas": count, "policy": policy, "kv_pool_tokens": pool, **row})
            progress(f"  {row['prefix_hit_tokens']} prefix-hit tokens of {row['prompt_tokens']}, TTFT p50 "
                     f"{row['ttft_p50_s']} s, p90 {row['ttft_p90_s']} s")
    finally:
        ray.shutdown()
    return {"workload": {"systems": systems, "chats_per_system": chats_per_system, "turns": turns,
                         "concurrency": concurrency, "max_tokens": max_tokens, "system_words": 450,
                         "kv_block_size": base.backend.kv_block_size}, "rows": rows}


def format_routing(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [f"routing: {w['systems']} system prompts x {w['chats_per_system']} chats x {w['turns']} turns, "
             f"{w['concurrency']} chats at a time, {w['max_tokens']} tokens per answer",
             "| run | replicas | KV pool tokens each | prefix-hit tokens | share of prompt tokens | TTFT p50 | TTFT p90 "
             "| requests |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['run']} | {r['replicas']} | {r['kv_pool_tokens']} | {r['prefix_hit_tokens']} | "
                     f"{r['hit_share']:.0%} | {r['ttft_p50_s'] * 1000:.0f} ms | {r['ttft_p90_s'] * 1000:.0f} ms | "
                     f"{r['requests']}{' (' + str(len(r['errors'])) + ' errors)' if r['errors'] else ''} |")
    return "\n".join(lines)
