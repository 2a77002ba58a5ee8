"""Every actor's count, resources and options, in one place: get-or-create the raylens actors.

Actors are named and detached in one namespace, so several jobs share one StoreActor (DuckDB
allows one writer), one IngestActor, the SAE workers and the generator. A detached actor keeps
the code it started with; each reports :func:`actors.code_version` and one that differs from the
caller's is replaced.

Placement: SAE workers ask for ``ray.sae_worker_resource`` when it is set (e.g. ``sae_gpu``,
offered only by the second box of ray_cluster.yaml); the generator asks for
``ray.generator_num_gpus``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors import GeneratorActor, IngestActor, SAEWorkerActor, StoreActor, code_version
from engine.config import RaylensConfig

__all__ = ["Topology", "build_topology", "actor_names", "connect"]

log = logging.getLogger("raylens.topology")

STORE = "raylens-store"
INGEST = "raylens-ingest"
GENERATOR = "raylens-generator"
SAE_WORKER = "raylens-sae-{}"


def actor_names(config: RaylensConfig) -> list[str]:
    return [STORE, INGEST, GENERATOR] + [SAE_WORKER.format(i) for i in range(config.ray.sae_workers)]


@dataclass
class Topology:
    config: RaylensConfig
    store: Any
    ingest: Any
    generator: Any
    sae_workers: list[Any]


def connect(config: RaylensConfig, address: str | None = None) -> None:
    """Join the running cluster (``ray start --head`` or a Ray Job's own) in raylens' namespace."""
    if not ray.is_initialized():
        ray.init(address=address or config.ray.address, namespace=config.ray.namespace,
                 log_to_driver=False, configure_logging=False)


def _get_or_create(cls: Any, name: str, config: RaylensConfig, options: dict[str, Any], *args: Any) -> Any:
    namespace = config.ray.namespace
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
        handle = None
    if handle is not None:
        try:
            if ray.get(handle.version.remote(), timeout=config.ray.call_timeout_s) == code_version():
                return handle
            log.warning("actor %s runs other code; replacing it", name)
        except (RayActorError, GetTimeoutError):
            log.warning("actor %s does not answer; replacing it", name)
        ray.kill(handle, no_restart=True)
    return cls.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
                       **options).remote(*args)


def build_topology(config: RaylensConfig) -> Topology:
    """Get or create every actor a generation job needs (the cluster must be connected)."""
    r = config.ray
    restartable = {"max_restarts": -1, "max_task_retries": 3}  # their methods are idempotent
    store = _get_or_create(StoreActor, STORE, config, {"num_cpus": r.store_num_cpus, **restartable},
                           dataclasses.asdict(config.activations))
    ingest = _get_or_create(IngestActor, INGEST, config, {"num_cpus": r.ingest_num_cpus, "max_restarts": -1},
                            dataclasses.asdict(config.ingest), r.ingest_batch_size, r.ingest_flush_interval_s)
    workers: list[Any] = []
    if config.sae.enabled:
        info = _model_dims(config)
        resources = {r.sae_worker_resource: 1} if r.sae_worker_resource else {}
        for i in range(r.sae_workers):
            workers.append(_get_or_create(
                SAEWorkerActor, SAE_WORKER.format(i), config,
                {"num_cpus": r.sae_worker_num_cpus, "num_gpus": r.sae_worker_num_gpus, "resources": resources,
                 "max_restarts": -1},
                dataclasses.asdict(config.sae), info["hidden_size"], info["num_layers"], config.backend.model_id,
                store, r.call_timeout_s))
    generator = _get_or_create(
        GeneratorActor, GENERATOR, config,
        {"num_cpus": r.generator_num_cpus, "num_gpus": r.generator_num_gpus,
         "max_concurrency": r.generator_max_concurrency, "max_restarts": -1},
        config.to_dict(), store, ingest, workers)
    return Topology(config, store, ingest, generator, workers)


def _model_dims(config: RaylensConfig) -> dict[str, int]:
    """Hidden size and layer count from the model's config file (no weights loaded)."""
    from transformers import AutoConfig

    from engine.models import resolve_model_path

    model_config = AutoConfig.from_pretrained(resolve_model_path(config.backend.model_id, config.backend.model_cache_dir),
                                              token=config.backend.hf_token)
    return {"hidden_size": int(model_config.hidden_size), "num_layers": int(model_config.num_hidden_layers)}
