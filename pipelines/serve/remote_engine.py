"""The engine surface the server's routes use, backed by the shared GeneratorActor replicas.

The routes were written against :class:`engine.Engine` (``submit`` → a handle to iterate, ``result``
and ``cancel``; ``encode``; ``tokenizer``; ``backend.info``; ``config``). :class:`RemoteEngine` gives
them the same surface over the GeneratorActors that Ray Jobs use, so their step loops batch HTTP
streams with job requests, and the SAE workers, StoreActor and IngestActor record both:

* Each request goes to the replica the router picks (``ray.router``: the one whose prefix cache
  holds most of the prompt's leading blocks, by default; :mod:`pipelines.cluster.router`); the
  ``n`` choices of one request share a replica (:func:`~pipelines.cluster.prompt_keys.same_replica`).
* A replica that dies: its requests that had sent no token yet run again on another one (under
  ``<id>-retry1``), streams already under way end with :class:`~engine.errors.ReplicaLostError`
  (a retryable 503); Ray restarts it and it rejoins the router once it answers.
* Except the request that was this server's only one on the replica when it died: it is the
  likely cause (a grammar or a mod that crashes native code), so it is not run again — it gets
  the 503, and an identical request is refused (``QUARANTINED``, 400) for a while instead of
  crashing another replica (:mod:`.quarantine`).
* Embeddings, scoring and captures are jobs of the replica's step loop: :meth:`RemoteEngine.cancel`
  (by the job id the route gave) stops one whose client left.

* ``submit`` calls the actor's streaming ``stream`` method and waits for its first item, so bad
  input raises the engine's own typed error here, before any response starts (Ray's
  ``RayTaskError`` wrapper is removed: :func:`unwrap`).
* The handle (:class:`RemoteHandle`) yields the actor's ``TokenEvent`` / ``Erased`` as they come;
  ``cancel()`` asks the actor to end the request (a client that left frees its batch slot).
* The tokenizer is loaded here (tokenizer files only, no weights), for the routes' per-token
  decoding; prompts are encoded by the actor (``encode``), exactly as requests are.
* Mods travel as their payload dicts (``mods_as_payloads``): a loaded Python callable belongs to
  the replica's process, so the actor loads its own copy from the payload, per request (as it does
  for a job's mods; module-level state of a mod is not kept from one request to the next).
* SAE features per token: when the actor's engine encodes inline (``sae.mode: inline``; the
  actor reports it as ``sae_features_inline``). With the default nearline mode its SAE runs on
  the SAE workers (features reach the store, not the stream) and the routes answer
  ``FEATURES_UNAVAILABLE``.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Mapping, Sequence

from engine.config import REQUEST_ID_MAX_CHARS, RaylensConfig
from engine.core.inputs import GenerationRequest, as_request
from engine.core.request import EngineRequest
from engine.core.stream import RequestHandle
from engine.errors import NoReplicaError, QueueFullError, ReplicaDrainingError, ReplicaLostError
from pipelines.cluster.prompt_keys import PromptKeys, current_group
from pipelines.cluster.replicas import ReplicaSet
from pipelines.cluster.router import RouteRequest

from .errors import is_lost_actor
from .quarantine import CrashQuarantine

__all__ = ["RemoteEngine", "RemoteHandle", "Attempt", "unwrap"]


def unwrap(err: BaseException) -> BaseException:
    """The exception the actor raised, out of Ray's ``RayTaskError`` wrapper (whose message is a
    remote traceback); other errors (the actor died, a timeout) as they are."""
    from ray.exceptions import RayTaskError

    if isinstance(err, RayTaskError) and isinstance(getattr(err, "cause", None), BaseException):
        return err.cause
    return err


@dataclass
class Attempt:
    """One run of a request on one replica: the actor's stream items after its first, and how to
    cancel it there."""

    replica: str
    request_id: str
    items: Iterator[Any]
    cancel: Callable[[], None]
    running: tuple[str, int] | None = None  # its entry in the server's crash quarantine
    quarantined: bool = False  # it ran alone on the replica when that died: not run again


MAX_RERUNS = 2  # a request whose replicas keep dying before its first token fails after this many re-runs


class RemoteHandle(RequestHandle):
    """One streamed request, as :class:`engine.core.stream.RequestHandle` (whose event queue,
    iteration and result it reuses): iterate it for the events, ``result(timeout)`` for the
    :class:`~engine.core.result.GenerationResult` (portable: no events, no payload),
    ``cancel()`` to end it early in the actor.

    ``items`` yields what the actor's ``stream`` yields after its first item: events, then
    ``{"result": GenerationResult}``; an exception it raises fails the request. A reader thread moves them
    into the queue, so ``result`` waits with a timeout even when nobody iterates.

    A replica lost under the request (its actor died): before any token reached this handle,
    ``rerun`` starts it again on another replica and the stream goes on from there, unseen by the
    reader (at most ``MAX_RERUNS`` times); after a token, the request fails with
    :class:`~engine.errors.ReplicaLostError` (a clean, retryable error, never a hang).
    ``on_end(attempt, lost)`` is told when each attempt ends.
    """

    def __init__(self, request: EngineRequest, items: Iterator[Any] | Attempt, cancel: Callable[[], None] | None = None,
                 *, rerun: Callable[[Attempt], Attempt] | None = None,
                 on_end: Callable[[Attempt, bool], None] | None = None) -> None:
        from actors.generator import STREAM_RESULT

        super().__init__(request.request_id, request)
        self._result_key = STREAM_RESULT
        self._attempt = items if isinstance(items, Attempt) else Attempt("", request.request_id, items,
                                                                         cancel or (lambda: None))
        self._rerun, self._on_end = rerun, on_end
        self.reruns = 0
        self._streamed = False  # a token event reached this handle: the request can no longer move
        threading.Thread(target=self._read, daemon=True, name=f"raylens-remote-{request.request_id[:8]}").start()

    @property
    def replica(self) -> str:
        """The replica (actor name) running the request now."""
        return self._attempt.replica

    @property
    def streamed(self) -> bool:
        """Whether a token event has reached this handle (from then on the request cannot move)."""
        return self._streamed

    def _read(self) -> None:
        while True:
            attempt = self._attempt
            try:
                result = self._drain(attempt)
            except BaseException as err:  # raised to whoever waits for the result
                err = unwrap(err)
                lost = is_lost_actor(err)
                self._ended(attempt, lost)
                if lost and not self._streamed and self._rerun is not None and self.reruns < MAX_RERUNS \
                        and not self.cancel_requested and not attempt.quarantined:
                    try:
                        self._attempt = self._rerun(attempt)
                        self.reruns += 1
                        if self.cancel_requested:
                            self._attempt.cancel()
                        continue
                    except BaseException as again:
                        err = again
                elif lost:
                    when = "after tokens were sent" if self._streamed else \
                        f"before its first token, {self.reruns + 1} times (re-runs are bounded)"
                    cause, err = err, ReplicaLostError(
                        f"the generator replica running request {self.request_id!r} must stay up until its end, got "
                        f"it lost {when} ({type(err).__name__}); retry the request", parameter="replica",
                        value=attempt.replica)
                    err.__cause__ = cause
                self.set_exception(err)
                return
            self._ended(attempt, False)  # before the caller sees the result: the router's load is current
            self.set_result(result)
            self.end()
            return

    def _drain(self, attempt: Attempt) -> Any:
        """The attempt's events into the queue; its result."""
        for item in attempt.items:
            if isinstance(item, dict) and self._result_key in item:
                return item[self._result_key]
            self._streamed = True
            self._events.put(item)
        raise RuntimeError(f"the generator's stream of request {self.request_id!r} ended without a result")

    def _ended(self, attempt: Attempt, lost: bool) -> None:
        if self._on_end is not None:
            self._on_end(attempt, lost)

    def cancel(self) -> None:
        """Ask the actor to end the request at its next step (finish reason ``cancelled``); once."""
        if self.cancel_requested or self._future.done():
            return
        super().cancel()
        self._attempt.cancel()


class _Backend:
    """``engine.backend`` as the routes read it: ``info``, ``model.config`` and ``tokenizer()``."""

    def __init__(self, info: Any, tokenizer: Any, model_config: Any) -> None:
        self.info = info
        self.model = SimpleNamespace(config=model_config)
        self._tokenizer = tokenizer

    def tokenizer(self) -> Any:
        return self._tokenizer


class RemoteEngine:
    """The routes' engine over the config's GeneratorActor replicas, each request sent where the
    replica router puts it (:class:`~pipelines.cluster.replicas.ReplicaSet`)."""

    mods_as_payloads = True  # see Service.mod: registered mods are sent as payload dicts

    def __init__(self, replicas: ReplicaSet, config: RaylensConfig, tokenizer: Any, serve_info: Mapping[str, Any],
                 *, model_config: Any = None, accept_timeout_s: float | None = None, store: Any = None,
                 ingest: Any = None) -> None:
        from engine.model.backend import ModelInfo

        self.replicas = replicas
        self.config = config
        model = dict(serve_info["model"])
        model["eos_token_ids"] = tuple(model["eos_token_ids"])
        self.backend = _Backend(ModelInfo(**model), tokenizer, model_config)
        self.sae_features_inline = bool(serve_info.get("sae_features_inline"))
        self.accept_timeout_s = accept_timeout_s if accept_timeout_s is not None else config.ray.call_timeout_s
        self.store, self.ingest = store, ingest
        self._keys = PromptKeys(config, tokenizer, self.backend.info)
        self.quarantine = CrashQuarantine()  # requests a replica died running alone (pipelines/serve/quarantine.py)

    @classmethod
    def connect(cls, config: RaylensConfig) -> "RemoteEngine":
        """Get or create the config's actors (:func:`pipelines.cluster.topology.build_topology`: the same
        named actors a Ray Job with this config uses), start reading the replicas, and load the
        tokenizer and model config files."""
        import ray
        from transformers import AutoConfig, AutoTokenizer

        from engine.model.loading import resolve_model_path
        from pipelines.cluster.topology import build_topology

        topology = build_topology(config)
        info = ray.get(topology.generator.serve_info.remote(), timeout=config.ray.call_timeout_s)
        path = resolve_model_path(config.backend.model_id, config.backend.model_cache_dir)  # converted by the actor
        tokenizer = AutoTokenizer.from_pretrained(path, token=config.backend.hf_token)
        model_config = AutoConfig.from_pretrained(path, token=config.backend.hf_token)
        replicas = ReplicaSet(config).start()
        return cls(replicas, config, tokenizer, info, model_config=model_config, store=topology.store,
                   ingest=topology.ingest)

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer()

    @property
    def generators(self) -> list[Any]:
        """The replicas' actor handles, in replica order."""
        return list(self.replicas.handles.values())

    def reconnect(self) -> None:
        """Resolve the config's actors again (get or create, as a Ray Job does) and read them."""
        from pipelines.cluster.topology import build_topology

        build_topology(self.config)
        self.replicas.discover(fresh=True)
        self.replicas.refresh(wait_s=self.config.ray.call_timeout_s)

    def _ranked(self, route: RouteRequest, exclude: set[str]) -> Iterator[tuple[str, Any]]:
        """Replicas to try, best first, but ``exclude``; when none is left, the config's actors are
        resolved again (restarted ones answer again, a job may have recreated them, or
        get-or-create does) and their ranking follows, every replica a candidate again."""
        for resolved in (False, True):
            if resolved:
                self.reconnect()
            for name, actor in self.replicas.candidates(route, () if resolved else exclude):
                yield name, actor
        raise NoReplicaError("a generator replica must be up to take the request, got none (every replica died and "
                             "restarts, or drains); retry in a few seconds", parameter="replica")

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One replica's ``method`` (the least loaded), waited for at most ``ray.call_timeout_s``;
        its own error. A lost replica is marked down and the next one asked."""
        import ray

        for name, actor in self._ranked(RouteRequest(uuid.uuid4().hex), set()):
            try:
                return ray.get(getattr(actor, method).remote(*args, **kwargs), timeout=self.config.ray.call_timeout_s)
            except Exception as err:
                cause = unwrap(err)
                if not is_lost_actor(cause):
                    raise cause from None
                self.replicas.died(name)
        raise AssertionError("unreachable: _ranked raises when no replica is left")

    def encode(self, prompt: str | None = None, **kwargs: Any) -> list[int]:
        """``Engine.encode`` run by the actor (the chat template exactly as requests get it)."""
        return self._call("encode", prompt, **kwargs)

    def score(self, input_ids: Sequence[int], *, top_k: int = 0, job_id: str | None = None,
              timeout: float | None = None) -> Any:
        """``Engine.score`` run by a replica (a job its step loop schedules; :meth:`cancel` by ``job_id``)."""
        return self._call("score", list(input_ids), top_k, job_id=job_id, timeout=timeout)

    def capture(self, *, input_ids: Sequence[int], names: Sequence[str], job_id: str | None = None,
                timeout: float | None = None) -> dict[str, Any]:
        """``Engine.capture`` of ``input_ids`` run by a replica: ``{name: float32 numpy array}``."""
        return self._call("capture", [int(t) for t in input_ids], list(names), job_id=job_id, timeout=timeout)

    def embed_tokens(self, token_ids: Sequence[Sequence[int]], *, layer: int | None = None, pool: str = "mean",
                     job_id: str | None = None, timeout: float | None = None) -> Any:
        """``Engine.embed_tokens`` run by a replica."""
        return self._call("embed_tokens", [list(ids) for ids in token_ids], layer, pool, job_id=job_id,
                          timeout=timeout)

    def cancel(self, request_id: str) -> bool:
        """Ask every replica to cancel the request or job ``request_id`` (only the one running it
        has it); whether one did. A replica that does not answer is skipped."""
        import ray

        refs = [generator.cancel.remote(request_id) for generator in self.generators]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.ray.call_timeout_s)
        answers = []
        for ref in done:
            try:
                answers.append(ray.get(ref))
            except Exception:  # a replica lost meanwhile: it runs nothing to cancel
                answers.append(False)
        return any(answers)

    def submit(self, request: GenerationRequest | str | None = None, /, *, on_event: Any = None,
               block: bool = True, timeout: float | None = None, **fields: Any) -> RemoteHandle:
        """Start one request on the replica the router picks (a :class:`GenerationRequest` or its
        fields, as ``Engine.submit`` takes them); raises the engine's typed errors for bad input.
        Waits at most ``accept_timeout_s`` (or ``timeout``, if shorter) for the actor to take it
        (every request thread busy): then :class:`QueueFullError`. ``block`` is accepted for
        ``Engine.submit``'s signature: the actor's own queue decides, within that wait. A replica
        found dead or draining is passed over for the next one; a replica lost before the request's
        first token re-runs it elsewhere (:class:`RemoteHandle`)."""
        if on_event is not None:
            raise TypeError("on_event callbacks cannot reach the GeneratorActor; read the handle's events instead")
        request = as_request(request, fields)
        if any(callable(m) for m in request.mods):
            raise TypeError("mods sent to the GeneratorActor must be payload dicts or paths, not loaded callables")
        self.quarantine.check(request)
        route = RouteRequest(uuid.uuid4().hex, self._keys(request), current_group())
        attempt, accepted = self._open_any(request, route, timeout, set())

        def rerun(dead: Attempt) -> Attempt:
            return self._rerun(dead, request, route, timeout)

        def ended(attempt: Attempt, lost: bool) -> None:
            self.replicas.finished(route, attempt.replica, lost=lost)
            if attempt.running is not None:
                attempt.quarantined = self.quarantine.end(attempt.running, lost=lost)
                attempt.running = None

        return RemoteHandle(accepted, attempt, rerun=rerun, on_end=ended)

    def _rerun(self, dead: Attempt, request: GenerationRequest, route: RouteRequest,
               timeout: float | None) -> Attempt:
        """The request again, elsewhere, under ``<id>-retry<n>`` (the dead attempt's stored SAE blocks
        and ledger belong to its id, which is recorded abandoned, as a Ray job does)."""
        self.replicas.rerun()
        if self.store is not None:
            self.store.abandon_request.remote(dead.request_id, "its generator replica died before the first token")
        base = dead.request_id.split("-retry")[0]
        suffix = f"-retry{dead.request_id.count('-retry') + 1}"
        retry = request.replace(request_id=base[:REQUEST_ID_MAX_CHARS - len(suffix)] + suffix)
        attempt, _ = self._open_any(retry, route, timeout, {dead.replica})
        return attempt

    def _open_any(self, request: GenerationRequest, route: RouteRequest, timeout: float | None,
                  exclude: set[str]) -> tuple[Attempt, EngineRequest]:
        for name, actor in self._ranked(route, exclude):
            self.replicas.routed(route, name)
            try:
                return self._open(name, actor, request, timeout)
            except Exception as err:
                self.replicas.finished(route, name, lost=True)  # it never ran there
                cause = unwrap(err)
                if is_lost_actor(cause):
                    self.replicas.died(name)
                elif isinstance(cause, ReplicaDrainingError):
                    self.replicas.draining(name)
                else:
                    raise cause from None
        raise AssertionError("unreachable: _ranked raises when no replica is left")

    def _open(self, name: str, actor: Any, request: GenerationRequest,
              timeout: float | None) -> tuple[Attempt, EngineRequest]:
        running = self.quarantine.begin(actor, request)
        try:
            attempt, accepted = self._start_stream(name, actor, request, timeout)
        except BaseException as err:
            self.quarantine.end(running, lost=is_lost_actor(unwrap(err)))
            raise
        self.quarantine.answered(actor)  # it took the request: it runs (again)
        attempt.running = running
        return attempt, accepted

    def _start_stream(self, name: str, actor: Any, request: GenerationRequest,
                      timeout: float | None) -> tuple[Attempt, EngineRequest]:
        import ray

        stream = actor.stream.remote(request)
        wait = self.accept_timeout_s if timeout is None else min(timeout, self.accept_timeout_s)
        ready, _ = ray.wait([stream], timeout=wait)
        if not ready:
            try:
                ray.cancel(stream)  # still queued: it never starts
            except Exception:  # already started or gone: it ends at max_tokens, recorded like any other
                pass
            raise QueueFullError(f"the generator must take a request within {wait:g} s "
                                 "(ray.call_timeout_s), got every request thread busy: retry later, or raise "
                                 "ray.generator_max_concurrency (with backend.max_batch), or add replicas "
                                 "(`raylens scale N`)", parameter="ray.generator_max_concurrency")
        first = ray.get(next(stream))
        from actors.generator import STREAM_STARTED

        accepted: EngineRequest = first[STREAM_STARTED]

        def items() -> Iterator[Any]:
            for ref in stream:
                yield ray.get(ref)

        return Attempt(name, accepted.request_id, items(), lambda: actor.cancel.remote(accepted.request_id)), accepted

    # ------------------------------------------------------------------------------ metrics

    def replica_metrics(self) -> dict[str, Any]:
        """Each replica's :class:`~engine.engine_metrics.EngineMetrics` by label (None: no answer)."""
        return self.replicas.metrics(timeout=min(10.0, self.config.ray.call_timeout_s))

    def router_stats(self) -> Any:
        return self.replicas.stats()

    @property
    def reruns(self) -> int:
        """Requests re-run on another replica after theirs died before their first token."""
        return self.replicas.reruns

    def label(self, name: str) -> str:
        """A replica's label in metrics (its index)."""
        return self.replicas.label(name)

    def ingest_stats(self) -> dict[str, Any] | None:
        """The IngestActor's counts (delivered, spooled, …), None when it does not answer."""
        import ray

        if self.ingest is None:
            return None
        try:
            return ray.get(self.ingest.stats.remote(), timeout=min(10.0, self.config.ray.call_timeout_s))
        except Exception:  # a restarting IngestActor: its counters are left out of this scrape
            return None
