"""Which actors a config runs and what each asks Ray for: names, keys, roles, resource specs.

Actors are named and detached in one namespace, so jobs with the same config share one
StoreActor (DuckDB allows one writer), one IngestActor, the SAE workers and the generators. Each
name carries a key of the config parts the actor holds (:func:`actor_keys`): a job with another
store, ingest, SAE or resources never runs on actors built for another config; it gets its own.

Scale-out: ``ray.generators`` replicas of the GeneratorActor (one per GPU or node), which jobs
and the server spread their requests over (``pipelines/cluster/router.py``); ``raylens scale N``
changes the count of a running set (``pipelines/cluster/scaling.py``). Replica ``i`` is named
``raylens-generator-<key>-<i>``: every replica of a config shares the key, so a router finds the
replicas that run now by name (:func:`generator_prefix`).

Placement: SAE workers ask for ``ray.sae_worker_resource`` when it is set (e.g. ``sae_gpu``,
offered only by the second box of ray_cluster.yaml); the generator asks for
``ray.generator_num_gpus``. :func:`check_capacity` refuses, before anything is created, a config
that asks for more than the live nodes have: Ray keeps an unplaceable actor pending forever.

Pure computation over the config (no Ray call): the CLI, the server and the tests read names and
specs without a cluster.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.config import RaylensConfig
from engine.services.sae_mode import handoff_mode
from engine.errors import ClusterCapacityError

__all__ = ["ActorSpec", "actor_specs", "actor_keys", "actor_roles", "actor_names", "generator_name",
           "generator_prefix", "replica_index",
           "runs_sae_workers", "check_capacity", "STORE", "INGEST", "GENERATOR", "SAE_WORKER", "RAYLENS_PREFIX"]

STORE = "raylens-store"
INGEST = "raylens-ingest"
GENERATOR = "raylens-generator"
SAE_WORKER = "raylens-sae"
RAYLENS_PREFIX = "raylens-"  # every raylens actor name starts so (`raylens stop --all`)


def _canonical(value: Any) -> Any:
    """Equal settings, equal JSON: ``120`` and ``120.0`` (a YAML file's float field given as an int)
    and tuples and lists must not key two sets of actors."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def _digest(*parts: Any) -> str:
    """A short, stable key of the config parts an actor holds (JSON of plain values)."""
    text = json.dumps(_canonical(parts), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def actor_keys(config: RaylensConfig) -> dict[str, str]:
    """Per role, the key of what its actors hold: the config sections they were built from and
    the resources they asked for. A job whose config differs in any of these gets its own actors
    (the names include the key) instead of silently running on actors built for another config.

    Ray-level settings that do not shape an actor (namespace, addresses, start and connect
    timeouts, the number of generator replicas) are left out, so scaling out keeps the replicas
    that already run.
    """
    r = config.ray
    store = _digest(dataclasses.asdict(config.activations), r.store_num_cpus)
    ingest = _digest(dataclasses.asdict(config.ingest), r.ingest_batch_size, r.ingest_flush_interval_s,
                     r.ingest_num_cpus)
    sae = _digest(dataclasses.asdict(config.sae), config.backend.model_id, config.backend.model_cache_dir, store,
                  r.call_timeout_s, r.sae_worker_num_cpus, r.sae_worker_num_gpus, r.sae_worker_resource)
    shaping = {k: v for k, v in dataclasses.asdict(r).items() if k not in _NOT_SHAPING}
    generator = _digest(config.to_dict() | {"ray": shaping}, store, ingest, sae if runs_sae_workers(config) else None)
    return {STORE: store, INGEST: ingest, SAE_WORKER: sae, GENERATOR: generator}


_NOT_SHAPING = frozenset({"namespace", "address", "dashboard_url", "actor_start_timeout_s", "connect_timeout_s",
                          "generators", "router", "router_queue_bound", "router_refresh_s"})


def runs_sae_workers(config: RaylensConfig) -> bool:
    """SAE workers exist for nearline encoding only: with ``sae.mode: inline`` the generator
    encodes every step itself, and idle workers would only hold CPUs (or GPU shares)."""
    return config.sae.enabled and handoff_mode(config.sae, ray=True) == "ray-workers"


def actor_roles(config: RaylensConfig) -> dict[str, str]:
    """Role → actor name for every actor of ``config``. Roles are what a reader looks for
    (``raylens-store``, ``raylens-generator``, ``raylens-generator-1``, ``raylens-sae-0``); names
    add the config key (``raylens-store-1a2b3c4d``)."""
    keys = actor_keys(config)
    roles = {STORE: f"{STORE}-{keys[STORE]}", INGEST: f"{INGEST}-{keys[INGEST]}"}
    for i in range(config.ray.generators):
        roles[GENERATOR if i == 0 else f"{GENERATOR}-{i}"] = generator_name(config, i)
    if runs_sae_workers(config):
        for i in range(config.ray.sae_workers):
            roles[f"{SAE_WORKER}-{i}"] = f"{SAE_WORKER}-{keys[SAE_WORKER]}-{i}"
    return roles


def generator_name(config: RaylensConfig, replica: int = 0) -> str:
    return f"{generator_prefix(config)}{replica}"


def generator_prefix(config: RaylensConfig) -> str:
    """What the names of every generator replica of ``config`` start with (then the index)."""
    return f"{GENERATOR}-{actor_keys(config)[GENERATOR]}-"


def replica_index(config: RaylensConfig, name: str) -> int | None:
    """The replica index in a generator actor's name, or None when ``name`` is not one of ``config``'s."""
    prefix = generator_prefix(config)
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def actor_names(config: RaylensConfig) -> list[str]:
    """The names of every actor ``config`` runs on (SAE workers included even when SAE is off, so
    clean-up finds them)."""
    keys = actor_keys(config)
    workers = [f"{SAE_WORKER}-{keys[SAE_WORKER]}-{i}" for i in range(config.ray.sae_workers)]
    return sorted(set(actor_roles(config).values()) | set(workers))


@dataclass(frozen=True)
class ActorSpec:
    """One actor's Ray resource request, and the config keys that set each amount (for messages).
    ``name`` is the actor's role as messages show it (``raylens-generator``); ``actor`` its Ray name,
    which adds the config key."""

    name: str
    resources: dict[str, float]
    keys: dict[str, str]  # resource → the config key that sets its amount
    actor: str = ""


def actor_specs(config: RaylensConfig) -> list[ActorSpec]:
    """What every raylens actor asks Ray for, zero amounts left out (the one place they are listed)."""
    r = config.ray

    def spec(role: str, prefix: str, cpus: float, gpus: float = 0.0, custom: str | None = None) -> ActorSpec:
        wanted = [("CPU", cpus, f"ray.{prefix}_num_cpus"), ("GPU", gpus, f"ray.{prefix}_num_gpus")]
        if custom:
            wanted.append((custom, 1.0, f"ray.{prefix}_resource"))
        wanted = [w for w in wanted if w[1] > 0]
        return ActorSpec(role, {res: float(amount) for res, amount, _ in wanted}, {res: key for res, _, key in wanted},
                         actor=roles[role])

    roles = actor_roles(config)
    specs = [spec(STORE, "store", r.store_num_cpus), spec(INGEST, "ingest", r.ingest_num_cpus)]
    if runs_sae_workers(config):
        specs += [spec(f"{SAE_WORKER}-{i}", "sae_worker", r.sae_worker_num_cpus, r.sae_worker_num_gpus,
                       r.sae_worker_resource) for i in range(r.sae_workers)]
    specs += [spec(role, "generator", r.generator_num_cpus, r.generator_num_gpus, r.generator_resource)
              for role in roles if role == GENERATOR or role.startswith(f"{GENERATOR}-")]
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
            parts: defaultdict[str, float] = defaultdict(float)  # each setting's share, in the specs' order
            for s in specs:
                if res in s.resources:
                    parts[s.keys[res]] += s.resources[res]
            detail = ", ".join(f"{k} {v:g}" for k, v in parts.items())
            raise ClusterCapacityError(
                f"the raylens actors ask for {wanted:g} {res} in all ({detail}) but the cluster offers {offered:g}: "
                f"lower those settings (or ray.sae_workers, ray.generators) in the config, or add a node "
                f"(`ray start --address <head>:6379`)", parameter=f"ray.*{res}", value=wanted)
