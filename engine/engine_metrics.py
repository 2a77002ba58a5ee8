"""One engine's serving metrics as a typed snapshot: what ``/metrics`` exports, per replica.

:meth:`engine.Engine.metrics` returns an :class:`EngineMetrics` built from what the engine
already keeps — the step loop's queues and step count, the KV manager's block and prefix-cache
counts, the SAE hand-off's counters — and from :class:`MetricsRecorder`, which adds the per-request
figures nothing else keeps: token totals, time to first token, the gaps between tokens and the
whole request's latency (vLLM's definitions), mod calls, errors and time, and (in process) what
became of each ingest payload. The snapshot is plain data, so it crosses Ray unchanged and the
server adds replicas together (:meth:`HistogramSnapshot.merged`).

Latencies are timed on the engine, from the request's submission: what a client sees on top of
them is the network and the server's own queue. Token counts are what the OpenAI ``usage`` reports:
the prompt's tokens, and the generated tokens without the stop token that ended them.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from prometheus_client import Histogram

from engine.core.stream import RequestHandle

__all__ = ["HistogramSnapshot", "SAEMetrics", "IngestMetrics", "EngineMetrics", "MetricsRecorder", "TimedHandle",
           "TTFT_BUCKETS", "INTER_TOKEN_BUCKETS", "E2E_BUCKETS", "MOD_STEP_BUCKETS"]

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards built for it read ours the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
# a request's mod time per step: from a trivial mod (microseconds) to one that holds its step back
MOD_STEP_BUCKETS = (1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram as Prometheus keeps it: ``buckets`` are the upper bounds (the last is +Inf),
    ``counts[i]`` the observations ``<= buckets[i]`` (cumulative), ``sum`` and ``count`` of all."""

    buckets: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0
    count: int = 0

    @classmethod
    def empty(cls, bounds: Sequence[float]) -> "HistogramSnapshot":
        buckets = tuple(bounds) + (float("inf"),)
        return cls(buckets, (0,) * len(buckets))

    def merged(self, other: "HistogramSnapshot") -> "HistogramSnapshot":
        """The histogram of both sets of observations (the same buckets: every engine uses these)."""
        if other.buckets != self.buckets:
            raise ValueError(f"histograms must share their buckets to be merged, got {self.buckets} and {other.buckets}")
        return HistogramSnapshot(self.buckets, tuple(a + b for a, b in zip(self.counts, other.counts)),
                                 self.sum + other.sum, self.count + other.count)


@dataclass(frozen=True)
class SAEMetrics:
    """The SAE hand-off: blocks handed off and not yet settled, stored, and recorded missing."""

    backlog: int
    blocks_stored: int
    blocks_missing: int


@dataclass(frozen=True)
class IngestMetrics:
    """Ingest payloads delivered, spooled for a later retry, and refused by the backend (4xx)."""

    delivered: int
    spooled: int
    rejected: int


@dataclass(frozen=True)
class EngineMetrics:
    """One engine at one moment. Counters count from the engine's start; ``kv_cache_usage`` is
    the share of KV blocks held by requests (0..1); prefix-cache queries and hits are in tokens
    (vLLM's ``prefix_cache_queries``/``hits``). ``sae`` and ``ingest`` are None where this engine
    has none (a Ray generator's ingest is the IngestActor's)."""

    running: int
    waiting: int
    requests_finished: Mapping[str, int]  # finish reason -> requests
    prompt_tokens: int
    generation_tokens: int
    time_to_first_token: HistogramSnapshot
    inter_token_latency: HistogramSnapshot
    e2e_request_latency: HistogramSnapshot
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    steps: int
    mod_calls: int
    mod_errors: int
    mod_seconds: float
    mod_seconds_per_step: HistogramSnapshot
    sae: SAEMetrics | None = None
    ingest: IngestMetrics | None = None
    engine_id: str = ""  # one per engine object: a new one after a restart (its counters start again)


def _snapshot(histogram: Histogram) -> HistogramSnapshot:
    """prometheus_client's own accumulation, read back as plain data."""
    buckets, counts, total, count = [], [], 0.0, 0
    for sample in histogram.collect()[0].samples:
        if sample.name.endswith("_bucket"):
            buckets.append(float(sample.labels["le"]))
            counts.append(int(sample.value))
        elif sample.name.endswith("_sum"):
            total = float(sample.value)
        elif sample.name.endswith("_count"):
            count = int(sample.value)
    return HistogramSnapshot(tuple(buckets), tuple(counts), total, count)


class TimedHandle(RequestHandle):
    """A :class:`RequestHandle` that times its tokens as the step loop commits them: the first
    one's delay from submission (TTFT) and each later one's gap from the one before (vLLM's
    inter-token latency: a forced chunk of several tokens is one gap)."""

    def __init__(self, request_id: str, request: Any, recorder: "MetricsRecorder") -> None:
        super().__init__(request_id, request)
        self.submitted_at = time.perf_counter()
        self.last_token_at: float | None = None
        self._recorder = recorder

    def committed(self, tokens: Sequence[int], forced: bool, sample: Any, attention: Any,
                  sae_features: Any = None) -> None:
        now = time.perf_counter()
        if self.last_token_at is None:
            self._recorder.ttft.observe(now - self.submitted_at)
        else:
            self._recorder.inter_token.observe(now - self.last_token_at)
        self.last_token_at = now
        super().committed(tokens, forced, sample, attention, sae_features)


@dataclass
class _Counts:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    mod_calls: int = 0
    mod_errors: int = 0
    mod_seconds: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)
    delivered: int = 0
    spooled: int = 0
    rejected: int = 0


class MetricsRecorder:
    """The per-request figures of one engine, added up as requests finish (thread-safe)."""

    def __init__(self, *, spool_dir: str | None = None) -> None:
        self.ttft = Histogram("ttft", "time to first token", buckets=TTFT_BUCKETS, registry=None)
        self.inter_token = Histogram("itl", "inter-token latency", buckets=INTER_TOKEN_BUCKETS, registry=None)
        self.e2e = Histogram("e2e", "request latency", buckets=E2E_BUCKETS, registry=None)
        self.mod_per_step = Histogram("mod_step", "mod seconds per step", buckets=MOD_STEP_BUCKETS, registry=None)
        self._rejected_dir = Path(spool_dir) / "rejected" if spool_dir else None
        self.engine_id = uuid.uuid4().hex
        self._counts = _Counts()
        self._lock = threading.Lock()

    def handle(self, request_id: str, request: Any) -> TimedHandle:
        return TimedHandle(request_id, request, self)

    def finished(self, handle: RequestHandle, result: Any, *, steps: int, mod_stats: Any) -> None:
        """Count a finished request: its tokens as ``usage`` reports them, its latency, its mods'
        calls (``mod_stats``: calls, errors, seconds) and, in process, its ingest delivery."""
        submitted = getattr(handle, "submitted_at", None)
        if submitted is not None:
            self.e2e.observe(time.perf_counter() - submitted)
        calls, errors, seconds = (mod_stats.calls, mod_stats.errors, mod_stats.seconds) if mod_stats else (0, 0, 0.0)
        if calls and steps:
            self.mod_per_step.observe(seconds / steps)
        ingest = result.metadata.get("ingest")
        with self._lock:
            c = self._counts
            c.prompt_tokens += len(result.prompt_ids)
            c.generation_tokens += len(result.output_ids)
            reason = str(result.finish_reason)
            c.finished[reason] = c.finished.get(reason, 0) + 1
            c.mod_calls, c.mod_errors, c.mod_seconds = c.mod_calls + calls, c.mod_errors + errors, c.mod_seconds + seconds
            if ingest is not None:
                spooled_to = ingest.get("spooled_to")
                if ingest.get("delivered"):
                    c.delivered += 1
                elif spooled_to and self._rejected_dir is not None and Path(spooled_to).parent == self._rejected_dir:
                    c.rejected += 1
                elif spooled_to:
                    c.spooled += 1

    def snapshot(self, *, running: int, waiting: int, steps: int, cache: Mapping[str, Any] | None,
                 sae: Mapping[str, Any] | None, ingest: bool) -> EngineMetrics:
        """The engine's metrics now, with the loop's and the caches' own figures handed in."""
        cache = cache or {}
        total = cache.get("blocks_total") or 0
        with self._lock:
            c = self._counts
            counts = (c.prompt_tokens, c.generation_tokens, dict(c.finished), c.mod_calls, c.mod_errors, c.mod_seconds)
            delivery = IngestMetrics(c.delivered, c.spooled, c.rejected) if ingest else None
        return EngineMetrics(
            running=running, waiting=waiting, requests_finished=counts[2], prompt_tokens=counts[0],
            generation_tokens=counts[1], time_to_first_token=_snapshot(self.ttft),
            inter_token_latency=_snapshot(self.inter_token), e2e_request_latency=_snapshot(self.e2e),
            kv_cache_usage=(cache.get("blocks_used", 0) / total) if total else 0.0,
            prefix_cache_queries=int(cache.get("prompt_tokens", 0)), prefix_cache_hits=int(cache.get("hit_tokens", 0)),
            steps=steps, mod_calls=counts[3], mod_errors=counts[4], mod_seconds=counts[5],
            mod_seconds_per_step=_snapshot(self.mod_per_step),
            sae=SAEMetrics(int(sae.get("backlog", 0)), int(sae.get("blocks_stored", 0)),
                           int(sae.get("blocks_missing", 0))) if sae is not None else None,
            ingest=delivery, engine_id=self.engine_id,
        )
