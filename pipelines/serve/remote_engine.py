"""The engine surface the server's routes use, backed by the shared GeneratorActor.

The routes were written against :class:`engine.Engine` (``submit`` → a handle to iterate, ``result``
and ``cancel``; ``encode``; ``tokenizer``; ``backend.info``; ``config``). :class:`RemoteEngine` gives
them the same surface over the GeneratorActor that Ray Jobs use, so one step loop batches HTTP
streams with job requests, and the SAE workers, StoreActor and IngestActor record both:

* ``submit`` calls the actor's streaming ``stream`` method and waits for its first item, so bad
  input raises the engine's own typed error here, before any response starts (Ray's
  ``RayTaskError`` wrapper is removed: :func:`unwrap`).
* The handle (:class:`RemoteHandle`) yields the actor's ``TokenEvent`` / ``Erased`` as they come;
  ``cancel()`` asks the actor to end the request (a client that left frees its batch slot).
* A generator whose process dies fails the requests it was running with a retryable error (503);
  one that was this server's only request on it is quarantined (:mod:`.quarantine`): it is not
  retried here, and an identical request is refused (``QUARANTINED``, 400) for a while instead of
  crashing the generator again.
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

import itertools
import threading
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Mapping, Sequence

from engine.config import RaylensConfig
from engine.core.inputs import GenerationRequest, as_request
from engine.core.request import EngineRequest
from engine.core.stream import RequestHandle
from engine.errors import QueueFullError

from .errors import is_lost_actor
from .quarantine import CrashQuarantine

__all__ = ["RemoteEngine", "RemoteHandle", "unwrap"]


def unwrap(err: BaseException) -> BaseException:
    """The exception the actor raised, out of Ray's ``RayTaskError`` wrapper (whose message is a
    remote traceback); other errors (the actor died, a timeout) as they are."""
    from ray.exceptions import RayTaskError

    if isinstance(err, RayTaskError) and isinstance(getattr(err, "cause", None), BaseException):
        return err.cause
    return err


class RemoteHandle(RequestHandle):
    """One streamed request, as :class:`engine.core.stream.RequestHandle` (whose event queue,
    iteration and result it reuses): iterate it for the events, ``result(timeout)`` for the
    :class:`~engine.core.result.GenerationResult` (portable: no events, no payload),
    ``cancel()`` to end it early in the actor.

    ``items`` yields what the actor's ``stream`` yields after its first item: events, then
    ``{"result": GenerationResult}``; an exception it raises fails the request. A reader thread moves them
    into the queue, so ``result`` waits with a timeout even when nobody iterates.
    """

    def __init__(self, request: EngineRequest, items: Iterator[Any], cancel: Callable[[], None],
                 on_end: Callable[[bool], None] | None = None) -> None:
        from actors.generator import STREAM_RESULT

        super().__init__(request.request_id, request)
        self._result_key = STREAM_RESULT
        self._items = items
        self._cancel_remote = cancel
        self._on_end = on_end  # told once, before the caller sees the end: whether the generator was lost
        threading.Thread(target=self._read, daemon=True, name=f"raylens-remote-{request.request_id[:8]}").start()

    def _read(self) -> None:
        try:
            for item in self._items:
                if isinstance(item, dict) and self._result_key in item:
                    self._ended(lost=False)
                    self.set_result(item[self._result_key])
                    break
                self._events.put(item)
            else:
                raise RuntimeError(f"the generator's stream of request {self.request_id!r} ended without a result")
        except BaseException as err:  # raised to whoever waits for the result
            cause = unwrap(err)
            self._ended(lost=is_lost_actor(cause))
            self.set_exception(cause)
        else:
            self.end()

    def _ended(self, *, lost: bool) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(lost)

    def cancel(self) -> None:
        """Ask the actor to end the request at its next step (finish reason ``cancelled``); once."""
        if self.cancel_requested or self._future.done():
            return
        super().cancel()
        self._cancel_remote()


class _Backend:
    """``engine.backend`` as the routes read it: ``info``, ``model.config`` and ``tokenizer()``."""

    def __init__(self, info: Any, tokenizer: Any, model_config: Any) -> None:
        self.info = info
        self.model = SimpleNamespace(config=model_config)
        self._tokenizer = tokenizer

    def tokenizer(self) -> Any:
        return self._tokenizer


class RemoteEngine:
    """The routes' engine over GeneratorActor handles (several: requests go round-robin)."""

    mods_as_payloads = True  # see Service.mod: registered mods are sent as payload dicts

    def __init__(self, generators: Sequence[Any], config: RaylensConfig, tokenizer: Any, serve_info: Mapping[str, Any],
                 *, model_config: Any = None, accept_timeout_s: float | None = None) -> None:
        from engine.model.backend import ModelInfo

        if not generators:
            raise ValueError("RemoteEngine needs at least one GeneratorActor handle; build them with "
                             "pipelines.cluster.topology.build_topology(config)")
        self.generators = list(generators)
        self.config = config
        model = dict(serve_info["model"])
        model["eos_token_ids"] = tuple(model["eos_token_ids"])
        self.backend = _Backend(ModelInfo(**model), tokenizer, model_config)
        self.sae_features_inline = bool(serve_info.get("sae_features_inline"))
        self.accept_timeout_s = accept_timeout_s if accept_timeout_s is not None else config.ray.call_timeout_s
        self._next = itertools.cycle(range(len(self.generators)))
        self._lock = threading.Lock()
        self.quarantine = CrashQuarantine()  # requests a generator died running alone (pipelines/serve/quarantine.py)

    @classmethod
    def connect(cls, config: RaylensConfig) -> "RemoteEngine":
        """Get or create the config's actors (:func:`pipelines.cluster.topology.build_topology`: the same
        named actors a Ray Job with this config uses) and load the tokenizer and model config files."""
        import ray
        from transformers import AutoConfig, AutoTokenizer

        from engine.model.loading import resolve_model_path
        from pipelines.cluster.topology import build_topology

        topology = build_topology(config)
        info = ray.get(topology.generator.serve_info.remote(), timeout=config.ray.call_timeout_s)
        path = resolve_model_path(config.backend.model_id, config.backend.model_cache_dir)  # converted by the actor
        tokenizer = AutoTokenizer.from_pretrained(path, token=config.backend.hf_token)
        model_config = AutoConfig.from_pretrained(path, token=config.backend.hf_token)
        return cls(topology.generators, config, tokenizer, info, model_config=model_config)

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer()

    def _generator(self) -> Any:
        with self._lock:
            return self.generators[next(self._next)]

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One generator's ``method``, waited for at most ``ray.call_timeout_s``; its own error."""
        import ray

        try:
            return ray.get(getattr(self._generator(), method).remote(*args, **kwargs),
                           timeout=self.config.ray.call_timeout_s)
        except Exception as err:
            raise unwrap(err) from None

    def encode(self, prompt: str | None = None, **kwargs: Any) -> list[int]:
        """``Engine.encode`` run by the actor (the chat template exactly as requests get it)."""
        return self._call("encode", prompt, **kwargs)

    def score(self, input_ids: Sequence[int], *, top_k: int = 0, job_id: str | None = None,
              timeout: float | None = None) -> Any:
        """``Engine.score`` run by the actor (a job its step loop schedules; :meth:`cancel` by ``job_id``)."""
        return self._call("score", list(input_ids), top_k, job_id=job_id, timeout=timeout)

    def capture(self, *, input_ids: Sequence[int], names: Sequence[str], job_id: str | None = None,
                timeout: float | None = None) -> dict[str, Any]:
        """``Engine.capture`` of ``input_ids`` run by the actor: ``{name: float32 numpy array}``."""
        return self._call("capture", [int(t) for t in input_ids], list(names), job_id=job_id, timeout=timeout)

    def embed_tokens(self, token_ids: Sequence[Sequence[int]], *, layer: int | None = None, pool: str = "mean",
                     job_id: str | None = None, timeout: float | None = None) -> Any:
        """``Engine.embed_tokens`` run by the actor."""
        return self._call("embed_tokens", [list(ids) for ids in token_ids], layer, pool, job_id=job_id,
                          timeout=timeout)

    def cancel(self, request_id: str) -> bool:
        """Ask every generator to cancel the request or job ``request_id`` (only the one running it
        has it); whether one did."""
        import ray

        refs = [generator.cancel.remote(request_id) for generator in self.generators]
        try:
            return any(ray.get(refs, timeout=self.config.ray.call_timeout_s))
        except Exception as err:
            raise unwrap(err) from None

    def submit(self, request: GenerationRequest | str | None = None, /, *, on_event: Any = None,
               block: bool = True, timeout: float | None = None, **fields: Any) -> RemoteHandle:
        """Start one request on a generator (a :class:`GenerationRequest` or its fields, as
        ``Engine.submit`` takes them); raises the engine's typed errors for bad input. Waits at
        most ``accept_timeout_s`` (or ``timeout``, if shorter) for the actor to take it (every
        request thread busy): then :class:`QueueFullError`. ``block`` is accepted for
        ``Engine.submit``'s signature: the actor's own queue decides, within that wait. A
        generator that is gone is resolved again (:meth:`reconnect`) and the request tried once
        more; one lost while a request runs fails that request with a retryable error."""
        if on_event is not None:
            raise TypeError("on_event callbacks cannot reach the GeneratorActor; read the handle's events instead")
        request = as_request(request, fields)
        if any(callable(m) for m in request.mods):
            raise TypeError("mods sent to the GeneratorActor must be payload dicts or paths, not loaded callables")
        self.quarantine.check(request)
        try:
            return self._start(request, timeout)
        except Exception as err:
            if not is_lost_actor(unwrap(err)) or self.quarantine.seconds_left(request) is not None:
                raise  # not lost, or it was running alone when its generator died: not run again
        # the generator is gone (killed without a restart, its node lost): the config's actors are
        # resolved again — a job may already have recreated them — and the request tried once more
        self.reconnect()
        return self._start(request, timeout)

    def reconnect(self) -> None:
        """Resolve the config's actors again (get or create, as a Ray Job does)."""
        from pipelines.cluster.topology import build_topology

        with self._lock:
            self.generators = list(build_topology(self.config).generators)
            self._next = itertools.cycle(range(len(self.generators)))

    def _start(self, request: GenerationRequest, timeout: float | None) -> RemoteHandle:
        actor = self._generator()
        if self.quarantine.is_down(actor):  # it died: does it answer again (restarted)? else a lost error here
            self._answers(actor, timeout)
        running = self.quarantine.begin(actor, request)
        try:
            return self._stream(actor, request, timeout, running)
        except BaseException as err:
            self.quarantine.end(running, lost=is_lost_actor(unwrap(err)))
            raise

    def _answers(self, actor: Any, timeout: float | None) -> None:
        """Wait (within the accept time-out) for ``actor`` to answer a small call; its lost-actor
        error when it does not."""
        import ray

        wait = self.accept_timeout_s if timeout is None else min(timeout, self.accept_timeout_s)
        try:
            ray.get(actor.version.remote(), timeout=wait)
        except ray.exceptions.GetTimeoutError:
            raise QueueFullError(f"the generator must answer within {wait:g} s (ray.call_timeout_s) after its process "
                                 "died, got no answer yet (it is restarting): retry later",
                                 parameter="ray.call_timeout_s") from None
        except Exception as err:
            raise unwrap(err) from None
        self.quarantine.answered(actor)

    def _stream(self, actor: Any, request: GenerationRequest, timeout: float | None,
                running: tuple[str, int]) -> RemoteHandle:
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
                                 "ray.generator_max_concurrency (with backend.max_batch)",
                                 parameter="ray.generator_max_concurrency")
        try:
            first = ray.get(next(stream))
        except Exception as err:
            raise unwrap(err) from None
        from actors.generator import STREAM_STARTED

        accepted: EngineRequest = first[STREAM_STARTED]

        def items() -> Iterator[Any]:
            for ref in stream:
                yield ray.get(ref)

        return RemoteHandle(accepted, items(), lambda: actor.cancel.remote(accepted.request_id),
                            lambda lost: self.quarantine.end(running, lost=lost))
