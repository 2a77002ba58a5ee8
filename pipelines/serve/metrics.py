"""``GET /metrics``: Prometheus metrics of every generator replica, labelled, and in total.

Each scrape asks every replica for its :class:`~engine.engine_metrics.EngineMetrics` (one small
call each) and renders them with ``prometheus_client``. Series carry ``model_name`` (as vLLM's do)
and ``replica`` (the replica's index, or ``total`` for the sum over replicas). Where the meaning
is vLLM's, so is the name, so dashboards built for vLLM read raylens:

==========================================  =================================================
``vllm:num_requests_running`` / ``_waiting``  requests in a step loop's batch / queued for it
``vllm:prompt_tokens_total``                  prompt tokens of finished requests (``usage``)
``vllm:generation_tokens_total``              generated tokens of finished requests (``usage``)
``vllm:request_success_total``                finished requests, by ``finished_reason``
``vllm:time_to_first_token_seconds``          submission to first token (histogram)
``vllm:inter_token_latency_seconds``          gap between successive tokens (histogram)
``vllm:e2e_request_latency_seconds``          submission to the end (histogram)
``vllm:kv_cache_usage_perc``                  share of KV blocks held by requests (0..1)
``vllm:prefix_cache_queries_total`` / ``_hits_total``  prompt tokens looked up / found cached
==========================================  =================================================

raylens' own, under ``raylens:``: ``steps_total``; ``mod_calls_total``, ``mod_errors_total``,
``mod_time_seconds_total`` and ``mod_time_per_step_seconds`` (a request's mod time per step,
histogram); ``sae_backlog_blocks``, ``sae_blocks_stored_total``, ``sae_blocks_missing_total``;
``ingest_delivered_total``, ``ingest_spooled_total``, ``ingest_rejected_total`` (the IngestActor's,
no ``replica``); ``router_decisions_total`` (by ``replica`` and ``reason``),
``router_skipped_total`` (a replica passed over at its queue bound), ``router_reruns_total``,
``replica_up`` and ``replica_cached_blocks`` (the router's view).

The ``total`` series stay monotonic when a replica restarts (its counters start again from zero)
or misses a scrape: the last values seen of each replica process are carried into the total.
Sum per-replica series with ``replica!="total"``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from engine.engine_metrics import EngineMetrics, HistogramSnapshot, IngestMetrics, SAEMetrics

__all__ = ["MetricsCollector", "metrics_registry", "render", "CONTENT_TYPE_LATEST", "plus"]

TOTAL = "total"
_HISTOGRAMS = ("time_to_first_token", "inter_token_latency", "e2e_request_latency", "mod_seconds_per_step")


def plus(a: EngineMetrics, b: EngineMetrics) -> EngineMetrics:
    """Two engines' metrics added up (counters, queues, histograms); ``kv_cache_usage`` is not
    additive and is left to the caller."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(EngineMetrics):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, HistogramSnapshot):
            fields[f.name] = x.merged(y)
        elif f.name == "engine_id":
            fields[f.name] = ""  # a sum of engines is no engine
        elif isinstance(x, Mapping):
            fields[f.name] = {k: x.get(k, 0) + y.get(k, 0) for k in set(x) | set(y)}
        elif x is None or y is None or isinstance(x, (SAEMetrics, IngestMetrics)):  # a part one engine may lack
            fields[f.name] = _plus_parts(x, y)
        else:
            fields[f.name] = x + y
    return EngineMetrics(**fields)


def _plus_parts(x: Any, y: Any) -> Any:
    if x is None or y is None:
        return x if y is None else y
    return type(x)(*(getattr(x, f.name) + getattr(y, f.name) for f in dataclasses.fields(x)))


class _Totals:
    """Per replica: the last snapshot seen, and what its earlier processes counted (carried into
    the total after a restart, which a new ``engine_id`` reveals)."""

    def __init__(self) -> None:
        self.last: dict[str, EngineMetrics] = {}
        self.carried: dict[str, EngineMetrics] = {}
        self._lock = threading.Lock()

    def update(self, snapshots: Mapping[str, EngineMetrics | None]) -> EngineMetrics | None:
        with self._lock:
            for label, snap in snapshots.items():
                if snap is None:
                    continue
                last = self.last.get(label)
                if last is not None and snap.engine_id != last.engine_id:  # a new process: counting from zero
                    carried = self.carried.get(label)
                    self.carried[label] = last if carried is None else plus(carried, last)
                self.last[label] = snap
            total = None
            for label, snap in self.last.items():
                live = snapshots.get(label)
                counted = snap if live is not None else dataclasses.replace(snap, running=0, waiting=0)
                if label in self.carried:
                    counted = plus(self.carried[label], counted)
                total = counted if total is None else plus(total, counted)
            if total is None:
                return None
            reporting = [s for s in snapshots.values() if s is not None]
            usage = sum(s.kv_cache_usage for s in reporting) / len(reporting) if reporting else 0.0
            return dataclasses.replace(total, kv_cache_usage=usage)


class MetricsCollector:
    """A ``prometheus_client`` collector over a metrics source: an object with
    ``replica_metrics()`` (label → :class:`EngineMetrics` or None), and optionally
    ``router_stats()`` and ``ingest_stats()`` (:class:`~pipelines.serve.remote_engine.RemoteEngine`
    has all three; an in-process engine is wrapped by :func:`metrics_registry`)."""

    def __init__(self, source: Any, model_name: str) -> None:
        self.source = source
        self.model_name = model_name
        self._totals = _Totals()

    def collect(self) -> Iterator[Metric]:
        snapshots = dict(self.source.replica_metrics())
        total = self._totals.update(snapshots)
        rows = [(label, snap) for label, snap in sorted(snapshots.items()) if snap is not None]
        if total is not None:
            rows.append((TOTAL, total))
        yield from self._engine_families(rows)
        router = getattr(self.source, "router_stats", None)
        if router is not None:
            yield from self._router_families(router())
        ingest = getattr(self.source, "ingest_stats", None)
        counts = ingest() if ingest is not None else None
        if counts is None and total is not None and total.ingest is not None:
            counts = dataclasses.asdict(total.ingest)
        if counts is not None:
            for name, doc in (("delivered", "ingest payloads delivered"), ("spooled", "ingest payloads spooled for "
                              "a retry"), ("rejected", "ingest payloads the backend refused (4xx)")):
                family = CounterMetricFamily(f"raylens:ingest_{name}", doc, labels=["model_name"])
                family.add_metric([self.model_name], float(counts.get(name, 0)))
                yield family

    def _engine_families(self, rows: list[tuple[str, EngineMetrics]]) -> Iterator[Metric]:
        labels = ["model_name", "replica"]

        def family(kind: type, name: str, doc: str, value: Any) -> Metric:
            metric = kind(name, doc, labels=labels)
            for label, snap in rows:
                metric.add_metric([self.model_name, label], float(value(snap)))
            return metric

        yield family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the step loop's batch.",
                     lambda s: s.running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests queued for the batch.",
                     lambda s: s.waiting)
        yield family(CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens of finished requests.",
                     lambda s: s.prompt_tokens)
        yield family(CounterMetricFamily, "vllm:generation_tokens", "Generated tokens of finished requests.",
                     lambda s: s.generation_tokens)
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                      labels=labels + ["finished_reason"])
        for label, snap in rows:
            for reason, count in sorted(snap.requests_finished.items()):
                success.add_metric([self.model_name, label, reason], float(count))
        yield success
        for attr, name, doc in (("time_to_first_token", "vllm:time_to_first_token_seconds", "Time to first token."),
                                ("inter_token_latency", "vllm:inter_token_latency_seconds", "Time between tokens."),
                                ("e2e_request_latency", "vllm:e2e_request_latency_seconds", "Request latency."),
                                ("mod_seconds_per_step", "raylens:mod_time_per_step_seconds",
                                 "A finished request's mod time per step.")):
            histogram = HistogramMetricFamily(name, doc, labels=labels)
            for label, snap in rows:
                h: HistogramSnapshot = getattr(snap, attr)
                buckets = [(_le(bound), float(count)) for bound, count in zip(h.buckets, h.counts)]
                histogram.add_metric([self.model_name, label], buckets, h.sum)
            yield histogram
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Share of KV blocks held by requests (0-1).",
                     lambda s: s.kv_cache_usage)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     lambda s: s.prefix_cache_queries)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     lambda s: s.prefix_cache_hits)
        yield family(CounterMetricFamily, "raylens:steps", "Step-loop steps.", lambda s: s.steps)
        yield family(CounterMetricFamily, "raylens:mod_calls", "Mod calls.", lambda s: s.mod_calls)
        yield family(CounterMetricFamily, "raylens:mod_errors", "Mod calls that raised or timed out.",
                     lambda s: s.mod_errors)
        yield family(CounterMetricFamily, "raylens:mod_time_seconds", "Seconds spent in mod calls.",
                     lambda s: s.mod_seconds)
        sae_rows = [(label, snap) for label, snap in rows if snap.sae is not None]
        if sae_rows:
            for attr, kind, name, doc in (
                    ("backlog", GaugeMetricFamily, "raylens:sae_backlog_blocks", "SAE blocks handed off, unsettled."),
                    ("blocks_stored", CounterMetricFamily, "raylens:sae_blocks_stored", "SAE blocks stored."),
                    ("blocks_missing", CounterMetricFamily, "raylens:sae_blocks_missing", "SAE blocks recorded missing.")):
                metric = kind(name, doc, labels=labels)
                for label, snap in sae_rows:
                    metric.add_metric([self.model_name, label], float(getattr(snap.sae, attr)))
                yield metric

    def _router_families(self, stats: Any) -> Iterator[Metric]:
        decisions = CounterMetricFamily("raylens:router_decisions", "Requests routed, by replica and reason.",
                                        labels=["model_name", "replica", "reason", "policy"])
        for (name, reason), count in sorted(stats.decisions.items()):
            decisions.add_metric([self.model_name, self._label(name), reason, stats.policy], float(count))
        yield decisions
        skipped = CounterMetricFamily("raylens:router_skipped", "Times a replica was passed over at its queue bound.",
                                      labels=["model_name", "replica"])
        for name, count in sorted(stats.skipped.items()):
            skipped.add_metric([self.model_name, self._label(name)], float(count))
        yield skipped
        reruns = CounterMetricFamily("raylens:router_reruns", "Requests re-run after their replica died before "
                                                              "their first token.", labels=["model_name"])
        reruns.add_metric([self.model_name], float(getattr(self.source, "reruns", 0)))
        yield reruns
        up = GaugeMetricFamily("raylens:replica_up", "1 while the router sends a replica requests.",
                               labels=["model_name", "replica"])
        cached = GaugeMetricFamily("raylens:replica_cached_blocks", "Prefix-cache blocks a replica reported.",
                                   labels=["model_name", "replica"])
        for name, status in sorted(stats.replicas.items()):
            up.add_metric([self.model_name, self._label(name)], float(status.up and not status.draining))
            cached.add_metric([self.model_name, self._label(name)], float(status.cached_blocks))
        yield up
        yield cached

    def _label(self, name: str) -> str:
        label = getattr(self.source, "label", None)
        return label(name) if label is not None else name


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class _InProcess:
    """An in-process :class:`engine.Engine` as a metrics source: one replica, ``0``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def replica_metrics(self) -> dict[str, EngineMetrics | None]:
        return {"0": self.engine.metrics()}


def metrics_registry(engine: Any, model_name: str) -> CollectorRegistry:
    """A registry of its own (never the process-global one) holding the engine's collector."""
    source = engine if hasattr(engine, "replica_metrics") else _InProcess(engine)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(source, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
