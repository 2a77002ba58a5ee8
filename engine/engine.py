"""``Engine``: the in-process entry point — a loaded backend plus requests in, results out.

It validates a request, applies the chat template, resolves mods and hands the request to the
shared step loop (:mod:`engine.core.step_loop`), which batches every request in flight into one
forward per step. When a request finishes, the engine decodes its text and, when an ingest URL is
configured, builds and delivers its ingest payload (otherwise the payload is built when the
result's ``payload`` is first read). Concurrent ``generate`` calls from any number
of threads (and the Ray GeneratorActor's concurrent calls) all join the one loop; ``submit`` and
``stream`` give a handle and a per-token stream for the HTTP layer.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from engine.config import REQUEST_ID_MAX_CHARS, RaylensConfig, load_config
from engine.core.input_processor import InputProcessor
from engine.core.jobs import Job, JobHandle
from engine.core.inputs import GenerationRequest, as_request
from engine.core.output import OutputProcessor
from engine.core.request import EngineRequest, HiddenSink, RequestState
from engine.core.result import GenerationResult
from engine.core.machine import RequestMachine
from engine.core.step_loop import Entry, StepLoop
from engine.core.stream import RequestHandle, StreamEvent
from engine.cache_events import CacheCursor, CacheEventLog, CacheEvents
from engine.engine_metrics import EngineMetrics, MetricsRecorder
from engine.errors import ContextOverflowError, InvalidRequestError, check_request_token_ids
from engine.model import Backend, create_backend
from engine.model.capture import CapturePlan, event_plan
from engine.model.hook_names import HookName, resid_post
from engine.model.sampling import SamplingParams, make_generator
from engine.model.tensor import TensorShim
from engine.services.ingest_client import IngestClient
from engine.services.ingest_payload import PayloadBuilder
from engine.services.sae import SAEEncoder, SteeringDirections
from engine.services.sae_blocks import BlockMeta
from engine.services.sae_handoff import BlockTransport, LocalTransport, SAEHandoff, build_handoff
from engine.services.store import ActivationStore, RequestRecord
from mods import conversation
from mods.legacy_names import install_legacy_names
from mods.loading import ModSpec, resolve_mods
from mods.manager import ModManager, mod_name
from mods.types import ModEvent

__all__ = ["Engine", "GenerationRequest", "load_mods"]



def load_mods(specs: Sequence[ModSpec] | None, *, allowed_dirs: Sequence[str] = ()) -> list[Callable[..., Any]]:
    """Resolve mods with ``max.driver.Tensor`` bound to the engine's tensor class first, so a mod
    that imports it at load time builds tensors the engine produces. Directory payloads load only
    from ``allowed_dirs`` (the config's ``generation.mod_dirs``)."""
    install_legacy_names(tensor_class=TensorShim)
    return resolve_mods(specs, allowed_dirs=allowed_dirs)


_unfreeze_at_exit = False
#: The collector's youngest-generation threshold while an engine runs (CPython's default is 700).
#: A step of 64 requests with a mod allocates ~6,000 tracked objects (events, records, calls), so
#: at 700 the collector ran ~4 young and ~0.3 middle collections a step, 1.2 ms of a 26 ms step;
#: at 20,000 it takes 0.5 ms, and a whole run at 64 is 4 % faster with a logits mod, 3-4 % without.
GC_YOUNG_THRESHOLD = 20_000


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (the ~400k objects of torch, transformers and the
    model) out of the garbage collector's reach. Generation allocates many short-lived objects,
    and each full collection would otherwise walk all of them: on an H100, a 250 ms pause in
    the middle of a batch of 32 requests (a third of the batch's time). Serving engines do the
    same after start-up. Closing an engine that owns its model unfreezes them, so a process that
    loads models one after another does not keep the old ones. The young generation's threshold
    is raised to :data:`GC_YOUNG_THRESHOLD` (never lowered, and left off when the process turned
    the collector off): most of a step's objects die young by reference counting, and each young
    collection walks the survivors again."""
    global _unfreeze_at_exit
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if 0 < young < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, *older)
    if not _unfreeze_at_exit:  # so the interpreter's last collection still finalises them (extension
        _unfreeze_at_exit = True  # modules such as duckdb's report objects never freed as leaks)
        atexit.register(gc.unfreeze)


def _kv_capacity_tokens(backend: Backend) -> int:
    """The most positions the KV pool can hold at once (every block but the scratch one)."""
    layout = backend.kv_layout
    return (layout.max_blocks - 1) * layout.block_size


class Engine:
    def __init__(self, config: RaylensConfig, *, backend: Backend | None = None) -> None:
        self.config = config
        self._owns_backend = backend is None  # a backend passed in is shared; closing us leaves it loaded
        self.backend = backend if backend is not None else create_backend(config.backend)
        install_legacy_names(tensor_class=TensorShim)
        self._ingest = IngestClient(config.ingest) if config.ingest.url else None
        self._active: set[str] = set()
        self._lock = threading.Lock()
        self.store: ActivationStore | None = None
        self.recorder: SAEHandoff | None = None
        self._sink: HiddenSink | None = None
        self._sink_layer: int | None = None
        backend_cfg = self.backend.config
        self._event_names = event_plan(backend_cfg.hidden_state_layer, hidden_states=backend_cfg.extract_hidden_states,
                                       attention=backend_cfg.extract_attention)
        if config.activations.enabled:
            self.store = ActivationStore.from_config(config.activations)
        self._steering: SteeringDirections | None = None
        if config.sae.enabled:
            self.use_sae(self._build_recorder())
        self.loop = StepLoop.for_backend(self.backend)
        info = self.backend.info
        self.processor = InputProcessor(
            tokenizer=self.backend.tokenizer(), vocab_size=info.vocab_size, max_context=info.max_context,
            max_sequence=self.backend.max_sequence, eos_token_ids=info.eos_token_ids,
            defaults=config.generation, load_mods=lambda specs, dirs: load_mods(specs, allowed_dirs=dirs),
            prefix_caching=self.backend.config.prefix_caching, structured=config.structured,
            kv_capacity_tokens=_kv_capacity_tokens(self.backend), sends_payloads=self._ingest is not None)
        self.output = OutputProcessor(tokenizer=self.backend.tokenizer(), info=info,
                                      backend_type=config.backend.backend_type, layer=config.backend.hidden_state_layer,
                                      ingest=self._ingest, store=self.store, sae_metadata=self._sae_metadata)
        self._handles: dict[str, RequestHandle] = {}  # this engine's requests in flight
        self._jobs: dict[str, JobHandle] = {}  # this engine's jobs in flight (embeddings, scoring, captures)
        self._session = uuid.uuid4().hex[:8]  # suffixes a reused request id (see _unused_request_id)
        # --- routing and metrics (issue 36): the prefix index's event log, the per-request figures
        self._metrics = MetricsRecorder(spool_dir=config.ingest.spool_dir if self._ingest is not None else None)
        self._cache_log = self._attach_cache_log()
        # ---
        freeze_startup_objects()

    def use_sae(self, handoff: SAEHandoff) -> None:
        """Send every forward's residual stream at the SAE's layer through ``handoff``. With the SAE
        in this process, Steer actions use its decoder directions and, inline, its features ride
        on events and streams. The Ray generator hands in one that writes through the StoreActor
        or ships blocks to SAE workers."""
        self.recorder = handoff
        self.attach_hidden_sink(handoff, handoff.layer)
        if handoff.encoder is not None:
            self._steering = SteeringDirections(handoff.encoder)

    def attach_hidden_sink(self, sink: HiddenSink, layer: int) -> None:
        """Subscribe ``sink`` to every forward's residual stream after ``layer`` (the Ray
        generator's SAE hand-off uses this instead of the in-process recorder)."""
        CapturePlan.of([resid_post(layer)], self.backend.info.num_layers)  # refuses a layer out of range
        self._sink, self._sink_layer = sink, layer

    def set_capture(self, *, hidden_states: bool, attention: bool) -> None:
        """What mod events carry from now on (requests already running keep theirs)."""
        self._event_names = event_plan(self.backend.config.hidden_state_layer, hidden_states=hidden_states,
                                       attention=attention)

    def _build_recorder(self) -> SAEHandoff:
        """Load the SAE and route its encoded rows to this engine's store."""
        store = self.store
        assert store is not None  # RaylensConfig refuses sae.enabled without activations.enabled

        def write(rows: Any, batch_id: str, request_id: str) -> int:
            return store.append_activations(rows, batch_id=batch_id, request_id=request_id)

        def missing(block: BlockMeta, reason: str) -> None:
            store.record_missing_block(**block.ledger(), reason=reason)

        return self.sae_recorder(write, missing)

    def sae_recorder(self, write: Callable[[Any, str, str], int], missing: Callable[[BlockMeta, str], None], *,
                     ray: bool = False, remote: Callable[[], BlockTransport] | None = None) -> SAEHandoff:
        """The config's SAE hand-off (``sae`` settings, whether or not ``sae.enabled``), its mode
        chosen by :func:`~engine.services.sae_handoff.build_handoff`. In process, the SAE is loaded
        for this model and ``write``/``missing`` decide where its rows and failed blocks go: this
        engine's store, or the StoreActor of a Ray generator (``ray``), whose SAE workers'
        transport ``remote`` carries nearline blocks."""
        sae, info = self.config.sae, self.backend.info

        def local(threaded: bool) -> LocalTransport:
            encoder = SAEEncoder.load(sae.sae_id, layer=sae.layer, top_k=sae.top_k, model_hidden_size=info.hidden_size,
                                      model_layers=info.num_layers, model_family=info.family,
                                      device=info.device if sae.device == "auto" else sae.device, dtype=sae.dtype)
            return LocalTransport(encoder, write, missing, model_id=info.model_id, threaded=threaded)

        return build_handoff(self.config, ray=ray, local=local, remote=remote)

    @classmethod
    def from_config(cls, path: str | Path | None = None, *,
                    overrides: Mapping[str, Mapping[str, Any]] | None = None) -> "Engine":
        """Load ``configs/local.yaml`` (or ``path``/``RAYLENS_CONFIG``) with env overrides, then the model."""
        return cls(load_config(path, overrides=overrides))

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer()

    def cache_stats(self) -> dict[str, Any]:
        """The paged KV cache's blocks (total, used, free, cached, reserved), evictions, and the
        prefix cache's lookups and hit rate (tokens reused / prompt tokens)."""
        return self.loop.cache_stats()

    @property
    def sae_features_inline(self) -> bool:
        """Whether events and streamed tokens carry SAE features: the SAE encodes inline, so each
        step's top-k features exist before its events (nearline, they reach the store only)."""
        return self.recorder is not None and self.recorder.mode == "inline"

    def flush(self) -> None:
        """Wait until every hidden-state block handed off is stored (or recorded missing)."""
        if self.recorder is not None:
            self.recorder.drain()

    def close(self) -> None:
        """Cancel this engine's requests still running (their results are still built), stop the
        step loop when this engine owns the backend, finish pending SAE work (nothing in flight is
        lost), then release everything."""
        with self._lock:
            handles = list(self._handles.values()) + list(self._jobs.values())
        for handle in handles:
            handle.cancel()
        for handle in handles:
            try:
                handle.result(timeout=60)
            except Exception:  # the caller of that request (or job) sees its error
                pass
        self.processor.close()
        if self._owns_backend:
            self.loop.close()
        if self.recorder is not None:
            self.recorder.close()
        if self.store is not None:
            self.store.close()
        if self._ingest is not None:
            self._ingest.close()
        if self._owns_backend:
            self.backend.shutdown()
            gc.unfreeze()  # the model's objects become collectable again

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------- requests

    def encode(self, prompt: str | None = None, *, messages: list[dict[str, Any]] | None = None,
               input_ids: Sequence[int] | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids for exactly one of ``prompt`` (a user turn), ``messages`` or ``input_ids``."""
        return self.processor.encode(GenerationRequest(prompt=prompt, messages=messages, input_ids=input_ids,
                                                       tools=tools))

    def _claim(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._active:
                raise InvalidRequestError(f"request id {request_id!r} is already running", parameter="request_id",
                                          value=request_id)
            self._active.add(request_id)

    def submit(self, request: GenerationRequest | str | None = None, /, *,
               on_event: Callable[[ModEvent], None] | None = None, block: bool = True,
               timeout: float | None = None, **fields: Any) -> RequestHandle:
        """Queue one request in the shared step loop and return its handle (iterate it for the
        token stream; ``result()`` for the :class:`GenerationResult`). Bad input raises here.

        ``request`` is a :class:`~engine.core.inputs.GenerationRequest`, or its fields are given as
        keywords (a positional string is the ``prompt``). ``on_event`` sees every mod event as it
        is dispatched. With every slot and the wait queue full, ``block`` waits (up to
        ``timeout``) for room; ``block=False`` raises :class:`~engine.errors.QueueFullError`.
        """
        processed = self._unused_request_id(self.processor.process(as_request(request, fields)))
        info = self.backend.info
        request_id = processed.request_id
        names: set[HookName | str] = set(self._event_names)
        if self._sink is not None:
            names.add(resid_post(self._sink_layer))  # type: ignore[arg-type]  # set with the sink
        if processed.attention_all_layers:
            names.update(f"blocks.{layer}.attn.hook_pattern" for layer in range(info.num_layers))
        plan = CapturePlan.of(names, info.num_layers)
        context = processed.context
        user_prompt = context.user_prompt
        loaded = processed.mods
        builder = PayloadBuilder(request_id, tokenizer=self.tokenizer, request={
            "model": info.model_id[:255],
            "max_tokens": processed.max_tokens,
            "temperature": processed.sampling.temperature,
            "mod_text": ", ".join(mod_name(m) for m in loaded) or None,
            "active_mod_name": mod_name(loaded[-1])[:255] if loaded else None,
            "user_prompt": user_prompt,
            "user_prompt_token_ids": self.tokenizer.encode(user_prompt, add_special_tokens=False)
            if user_prompt else None,
        }, limits=self.config.ingest)
        manager = ModManager(list(loaded), tokenizer=self.tokenizer, call_timeout_s=processed.mod_call_timeout_s)
        handle = self._metrics.handle(request_id, processed)  # a RequestHandle that times its tokens
        state = RequestState(
            request=processed, manager=manager, payload=builder,
            generator=make_generator(processed.seed, self.backend.device), plan=plan,
            prompt_ids=list(processed.input_ids), max_tokens=processed.max_tokens,
            forced_queue=manager.forced_queues.setdefault(request_id, []),
            event_layer=self.backend.config.hidden_state_layer, on_event=on_event, hidden_sink=self._sink,
            stream=handle, started_at=time.perf_counter(),
        )
        self._claim(request_id)
        if loaded:  # what mods read through the conversation API (a request with none needs no copy)
            conversation.set_conversation(request_id, [dict(m) for m in context.conversation])
            conversation.set_schemas(request_id, conversation.schemas_from_request(
                context.response_format, list(context.tools) if context.tools is not None else None))
        try:
            with self._lock:
                self._handles[request_id] = handle
            machine = RequestMachine(state, vocab_size=info.vocab_size, device=self.backend.device,
                                     steering=self._steering)
            self.loop.submit(Entry(machine, handle, self._finalize), block=block, timeout=timeout)
        except BaseException:
            self._release(request_id)
            raise
        return handle

    def _unused_request_id(self, processed: EngineRequest) -> EngineRequest:
        """With a store, a caller's id that any earlier request used runs under a fresh one
        (``<id>~<session>``), as a Ray job's lines do: the store's rows of that id describe the
        earlier request's tokens, and SAE batch ids derive from it. The result says both ids."""
        if self.store is None or processed.caller_request_id is None:
            return processed  # a generated id is fresh
        [claimed] = self.store.claim_request_ids([processed.request_id], self._session, max_chars=REQUEST_ID_MAX_CHARS)
        return processed if claimed == processed.request_id else dataclasses.replace(processed, request_id=claimed)

    def stream(self, request: GenerationRequest | str | None = None, /, **kwargs: Any) -> Iterator[StreamEvent]:
        """``iter(submit(...))``: token events as they are committed (see :meth:`submit`)."""
        return iter(self.submit(request, **kwargs))

    def generate(self, request: GenerationRequest | str | None = None, /, *,
                 on_event: Callable[[ModEvent], None] | None = None, **fields: Any) -> GenerationResult:
        """Generate one completion: ``submit(...).result()``. ``request`` is a
        :class:`~engine.core.inputs.GenerationRequest` or its fields as keywords (exactly one of
        ``prompt``, ``messages``, ``input_ids``; ``mods``: callables, ``.py`` paths or payload
        dicts, called in order; unset sampling values come from the config's ``generation``
        section). Concurrent calls share the step loop: each is one more row in the batch.
        """
        return self.submit(request, on_event=on_event, **fields).result()

    def candidates(self, request: GenerationRequest | str | None = None, /, *, n: int = 8, seed: int | None = 0,
                   **kwargs: Any) -> list[Any]:
        """``n`` sampled completions as :class:`~engine.candidates.Candidate` (text, token ids,
        summed log-prob), highest log-prob first, generated as one batch. Takes ``generate``'s
        keyword arguments (``messages=``, ``input_ids=``, ``temperature``, ``top_p``, ``top_k``,
        ``max_tokens``, ``mods``, …); candidate ``i`` is seeded ``seed + i``."""
        from engine.candidates import generate_candidates

        return generate_candidates(self, as_request(request, kwargs), n=n, seed=seed)

    def _release(self, request_id: str) -> None:
        conversation.clear_request(request_id)
        with self._lock:
            self._active.discard(request_id)
            self._handles.pop(request_id, None)

    # ---------------------------------------------------------------------------- results

    def _finalize(self, entry: Entry) -> GenerationResult:
        """Runs on a finisher thread once the request left the batch."""
        state = entry.machine.state
        try:
            entry.machine.materialize()  # a request nobody watched step by step: its events now
            state.manager.close()
            state.manager.forced_queues.pop(state.request_id, None)
            state.manager.forced_reason_queues.pop(state.request_id, None)
            elapsed_ms = (time.perf_counter() - state.started_at) * 1000.0
            result = self.output.result(state, elapsed_ms, steers=entry.machine.steer_log)
            self._metrics.finished(entry.handle, result, steps=state.step, mod_stats=state.manager.call_stats)
            return result
        finally:
            self._release(state.request_id)

    def _sae_metadata(self) -> dict[str, Any] | None:
        """What a result reports of the SAE that encoded it in this process (None without one)."""
        if self.recorder is None or self.recorder.encoder is None:
            return None
        identity = self.recorder.encoder.identity
        return {"mode": self.recorder.mode, "release": identity.release, "sae_id": identity.sae_id,
                "layer": identity.layer, "top_k": identity.top_k, **self.recorder.stats.as_dict()}

    def request_record(self, result: GenerationResult, sampling: SamplingParams | None = None) -> RequestRecord:
        """The requests-table row of a result: readable without the ingest backend."""
        return self.output.request_record(result, sampling)

    # ------------------------------------------------------------- routing and metrics (issue 36)

    def _attach_cache_log(self) -> CacheEventLog:
        """The scheduler's prefix index reports to one event log (created by the first engine over
        the loop; engines sharing a backend share its loop and its log)."""
        kv = self.loop.scheduler.kv
        if not isinstance(kv.index.listener, CacheEventLog):
            kv.index.listener = CacheEventLog(kv.block_size)
        return kv.index.listener

    def cache_events(self, cursor: CacheCursor | None = None) -> CacheEvents:
        """What the prefix cache stored and removed since ``cursor`` (None: everything cached now),
        keyed by chained block hashes: a router's view of this engine (engine/cache_events.py)."""
        return self._cache_log.since(cursor)

    def metrics(self) -> EngineMetrics:
        """This engine's serving metrics now (engine/engine_metrics.py): queues, tokens, latencies,
        KV and prefix-cache use, mods, the SAE hand-off and, in process, ingest delivery."""
        return self._metrics.snapshot(running=self.loop.active, waiting=self.loop.waiting,
                                      steps=self.loop.stats.steps, cache=self.loop.cache_stats(),
                                      sae=self.recorder.report() if self.recorder is not None else None,
                                      ingest=self._ingest is not None)

    # ------------------------------------------------------------------- embeddings and capture

    def submit_job(self, kind: str, start: Callable[[Any], Any], *, job_id: str | None = None,
                   timeout: float | None = None) -> JobHandle:
        """Schedule non-generation work in the step loop (:mod:`engine.core.jobs`): ``start(loop)``
        makes its work generator; ``timeout`` stops it between units. :meth:`cancel` (by
        ``job_id``) or the handle's ``cancel()`` stops it at its next unit."""
        handle = JobHandle(kind, job_id, timeout_s=timeout)
        with self._lock:
            if handle.job_id in self._active:
                raise InvalidRequestError(f"request id {handle.job_id!r} is already running", parameter="request_id",
                                          value=handle.job_id)
            self._active.add(handle.job_id)
            self._jobs[handle.job_id] = handle
        handle.future.add_done_callback(lambda _: self._release_job(handle.job_id))
        try:
            self.loop.submit_job(Job(handle, start))
        except BaseException:
            self._release_job(handle.job_id)
            raise
        return handle

    def _release_job(self, job_id: str) -> None:
        with self._lock:
            self._active.discard(job_id)
            self._jobs.pop(job_id, None)

    def cancel(self, request_id: str) -> bool:
        """Cancel a request or job of this engine by id (a generation ends at its next step,
        finish reason ``cancelled``; a job at its next unit); False when none is running."""
        with self._lock:
            handle = self._handles.get(request_id) or self._jobs.get(request_id)
        if handle is None:
            return False
        handle.cancel()
        return True

    def embed(self, texts: Sequence[str], *, layer: int | None = None, pool: str = "mean",
              batch_size: int = 16, timeout: float | None = None, job_id: str | None = None) -> Any:
        """``(len(texts), d)`` float32 numpy embeddings: the final normed hidden states (or the
        residual stream after block ``layer``) pooled by ``"mean"`` or ``"last"``. Texts are
        plain text (no chat template, no BOS); each call runs fresh forwards, no cache reused.
        Scheduled by the step loop a batch per step (:meth:`submit_job`); past ``timeout`` it
        stops and raises :class:`~engine.errors.RequestTimeoutError`. See
        :mod:`engine.model.embeddings`."""
        from engine.model.embeddings import tokenize_texts

        ids = tokenize_texts(self.tokenizer, texts, self.backend.info.max_context)
        return self.embed_tokens(ids, layer=layer, pool=pool, batch_size=batch_size, timeout=timeout, job_id=job_id)

    def capture(self, prompt: str | None = None, *, messages: list[dict[str, Any]] | None = None,
                input_ids: Sequence[int] | None = None, names: Sequence[str] = ("*",),
                out: str | Path | None = None, timeout: float | None = None, job_id: str | None = None) -> dict[str, Any]:
        """Named intermediates of one fresh forward pass over exactly one of ``prompt`` (a
        chat-templated user turn), ``messages`` or ``input_ids``: ``{name: tensor}`` with the
        batch dimension dropped, for every internal matching ``names`` (globs). With ``out``,
        also writes ``tensors.safetensors`` and ``manifest.json`` there. Capture never changes
        the model's outputs; it runs in the step loop between steps. See
        :mod:`engine.model.named_capture`."""
        from engine.core.scheduled_work import capture_work
        from engine.model.hook_names import expand_hook_names

        ids = self.encode(prompt, messages=messages, input_ids=input_ids)
        info = self.backend.info
        expand_hook_names(names, info.num_layers, info.hooks)  # a bad name is refused here, before queueing
        handle = self.submit_job("capture", lambda loop: capture_work(loop, ids, names, out), job_id=job_id,
                                 timeout=timeout)
        return handle.result(timeout)

    def embed_tokens(self, token_ids: Sequence[Sequence[int]], *, layer: int | None = None, pool: str = "mean",
                     batch_size: int = 16, timeout: float | None = None, job_id: str | None = None) -> Any:
        """:meth:`embed` of texts already tokenised (``token_ids[i]``: one text's plain-text ids, as
        :func:`~engine.model.embeddings.tokenize_texts` gives them): ``(len(token_ids), d)``
        float32 numpy, row ``i`` equal to ``embed`` of that text. Each list must be non-empty,
        in the vocabulary and fit the context."""
        from engine.core.scheduled_work import embed_work
        from engine.errors import ContextOverflowError

        limit = self.backend.info.max_context
        for i, ids in enumerate(token_ids):
            if not isinstance(ids, (str, bytes)) and isinstance(ids, Sequence) and len(ids) > limit:
                raise ContextOverflowError(f"`input[{i}]` must fit the model's context of {limit} tokens, got "
                                           f"{len(ids)}; shorten it", parameter=f"input[{i}]", value=len(ids))
        budget = self.backend.config.max_step_tokens
        batches = self.backend.embed_batches(token_ids, layer=layer, pool=pool, batch_size=batch_size,
                                             max_tokens=budget)  # arguments checked here
        handle = self.submit_job("embeddings", lambda loop: embed_work(loop, batches), job_id=job_id, timeout=timeout)
        return handle.result(timeout)

    def score(self, input_ids: Sequence[int], *, top_k: int = 0, timeout: float | None = None,
              job_id: str | None = None) -> Any:
        """Each token's log-prob given the tokens before it (the first: None), and the ``top_k``
        best alternatives at each position: a :class:`~engine.model.scoring.SequenceScores`. What
        prompt log-probs (OpenAI's ``echo`` with ``logprobs``) need. Scheduled by the step loop:
        the prompt is fed in chunks over KV blocks reserved for it. See :mod:`engine.model.scoring`."""
        from engine.core.scheduled_work import score_work
        from engine.model.scoring import MAX_SCORE_TOP_K

        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_SCORE_TOP_K:
            raise InvalidRequestError(f"`top_k` must be an integer in [0, {MAX_SCORE_TOP_K}], got {top_k!r}",
                                      parameter="top_k", value=top_k)
        ids = check_request_token_ids(input_ids, self.backend.info.vocab_size, "input_ids")
        if not ids:
            raise InvalidRequestError("`input_ids` must hold at least one token, got []", parameter="input_ids",
                                      value=[])
        limit = min(self.backend.info.max_context, self.backend.max_sequence)
        if len(ids) > limit:
            raise ContextOverflowError(f"`input_ids` must fit the model's context of {limit} tokens, got {len(ids)}",
                                       parameter="input_ids", value=len(ids))
        job_id = job_id or f"scoring-{uuid.uuid4().hex[:12]}"  # its KV blocks are held under this id
        handle = self.submit_job("scoring", lambda loop: score_work(loop, job_id, ids, top_k), job_id=job_id,
                                 timeout=timeout)
        return handle.result(timeout)
