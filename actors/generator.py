"""GeneratorActor: the model and the mod loop, in a Ray actor.

It holds an in-process :class:`engine.Engine` (whose own store, SAE and ingest are off) and adds
the Ray wiring: hidden-state blocks go to SAE workers through :class:`RaySAESink`; each request's
row goes to the StoreActor and its payload to the IngestActor, both without waiting. It is a
threaded actor: each concurrent ``generate`` call waits in its own thread while the engine's one
step loop runs every request in flight as one batch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

from engine import Engine
from engine.config import RaylensConfig
from engine.core.result import GenerationResult

from .sae_handoff import RaySAESink
from .versioning import code_version

__all__ = ["GeneratorActor", "local_engine_config"]


def local_engine_config(config: RaylensConfig) -> RaylensConfig:
    """The Engine inside the actor writes nothing itself: the actors around it do."""
    return dataclasses.replace(
        config,
        activations=dataclasses.replace(config.activations, enabled=False),
        sae=dataclasses.replace(config.sae, enabled=False),
        ingest=dataclasses.replace(config.ingest, url=None),
    )


@ray.remote
class GeneratorActor:
    def __init__(self, config: dict[str, Any], store: Any, ingest: Any, sae_workers: list[Any]) -> None:
        self.config = RaylensConfig.from_dict(config)
        self.engine = Engine(local_engine_config(self.config))
        self.store = store
        self.ingest = ingest
        self.sink: RaySAESink | None = None
        if self.config.sae.enabled and sae_workers:
            sae = self.config.sae
            self.sink = RaySAESink(sae_workers, store, layer=sae.layer, block_steps=sae.block_steps,
                                   max_inflight=self.config.ray.max_inflight_blocks,
                                   skip_first_position=sae.skip_first_position, timeout_s=self.config.ray.call_timeout_s)
            self.engine.attach_hidden_sink(self.sink, sae.layer)
        self._pending: list[Any] = []  # fire-and-forget calls to store/ingest, settled by drain()
        self.requests = 0
        self.tokens = 0

    def version(self) -> str:
        return code_version()

    def model_info(self) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.backend.info)

    def generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request (the keyword arguments of ``Engine.generate``) → the result's JSON-able dict."""
        started = time.perf_counter()
        result: GenerationResult = self.engine.generate(**request)
        if self.config.activations.enabled:
            self._pending.append(self.store.record_request.remote(self.engine.request_record(result)))
        self._pending.append(self.ingest.submit.remote(result.payload))
        self.requests += 1
        self.tokens += len(result.sequence_ids)
        out = result.to_dict()
        out["metadata"]["actor_ms"] = round((time.perf_counter() - started) * 1000.0, 3)
        return out

    def drain(self) -> dict[str, Any]:
        """Wait for every SAE block and store/ingest call this generator started; then report."""
        if self.sink is not None:
            self.sink.drain()
        pending, self._pending = self._pending, []
        ray.get(pending, timeout=self.config.ray.call_timeout_s)
        return self.stats()

    def stats(self) -> dict[str, Any]:
        loop = self.engine.loop.stats
        stats: dict[str, Any] = {"requests": self.requests, "tokens": self.tokens,
                                 "batch": {"steps": loop.steps, "max_active": loop.max_active,
                                           "waits_for_room": loop.waits_for_room}}
        if self.sink is not None:
            stats["sae"] = {**dataclasses.asdict(self.sink.stats), "backlog": self.sink.backlog}
        return stats
