"""Every actor's count, resources and options, in one place: get-or-create the raylens actors.

Actors are named and detached in one namespace, so several jobs share one StoreActor (DuckDB
allows one writer), one IngestActor, the SAE workers and the generator. A detached actor keeps
the code it started with; each reports :func:`actors.code_version` and one that differs from the
caller's is replaced.

Placement: SAE workers ask for ``ray.sae_worker_resource`` when it is set (e.g. ``sae_gpu``,
offered only by the second box of ray_cluster.yaml); the generator asks for
``ray.generator_num_gpus``.

Before creating anything the actors' requests are checked against the live nodes, and new actors
must answer within ``ray.actor_start_timeout_s``: Ray keeps an unplaceable actor pending forever,
which would turn a config that asks for more than the cluster has into a silent hang.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors import GeneratorActor, IngestActor, SAEWorkerActor, StoreActor, code_version
from engine.config import RaylensConfig
from engine.errors import ActorStartError, ClusterCapacityError

__all__ = ["Topology", "ActorSpec", "actor_specs", "check_capacity", "build_topology", "actor_names", "connect"]

log = logging.getLogger("raylens.topology")

STORE = "raylens-store"
INGEST = "raylens-ingest"
GENERATOR = "raylens-generator"
SAE_WORKER = "raylens-sae-{}"


def actor_names(config: RaylensConfig) -> list[str]:
    return [STORE, INGEST, GENERATOR] + [SAE_WORKER.format(i) for i in range(config.ray.sae_workers)]


@dataclass(frozen=True)
class ActorSpec:
    """One actor's Ray resource request, and the config keys that set each amount (for messages)."""

    name: str
    resources: dict[str, float]
    keys: dict[str, str]  # resource → the config key that sets its amount


def actor_specs(config: RaylensConfig) -> list[ActorSpec]:
    """What every raylens actor asks Ray for, zero amounts left out (the one place they are listed)."""
    r = config.ray

    def spec(name: str, prefix: str, cpus: float, gpus: float = 0.0, custom: str | None = None) -> ActorSpec:
        wanted = [("CPU", cpus, f"ray.{prefix}_num_cpus"), ("GPU", gpus, f"ray.{prefix}_num_gpus")]
        if custom:
            wanted.append((custom, 1.0, f"ray.{prefix}_resource"))
        wanted = [w for w in wanted if w[1] > 0]
        return ActorSpec(name, {res: float(amount) for res, amount, _ in wanted}, {res: key for res, _, key in wanted})

    specs = [spec(STORE, "store", r.store_num_cpus), spec(INGEST, "ingest", r.ingest_num_cpus)]
    if config.sae.enabled:
        specs += [spec(SAE_WORKER.format(i), "sae_worker", r.sae_worker_num_cpus, r.sae_worker_num_gpus,
                       r.sae_worker_resource) for i in range(r.sae_workers)]
    specs.append(spec(GENERATOR, "generator", r.generator_num_cpus, r.generator_num_gpus))
    return specs


def check_capacity(specs: Sequence[ActorSpec], nodes: Sequence[Mapping[str, float]]) -> None:
    """Raise :class:`ClusterCapacityError` when the live ``nodes`` (each its total resources) cannot
    hold ``specs``: an actor larger than every node, or more in all than the cluster has.

    A necessary condition only (it ignores how actors pack onto nodes and what other jobs hold);
    the start timeout in :func:`build_topology` catches the rest.
    """
    for s in specs:
        for res, amount in s.resources.items():
            largest = max((float(n.get(res, 0.0)) for n in nodes), default=0.0)
            if largest >= amount - 1e-9:
                continue
            if largest == 0 and res not in ("CPU", "GPU"):
                raise ClusterCapacityError(
                    f"no node offers the resource {res!r} that {s.name} asks for ({s.keys[res]}): start the box "
                    f"that offers it (`ray start --address <head>:6379 --resources '{{\"{res}\": 4}}'`, see "
                    f"ray_cluster.yaml) and wait until `ray status` lists it, or set {s.keys[res]}: null",
                    parameter=s.keys[res], value=res)
            raise ClusterCapacityError(
                f"{s.name} asks for {amount:g} {res} ({s.keys[res]}) but the largest node offers {largest:g}: "
                f"lower {s.keys[res]} in the config or add a node with more {res}", parameter=s.keys[res], value=amount)
    for res in sorted({res for s in specs for res in s.resources}):
        wanted = sum(s.resources.get(res, 0.0) for s in specs)
        offered = sum(float(n.get(res, 0.0)) for n in nodes)
        if wanted > offered + 1e-9:
            parts: Counter[str] = Counter()
            for s in specs:
                if res in s.resources:
                    parts[s.keys[res]] += s.resources[res]
            detail = ", ".join(f"{k} {v:g}" for k, v in parts.items())
            raise ClusterCapacityError(
                f"the raylens actors ask for {wanted:g} {res} in all ({detail}) but the cluster offers {offered:g}: "
                f"lower those settings (or ray.sae_workers) in the config, or add a node "
                f"(`ray start --address <head>:6379`)", parameter=f"ray.*{res}", value=wanted)


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
    """Get or create every actor a generation job needs (the cluster must be connected) and wait,
    at most ``ray.actor_start_timeout_s``, until each answers."""
    r = config.ray
    specs = {s.name: s for s in actor_specs(config)}
    check_capacity(list(specs.values()), [n["Resources"] for n in ray.nodes() if n.get("Alive")])

    def options(name: str, **extra: Any) -> dict[str, Any]:
        res = dict(specs[name].resources)
        opts = {"num_cpus": res.pop("CPU", 0.0), "num_gpus": res.pop("GPU", 0.0), **extra}
        return {**opts, "resources": res} if res else opts

    restartable = {"max_restarts": -1, "max_task_retries": 3}  # their methods are idempotent
    store = _get_or_create(StoreActor, STORE, config, options(STORE, **restartable),
                           dataclasses.asdict(config.activations))
    ingest = _get_or_create(IngestActor, INGEST, config, options(INGEST, max_restarts=-1),
                            dataclasses.asdict(config.ingest), r.ingest_batch_size, r.ingest_flush_interval_s)
    workers: list[Any] = []
    if config.sae.enabled:
        info = _model_dims(config)
        for i in range(r.sae_workers):
            name = SAE_WORKER.format(i)
            workers.append(_get_or_create(
                SAEWorkerActor, name, config, options(name, max_restarts=-1),
                dataclasses.asdict(config.sae), info["hidden_size"], info["num_layers"], config.backend.model_id,
                store, r.call_timeout_s))
    generator = _get_or_create(
        GeneratorActor, GENERATOR, config,
        options(GENERATOR, max_concurrency=r.generator_max_concurrency, max_restarts=-1),
        config.to_dict(), store, ingest, workers)
    handles = {STORE: store, INGEST: ingest, GENERATOR: generator}
    handles.update({SAE_WORKER.format(i): w for i, w in enumerate(workers)})
    _await_started(handles, specs, r.actor_start_timeout_s)
    return Topology(config, store, ingest, generator, workers)


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
        name, err = next(iter(failed.items()))
        raise ActorStartError(f"actor {name} failed to start: {_last_error_line(err)} (its log has the traceback; "
                              "`ray logs actor --id <actor id>`)") from err
    if pending:
        waiting = ", ".join(f"{refs[ref]} ({_describe(specs[refs[ref]].resources)})" for ref in pending)
        raise ClusterCapacityError(
            f"actor(s) not started after {timeout:g}s: {waiting}. `ray status` shows what the cluster "
            "cannot place; lower those requests in the config, add a node, or raise ray.actor_start_timeout_s "
            "when the model is just slow to load", parameter="ray.actor_start_timeout_s", value=timeout)


def _last_error_line(err: Exception) -> str:
    """The exception line that ends Ray's chained traceback of a failed ``__init__`` (the cause a
    user can act on), without terminal colour codes."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).splitlines()]
    return next((line for line in reversed(lines) if line), type(err).__name__)


def _describe(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items()) or "no resources"


def _model_dims(config: RaylensConfig) -> dict[str, int]:
    """Hidden size and layer count from the model's config file (no weights loaded)."""
    from transformers import AutoConfig

    from engine.model.loading import resolve_model_path

    model_config = AutoConfig.from_pretrained(resolve_model_path(config.backend.model_id, config.backend.model_cache_dir),
                                              token=config.backend.hf_token)
    return {"hidden_size": int(model_config.hidden_size), "num_layers": int(model_config.num_hidden_layers)}
