"""GeneratorActor: the model and the mod loop, in a Ray actor.

It holds an in-process :class:`engine.Engine` (whose own store, SAE and ingest are off) and adds
the Ray wiring: the engine's SAE hand-off, built by the engine's one factory, ships hidden-state
blocks to SAE workers through :class:`RayWorkerTransport` (or, with ``sae.mode: inline``, the
actor encodes each step itself and sends the rows to the StoreActor, so events and streams carry
features); each request's row goes to the StoreActor and its payload to the IngestActor, both
without waiting. It is a threaded actor: each concurrent call waits in its own thread while the
engine's one step loop runs every request in flight as one batch.

Two ways in, one batch: ``generate(request)`` (Ray Jobs: one whole request per call) and
``stream(request)`` (the Serve replica: a Ray streaming generator that hands back each token as
the step loop commits it, then the result). ``cancel(request_id)`` ends a streamed request whose
client left; it and the other small calls (``stats``, ``version``, ``routing_report``,
``metrics``) run in their own concurrency group, so they answer even while every request thread
is busy streaming.

As one replica of several (``ray.generators``): ``routing_report(cursor)`` tells a router what
the engine's prefix cache stored and removed since its last read, and how many requests run here;
``metrics()`` is the engine's :class:`~engine.engine_metrics.EngineMetrics`; ``start_draining()``
(``raylens scale`` removing this replica) makes ``generate``/``stream`` refuse new requests with
:class:`~engine.errors.ReplicaDrainingError`, which routers send elsewhere, while the ones
running finish.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import ray

from engine import Engine
from engine.cache_events import CacheCursor, CacheEvents
from engine.config import RaylensConfig
from engine.core.inputs import GenerationRequest
from engine.core.result import GenerationResult
from engine.core.stream import RequestHandle
from engine.engine_metrics import EngineMetrics
from engine.errors import ReplicaDrainingError
from engine.services.sae_blocks import BlockMeta
from engine.services.sae_handoff import SAEHandoff

from .sae_handoff import RayWorkerTransport
from .versioning import code_version

__all__ = ["GeneratorActor", "ReplicaReport", "local_engine_config", "portable_error", "STREAM_STARTED",
           "STREAM_RESULT"]

STREAM_STARTED = "started"  # the first item ``stream`` yields: {"started": EngineRequest}
STREAM_RESULT = "result"  # the last: {"result": GenerationResult}; every item between is a stream event
CONTROL = "control"  # concurrency group of the small calls that must not wait behind streams


@dataclass(frozen=True)
class ReplicaReport:
    """What a router reads of a replica: its prefix-cache events since the router's cursor, the
    requests running here (``load``: streams and ``generate`` calls in flight), whether it is
    draining, and where it runs (its process id and Ray node)."""

    cache: CacheEvents
    load: int
    draining: bool
    pid: int
    node_id: str


def local_engine_config(config: RaylensConfig) -> RaylensConfig:
    """The Engine inside the actor writes nothing itself: the actors around it do. Its results
    leave the actor without their events, so a finished step's logits are not kept
    (``generation.keep_logits``): kept, every step's batch of logits would stay in memory until
    the batch's requests finished. Its payloads go to the IngestActor, which sends them when the
    cluster's config has an ingest URL: that, not the inner engine's own (none), decides whether
    they list each step's top tokens (``generation.payload_top_tokens`` null)."""
    top_tokens = config.generation.payload_top_tokens
    return dataclasses.replace(
        config,
        generation=dataclasses.replace(config.generation, keep_logits=False,
                                       payload_top_tokens=bool(config.ingest.url) if top_tokens is None else top_tokens),
        activations=dataclasses.replace(config.activations, enabled=False),
        sae=dataclasses.replace(config.sae, enabled=False),
        ingest=dataclasses.replace(config.ingest, url=None),
    )


def _checked(request: Any) -> GenerationRequest:
    """Only a :class:`GenerationRequest` crosses into the actor (the caller built and checked it)."""
    if not isinstance(request, GenerationRequest):
        raise TypeError(f"GeneratorActor takes an engine.core.inputs.GenerationRequest, got {type(request).__name__}")
    if any(callable(m) for m in request.mods):
        raise TypeError("mods sent to the GeneratorActor must be payload dicts or paths, not loaded callables")
    return request


def portable_error(err: BaseException) -> BaseException:
    """``err``, or the nearest base class of it carrying its message and fields, whichever survives
    pickling: Ray hands a method's exception to the caller pickled, and an error class whose
    ``__init__`` needs keyword arguments (e.g. ``ModDirNotAllowedError``) cannot be rebuilt there,
    which would turn a typed input error into an anonymous one the server reports as internal."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        pass
    fields = {k: v for k, v in vars(err).items() if _pickles(v)}
    for cls in type(err).__mro__[1:]:
        if not issubclass(cls, Exception):
            break
        try:
            twin = cls(str(err))
            vars(twin).update(fields)
            pickle.loads(pickle.dumps(twin))
            return twin
        except Exception:
            continue
    return RuntimeError(f"{type(err).__name__}: {err}")


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:
        return False


@ray.remote(concurrency_groups={CONTROL: 2})
class GeneratorActor:
    def __init__(self, config: dict[str, Any], store: Any, ingest: Any, sae_workers: list[Any]) -> None:
        self.config = RaylensConfig.from_dict(config)
        self.engine = Engine(local_engine_config(self.config))
        self.store = store
        self.ingest = ingest
        self._pending: list[Any] = []  # fire-and-forget calls to store/ingest, settled by drain()
        self._lock = threading.Lock()  # calls run on several threads
        if self.config.sae.enabled:
            self.engine.use_sae(self._sae_handoff(sae_workers))
        self._streams: dict[str, RequestHandle] = {}  # streamed requests in flight, for cancel()
        self.requests = 0
        self.tokens = 0
        self.cancelled = 0
        self._calls = 0  # generate and stream calls in flight: the load a router reads
        self._draining = False

    def _sae_handoff(self, sae_workers: list[Any]) -> SAEHandoff:
        """The engine's SAE hand-off, its mode chosen from ``sae`` by the engine's factory: nearline,
        blocks go to the SAE workers; ``inline``, this actor encodes every step itself, before the
        step's events, so mods see ``event.sae_features``, Steer works and streams (the Serve
        replica's sockets) carry each token's features — its rows still go to the single writer,
        the StoreActor."""
        def write(rows: Any, batch_id: str, request_id: str) -> int:
            ref = self.store.append.remote(rows, batch_id, request_id)
            with self._lock:
                self._pending.append(ref)
            return rows.num_rows

        def missing(block: BlockMeta, reason: str) -> None:
            ref = self.store.record_missing.remote(**block.ledger(), reason=reason)
            with self._lock:
                self._pending.append(ref)

        return self.engine.sae_recorder(write, missing, ray=True,
                                        remote=lambda: RayWorkerTransport(sae_workers, self.store))

    @ray.method(concurrency_group=CONTROL)
    def version(self) -> str:
        return code_version()

    @ray.method(concurrency_group=CONTROL)
    def model_info(self) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.backend.info)

    @ray.method(concurrency_group=CONTROL)
    def serve_info(self) -> dict[str, Any]:
        """What a Serve replica needs besides the tokenizer: the model's dimensions, and whether
        stream events carry SAE features (only when this actor encodes inline, ``sae.mode:
        inline``; nearline, its SAE runs on the SAE workers)."""
        return {"model": self.model_info(), "sae_features_inline": self.engine.sae_features_inline}

    @ray.method(concurrency_group=CONTROL)
    def encode(self, prompt: str | None = None, **kwargs: Any) -> list[int]:
        """``Engine.encode`` (chat template and all), so a replica tokenizes exactly as requests are."""
        return self.engine.encode(prompt, **kwargs)

    def score(self, input_ids: list[int], top_k: int = 0, job_id: str | None = None,
              timeout: float | None = None) -> Any:
        """``Engine.score``: per-position log-probs of ``input_ids`` (the Serve replica's prompt
        log-probs), a job of the step loop; a :class:`~engine.model.scoring.SequenceScores`."""
        try:
            return self.engine.score(input_ids, top_k=top_k, job_id=job_id, timeout=timeout)
        except Exception as err:
            raise portable_error(err) from None

    def embed_tokens(self, token_ids: list[list[int]], layer: int | None = None, pool: str = "mean",
                     job_id: str | None = None, timeout: float | None = None) -> Any:
        """``Engine.embed_tokens``: ``(len(token_ids), d)`` float32 numpy embeddings."""
        try:
            return self.engine.embed_tokens(token_ids, layer=layer, pool=pool, job_id=job_id, timeout=timeout)
        except Exception as err:
            raise portable_error(err) from None

    def capture(self, input_ids: list[int], names: list[str], job_id: str | None = None,
                timeout: float | None = None) -> dict[str, Any]:
        """``Engine.capture`` of ``input_ids``: ``{name: float32 numpy array}`` (host copies, so
        they cross Ray without torch tensors)."""
        try:
            tensors = self.engine.capture(input_ids=input_ids, names=names, job_id=job_id, timeout=timeout)
        except Exception as err:
            raise portable_error(err) from None
        return {name: tensor.detach().float().cpu().numpy() for name, tensor in tensors.items()}

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """One request → its result, :meth:`~engine.core.result.GenerationResult.portable` (the
        events and the payload stay here; the payload goes to the IngestActor)."""
        started = time.perf_counter()
        self._enter()
        try:
            result: GenerationResult = self.engine.generate(_checked(request))
        except Exception as err:
            raise portable_error(err) from None
        finally:
            self._leave()
        return self._record(result, started)

    @ray.method(num_returns="streaming")
    def stream(self, request: GenerationRequest) -> Iterator[Any]:
        """One request as a Ray streaming generator: ``{"started": EngineRequest}`` (its
        :meth:`~engine.core.request.EngineRequest.portable` form: ids, stop set, limits) once it is
        queued (bad input raises the engine's typed error before that), then each
        :class:`~engine.core.stream.TokenEvent` / ``Erased`` as the step loop commits it, then
        ``{"result": GenerationResult}`` (portable, as :meth:`generate` returns it). Recorded
        like :meth:`generate` (store row, ingest payload, counters). A caller that stops reading
        should :meth:`cancel` the request: Ray does not interrupt a running method of a threaded
        actor."""
        started = time.perf_counter()
        self._enter()
        try:
            handle = self.engine.submit(_checked(request))
        except Exception as err:
            self._leave()
            raise portable_error(err) from None
        with self._lock:
            self._streams[handle.request_id] = handle
        try:
            yield {STREAM_STARTED: handle.request.portable()}
            for event in handle:
                yield event
            result: GenerationResult = handle.result()
        except GeneratorExit:  # closed before the end: stop the request, still record its result
            handle.cancel()
            threading.Thread(target=self._record_when_done, args=(handle, started), daemon=True).start()
            raise
        except Exception as err:
            raise portable_error(err) from None
        finally:
            with self._lock:
                self._streams.pop(handle.request_id, None)
            self._leave()
        yield {STREAM_RESULT: self._record(result, started)}

    def _enter(self) -> None:
        """Count a request call in; a draining replica refuses it before it starts."""
        with self._lock:
            if self._draining:
                raise ReplicaDrainingError("this generator replica must not take new requests while it drains "
                                           "(`raylens scale` is removing it), got one; send it to another replica")
            self._calls += 1

    def _leave(self) -> None:
        with self._lock:
            self._calls -= 1

    @ray.method(concurrency_group=CONTROL)
    def routing_report(self, cursor: CacheCursor | None = None) -> ReplicaReport:
        """The engine's cache events since ``cursor`` and this replica's load (a router's read)."""
        with self._lock:
            load, draining = self._calls, self._draining
        return ReplicaReport(self.engine.cache_events(cursor), load, draining, os.getpid(),
                             ray.get_runtime_context().get_node_id())

    @ray.method(concurrency_group=CONTROL)
    def metrics(self) -> EngineMetrics:
        return self.engine.metrics()

    @ray.method(concurrency_group=CONTROL)
    def start_draining(self) -> int:
        """Refuse new requests from now on (routers send them elsewhere); the requests in flight
        here, which the caller waits for (``routing_report().load``) before it ends this replica."""
        with self._lock:
            self._draining = True
            return self._calls

    @ray.method(concurrency_group=CONTROL)
    def cancel_streams(self) -> int:
        """Cancel every streamed request (the HTTP server's: its replica went away); how many. A
        Ray job's requests (``generate``) go on."""
        with self._lock:
            handles = list(self._streams.values())
        for handle in handles:
            handle.cancel()
        return len(handles)

    @ray.method(concurrency_group=CONTROL)
    def cancel(self, request_id: str) -> bool:
        """End a streamed request at its next step (finish reason ``cancelled``), or a job
        (embeddings, scoring, a capture) at its next unit; False if it is not running here
        (already finished, or never started)."""
        with self._lock:
            handle = self._streams.get(request_id)
        if handle is None:
            return self.engine.cancel(request_id)
        handle.cancel()
        return True

    def _record_when_done(self, handle: RequestHandle, started: float) -> None:
        try:
            self._record(handle.result(timeout=self.config.ray.call_timeout_s), started)
        except Exception:  # the request failed or never ended: nothing to record
            pass

    def _record(self, result: GenerationResult, started: float) -> GenerationResult:
        """Send the result's store row and ingest payload (without waiting), count it; its
        portable form for the caller."""
        pending = []
        if self.config.activations.enabled:
            pending.append(self.store.record_request.remote(self.engine.request_record(result)))
        pending.append(self.ingest.submit.remote(result.payload))
        with self._lock:
            self._pending.extend(pending)
            self.requests += 1
            self.tokens += len(result.sequence_ids)
            self.cancelled += str(result.finish_reason) == "cancelled"
        return result.portable(actor_ms=round((time.perf_counter() - started) * 1000.0, 3))

    def drain(self) -> dict[str, Any]:
        """Wait for every SAE block and store/ingest call this generator started; then report."""
        self.engine.flush()  # the SAE hand-off's last blocks
        with self._lock:
            pending, self._pending = self._pending, []
        ray.get(pending, timeout=self.config.ray.call_timeout_s)
        return self.stats()

    @ray.method(concurrency_group=CONTROL)
    def stats(self) -> dict[str, Any]:
        """Counters: finished requests (``cancelled`` among them), generated tokens, ``streaming``
        (streamed requests in flight), and the step loop's batching."""
        loop = self.engine.loop.stats
        with self._lock:
            stats: dict[str, Any] = {"requests": self.requests, "tokens": self.tokens, "cancelled": self.cancelled,
                                     "streaming": len(self._streams), "in_flight": self._calls,
                                     "draining": self._draining, "pid": os.getpid()}
        stats["batch"] = {"steps": loop.steps, "max_active": loop.max_active, "waits_for_room": loop.waits_for_room,
                          "deferred_announcements": loop.deferred_announcements,
                          "mean_launch_gap_ms": round(loop.mean_launch_gap_ms, 3)}
        stats["kv_cache"] = self.engine.cache_stats()  # paged KV cache: blocks used/free, prefix-cache hit rate
        if self.engine.recorder is not None:
            stats["sae"] = self.engine.recorder.report()
        return stats
