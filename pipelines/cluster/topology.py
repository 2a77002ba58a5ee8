"""Get or create the raylens actors of one config and wait until each answers.

The actors' names and resources come from :mod:`pipelines.cluster.actor_specs`; here they are
created (detached, in the config's namespace) or found. A store file already held by a
StoreActor of other settings is refused with the way out. A detached actor keeps the code it
started with; each reports :func:`actors.code_version` and one that differs from the caller's is
replaced.

Before creating anything the actors' requests are checked against the live nodes, and new actors
must answer within ``ray.actor_start_timeout_s``: Ray keeps an unplaceable actor pending forever,
which would turn a config that asks for more than the cluster has into a silent hang.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from engine.config import RaylensConfig
from engine.errors import ActorConfigConflictError, ActorStartError, ClusterCapacityError

from .actor_specs import (GENERATOR, INGEST, SAE_WORKER, STORE, ActorSpec, _canonical, actor_specs, check_capacity,
                          runs_sae_workers)
from .connection import _last_error_line
from .ending import end_named_actors, listed_names

__all__ = ["Topology", "build_topology"]

log = logging.getLogger("raylens.topology")


@dataclass
class Topology:
    """Handles of one config's actors. ``generators`` are the ``ray.generators`` replicas a job
    spreads its requests over; ``generator`` is the first (one replica is the common case)."""

    config: RaylensConfig
    store: Any
    ingest: Any
    generators: list[Any]
    sae_workers: list[Any]

    @property
    def generator(self) -> Any:
        return self.generators[0]


def _get_or_create(cls: Any, name: str, config: RaylensConfig, options: dict[str, Any], *args: Any) -> Any:
    from actors import code_version

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
        # waited for: while Ray still lists the name, get-or-create would hand back the old actor
        if end_named_actors(namespace, [name], timeout_s=config.ray.call_timeout_s):
            raise ActorStartError(f"actor {name} was killed to be replaced but Ray still lists it after "
                                  f"{config.ray.call_timeout_s:g} s (ray.call_timeout_s); check the cluster with "
                                  "`ray list actors` and run the job again")
    return cls.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
                       **options).remote(*args)


def _check_store_owner(config: RaylensConfig, name: str) -> None:
    """A DuckDB file has one writer: refuse, with the way out, when a StoreActor built from other
    ``activations`` settings already holds this config's store file."""
    namespace = config.ray.namespace
    wanted = str(Path(config.activations.db_path).resolve())
    for other in sorted(listed_names(namespace)):
        if other == name or not other.startswith(f"{STORE}-"):
            continue
        try:
            handle = ray.get_actor(other, namespace=namespace)
            held = ray.get(handle.db_path.remote(), timeout=config.ray.call_timeout_s)
            theirs = ray.get(handle.settings.remote(), timeout=config.ray.call_timeout_s)
        except (ValueError, AttributeError, RayActorError, GetTimeoutError):
            continue  # gone, or older code that get-or-create replaces anyway
        if str(Path(held).resolve()) == wanted:
            ours = dataclasses.asdict(config.activations)
            differ = "; ".join(f"{k}: {theirs.get(k)!r} there, {v!r} here" for k, v in ours.items()
                               if _canonical(theirs.get(k)) != _canonical(v)) or "its code or resources"
            raise ActorConfigConflictError(
                f"`activations` must match the settings of the running {other}, which holds the store `{wanted}` "
                f"(DuckDB allows one writer), got other settings ({differ}). Run with that store's settings "
                "(relative paths count as written: give absolute ones), use another `activations.db_path`, or "
                "stop the running actors first: `raylens stop --all` (or `raylens stop --config OLD.yaml`)",
                parameter="activations", value=wanted)


def build_topology(config: RaylensConfig) -> Topology:
    """Get or create every actor a generation job needs (the cluster must be connected) and wait,
    at most ``ray.actor_start_timeout_s``, until each answers.

    Actors are found by name, and names carry :func:`actor_keys`: a job with another store path,
    ingest setting, SAE or resources gets actors of its own; it never runs on actors built for
    another config.
    """
    from actors import GeneratorActor, IngestActor, SAEWorkerActor, StoreActor  # the model side: imported when used

    r = config.ray
    specs = {s.name: s for s in actor_specs(config)}
    check_capacity(list(specs.values()), [n["Resources"] for n in ray.nodes() if n.get("Alive")])
    _check_store_owner(config, specs[STORE].actor)

    def create(cls: Any, role: str, extra: dict[str, Any], *args: Any) -> Any:
        res = dict(specs[role].resources)
        opts = {"num_cpus": res.pop("CPU", 0.0), "num_gpus": res.pop("GPU", 0.0), **extra}
        return _get_or_create(cls, specs[role].actor, config, {**opts, "resources": res} if res else opts, *args)

    restartable = {"max_restarts": -1, "max_task_retries": 3}  # their methods are idempotent
    handles = {STORE: create(StoreActor, STORE, restartable, dataclasses.asdict(config.activations))}
    store = handles[STORE]
    handles[INGEST] = create(IngestActor, INGEST, {"max_restarts": -1}, dataclasses.asdict(config.ingest),
                             r.ingest_batch_size, r.ingest_flush_interval_s)
    workers: list[Any] = []
    if runs_sae_workers(config):
        info = _model_dims(config)
        for i in range(r.sae_workers):
            role = f"{SAE_WORKER}-{i}"
            handles[role] = create(SAEWorkerActor, role, {"max_restarts": -1}, dataclasses.asdict(config.sae),
                                   info["hidden_size"], info["num_layers"], config.backend.model_id, store,
                                   r.call_timeout_s, info["family"])
            workers.append(handles[role])
    generators = []
    for role in [s.name for s in specs.values() if s.name == GENERATOR or s.name.startswith(f"{GENERATOR}-")]:
        handles[role] = create(GeneratorActor, role, {"max_concurrency": r.generator_max_concurrency,
                                                      "max_restarts": -1},
                               config.to_dict(), store, handles[INGEST], workers)
        generators.append(handles[role])
    _await_started(handles, specs, r.actor_start_timeout_s)
    return Topology(config, store, handles[INGEST], generators, workers)


def _await_started(handles: Mapping[str, Any], specs: Mapping[str, ActorSpec], timeout: float) -> None:
    """Wait until every actor answers, so a job never queues work on actors that cannot start."""
    refs = {handle.version.remote(): name for name, handle in handles.items()}
    log.info("waiting for %d actor(s) to start (at most %gs)", len(refs), timeout)
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    failed: dict[str, RayActorError] = {}
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError as err:
            failed[refs[ref]] = err
    for ref in [*pending, *(r for r in ready if refs[r] in failed)]:
        ray.kill(handles[refs[ref]], no_restart=True)  # detached: a dead or unplaced one would outlive the job
    if failed:
        name, error = next(iter(failed.items()))
        raise ActorStartError(f"actor {name} failed to start: {_last_error_line(error)} (its log has the traceback; "
                              "`ray logs actor --id <actor id>`)") from error
    if pending:
        waiting = ", ".join(f"{refs[ref]} ({_describe(specs[refs[ref]].resources)})" for ref in pending)
        raise ClusterCapacityError(
            f"actor(s) not started after {timeout:g}s: {waiting}. `ray status` shows what the cluster "
            "cannot place; lower those requests in the config, add a node, or raise ray.actor_start_timeout_s "
            "when the model is just slow to load", parameter="ray.actor_start_timeout_s", value=timeout)


def _describe(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items()) or "no resources"


def _model_dims(config: RaylensConfig) -> dict[str, Any]:
    """Hidden size, layer count and family from the model's config file (no weights loaded)."""
    from transformers import AutoConfig

    from engine.model.families import family_for_architectures
    from engine.model.loading import resolve_model_path

    model_config = AutoConfig.from_pretrained(resolve_model_path(config.backend.model_id, config.backend.model_cache_dir),
                                              token=config.backend.hf_token)
    family = family_for_architectures(model_config.architectures, config.backend.model_id)
    return {"hidden_size": int(model_config.hidden_size), "num_layers": int(model_config.num_hidden_layers),
            "family": family.name}
