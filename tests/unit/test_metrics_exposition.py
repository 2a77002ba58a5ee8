"""``/metrics`` rendering (pipelines/serve/metrics.py) without a model or Ray: the text parses with
prometheus_client's parser, per-replica series add up to the ``total`` one, the total never goes
back when a replica restarts or misses a scrape, and every metric the Grafana dashboard queries is
one the server exports."""

from __future__ import annotations

import dataclasses
import json
import re

from engine.engine_metrics import (E2E_BUCKETS, INTER_TOKEN_BUCKETS, MOD_STEP_BUCKETS, TTFT_BUCKETS, EngineMetrics,
                                   HistogramSnapshot, IngestMetrics, MetricsRecorder, SAEMetrics)
from pipelines.cluster.router import ReplicaStatus, RouterStats
from tests.helpers import REPO


def _hist(bounds, observations) -> HistogramSnapshot:
    buckets = tuple(bounds) + (float("inf"),)
    counts = tuple(sum(1 for o in observations if o <= b) for b in buckets)
    return HistogramSnapshot(buckets, counts, float(sum(observations)), len(observations))


def _snapshot(*, steps=10, prompt=100, generated=20, running=1, usage=0.5, ttft=(0.2,), sae=True,
              engine="e0") -> EngineMetrics:
    return EngineMetrics(
        running=running, waiting=2, requests_finished={"stop": 3, "length": 1}, prompt_tokens=prompt,
        generation_tokens=generated, time_to_first_token=_hist(TTFT_BUCKETS, ttft),
        inter_token_latency=_hist(INTER_TOKEN_BUCKETS, (0.03, 0.04)), e2e_request_latency=_hist(E2E_BUCKETS, (1.2,)),
        kv_cache_usage=usage, prefix_cache_queries=prompt, prefix_cache_hits=prompt // 2, steps=steps, mod_calls=7,
        mod_errors=1, mod_seconds=0.01, mod_seconds_per_step=_hist(MOD_STEP_BUCKETS, (0.001,)),
        sae=SAEMetrics(backlog=2, blocks_stored=5, blocks_missing=1) if sae else None, ingest=None, engine_id=engine)


class _Source:
    """What RemoteEngine offers the collector, with values the test sets."""

    def __init__(self, snapshots):
        self.snapshots = snapshots
        self.reruns = 3

    def replica_metrics(self):
        return dict(self.snapshots)

    def router_stats(self):
        return RouterStats("affinity", {("gen-0", "prefix"): 4, ("gen-1", "load"): 2}, {"gen-1": 1},
                           {"gen-0": ReplicaStatus(True, False, 1, 40), "gen-1": ReplicaStatus(False, False, 0, 0)})

    def ingest_stats(self):
        return {"delivered": 9, "spooled": 2, "rejected": 1}

    def label(self, name):
        return name.removeprefix("gen-")


def _scrape(source) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    from pipelines.serve.metrics import metrics_registry, render

    text = render(metrics_registry(source, "m")).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return samples


def test_every_replica_is_labelled_and_the_total_is_their_sum():
    samples = _scrape(_Source({"0": _snapshot(prompt=100), "1": _snapshot(prompt=40, usage=0.1)}))
    for name in ("vllm:prompt_tokens_total", "vllm:num_requests_running", "raylens:sae_blocks_stored_total",
                 "vllm:time_to_first_token_seconds_count", "raylens:mod_calls_total"):
        parts = [samples[(name, (("replica", r),))] for r in ("0", "1")]
        assert samples[(name, (("replica", "total"),))] == sum(parts), name
    assert samples[("vllm:prompt_tokens_total", (("replica", "total"),))] == 140
    assert samples[("vllm:kv_cache_usage_perc", (("replica", "total"),))] == 0.3  # the mean, not a sum
    assert samples[("vllm:request_success_total", (("finished_reason", "stop"), ("replica", "total")))] == 6
    assert samples[("vllm:time_to_first_token_seconds_bucket", (("le", "0.25"), ("replica", "total")))] == 2
    assert samples[("raylens:router_decisions_total", (("policy", "affinity"), ("reason", "prefix"),
                                                       ("replica", "0")))] == 4
    assert samples[("raylens:replica_up", (("replica", "1"),))] == 0.0
    assert samples[("raylens:router_reruns_total", ())] == 3
    assert samples[("raylens:ingest_rejected_total", ())] == 1


def test_the_total_never_goes_back_when_a_replica_restarts_or_misses_a_scrape():
    from pipelines.serve.metrics import metrics_registry, render
    from prometheus_client.parser import text_string_to_metric_families

    source = _Source({"0": _snapshot(steps=50, prompt=100), "1": _snapshot(steps=50, prompt=40, engine="e1")})
    registry = metrics_registry(source, "m")

    def total() -> float:
        text = render(registry).decode()
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "vllm:prompt_tokens_total" and s.labels["replica"] == "total")

    assert total() == 140
    source.snapshots = {"0": _snapshot(steps=60, prompt=110), "1": None}  # replica 1 missed this scrape
    assert total() == 150
    restarted = {"steps": 300, "engine": "e1-again"}  # a new process (that got busy before the scrape)
    source.snapshots = {"0": _snapshot(steps=61, prompt=115), "1": _snapshot(prompt=7, **restarted)}
    assert total() == 115 + 40 + 7
    source.snapshots = {"0": _snapshot(steps=62, prompt=120), "1": _snapshot(prompt=9, **restarted)}
    assert total() == 120 + 40 + 9


def test_an_in_process_engine_is_replica_zero_and_its_ingest_counts_come_along():
    class Engine:
        def metrics(self):
            return dataclasses.replace(_snapshot(sae=False), ingest=IngestMetrics(delivered=4, spooled=1, rejected=2))

    samples = _scrape(Engine())
    assert samples[("vllm:generation_tokens_total", (("replica", "0"),))] == 20
    assert samples[("raylens:ingest_delivered_total", ())] == 4 and samples[("raylens:ingest_rejected_total", ())] == 2
    assert not any(name.startswith("raylens:sae") for name, _ in samples)  # no SAE: no SAE series
    assert not any(name.startswith("raylens:router") for name, _ in samples)


def test_the_recorder_snapshot_reads_prometheus_histograms_back():
    recorder = MetricsRecorder()
    for value in (0.003, 0.3, 7.0):
        recorder.ttft.observe(value)
    snap = recorder.snapshot(running=0, waiting=0, steps=0, cache={"blocks_used": 5, "blocks_total": 20,
                                                                   "prompt_tokens": 9, "hit_tokens": 4},
                             sae=None, ingest=False).time_to_first_token
    assert snap.buckets[-1] == float("inf") and snap.buckets[:-1] == TTFT_BUCKETS
    assert snap.count == 3 and abs(snap.sum - 7.303) < 1e-9
    assert dict(zip(snap.buckets, snap.counts))[0.005] == 1 and dict(zip(snap.buckets, snap.counts))[0.5] == 2


def test_every_metric_the_grafana_dashboard_queries_is_exported():
    dashboard = json.loads((REPO / "docs" / "grafana" / "raylens-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\b((?:vllm|raylens):[a-z0-9_]+)", e)}
    exported = {name for name, _ in _scrape(_Source({"0": _snapshot(), "1": _snapshot()}))}
    missing = sorted(queried - exported)
    assert queried and not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
    assert {"vllm:time_to_first_token_seconds_bucket", "raylens:router_decisions_total"} <= queried
