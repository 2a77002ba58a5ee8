"""Every actor's count, resources and options, in one place: get-or-create the raylens actors.

Actors are named and detached in one namespace, so jobs with the same config share one
StoreActor (DuckDB allows one writer), one IngestActor, the SAE workers and the generators. Each
name carries a key of the config parts the actor holds (:func:`actor_keys`): a job with another
store, ingest, SAE or resources never runs on actors built for another config; it gets its own,
except that a store file already held by a StoreActor of other settings is refused with the way
out. A detached actor keeps the code it started with; each reports :func:`actors.code_version`
and one that differs from the caller's is replaced.

Scale-out: ``ray.generators`` replicas of the GeneratorActor (one per GPU or node), which a job
spreads its requests over.

Placement: SAE workers ask for ``ray.sae_worker_resource`` when it is set (e.g. ``sae_gpu``,
offered only by the second box of ray_cluster.yaml); the generator asks for
``ray.generator_num_gpus``.

Before creating anything the actors' requests are checked against the live nodes, and new actors
must answer within ``ray.actor_start_timeout_s``: Ray keeps an unplaceable actor pending forever,
which would turn a config that asks for more than the cluster has into a silent hang.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from engine.config import RaylensConfig
from engine.errors import ActorConfigConflictError, ActorStartError, ClusterCapacityError, ClusterUnreachableError

__all__ = ["Topology", "ActorSpec", "actor_specs", "actor_keys", "actor_roles", "actor_names", "generator_name",
           "check_capacity", "build_topology", "connect", "probe_address"]

log = logging.getLogger("raylens.topology")

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
                          "generators"})


def runs_sae_workers(config: RaylensConfig) -> bool:
    """SAE workers exist for nearline encoding only: with ``sae.mode: inline`` the generator
    encodes every step itself, and idle workers would only hold CPUs (or GPU shares)."""
    return config.sae.enabled and config.sae.mode == "nearline"


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
    return f"{GENERATOR}-{actor_keys(config)[GENERATOR]}-{replica}"


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
    specs += [spec(role, "generator", r.generator_num_cpus, r.generator_num_gpus)
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
            parts: Counter[str] = Counter()
            for s in specs:
                if res in s.resources:
                    parts[s.keys[res]] += s.resources[res]
            detail = ", ".join(f"{k} {v:g}" for k, v in parts.items())
            raise ClusterCapacityError(
                f"the raylens actors ask for {wanted:g} {res} in all ({detail}) but the cluster offers {offered:g}: "
                f"lower those settings (or ray.sae_workers, ray.generators) in the config, or add a node "
                f"(`ray start --address <head>:6379`)", parameter=f"ray.*{res}", value=wanted)


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


def connect(config: RaylensConfig, address: str | None = None) -> None:
    """Join the running cluster (``ray start --head`` or a Ray Job's own) in raylens' namespace.

    An explicit address is probed first with ``ray.connect_timeout_s``: ``ray.init`` retries an
    unreachable one for minutes, where a user wants one line at once.
    """
    if ray.is_initialized():
        return
    target = address or config.ray.address
    probe_address(target, config.ray.connect_timeout_s, what="Ray cluster (GCS)", key="ray.address")
    try:
        ray.init(address=target, namespace=config.ray.namespace, log_to_driver=False, configure_logging=False)
    except ConnectionError as err:
        raise ClusterUnreachableError(
            f"`ray.address` must reach a running Ray cluster, got {target!r} ({_last_error_line(err)}). Start one "
            "with `ray start --head --node-ip-address 127.0.0.1`, or pass --address HOST:PORT",
            parameter="ray.address", value=target) from None


def probe_address(address: str, timeout: float, *, what: str, key: str) -> None:
    """Raise :class:`ClusterUnreachableError` unless ``address`` answers within ``timeout`` seconds.

    ``host:port`` is a GCS, a gRPC server: it must answer an HTTP/2 greeting (a listener that
    accepts and stays silent would hold ``ray.init`` for minutes). An ``http(s)://`` URL is a
    dashboard: its ``/api/version`` must answer. ``auto`` and ``ray://`` are left to Ray, which
    finds or refuses them at once.
    """
    from urllib.parse import urlsplit

    if address in ("auto", "local") or address.startswith("ray://"):
        return
    try:
        if "://" in address:
            _answers_http(address, timeout)
        else:
            parts = urlsplit(f"tcp://{address}")
            if not parts.hostname or not parts.port:
                raise ClusterUnreachableError(f"`{key}` must be HOST:PORT, got {address!r}", parameter=key,
                                              value=address)
            _answers_grpc(parts.hostname, parts.port, timeout)
    except (OSError, ValueError) as err:
        reason = "no answer" if isinstance(err, TimeoutError) else (getattr(err, "strerror", None) or str(err))
        raise ClusterUnreachableError(
            f"`{key}` must reach a running {what}, got {address!r} ({reason}; waited at most {timeout:g}s). Start Ray "
            "(`ray start --head --node-ip-address 127.0.0.1`) or pass the right --address",
            parameter=key, value=address) from None


_HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS


def _answers_grpc(host: str, port: int, timeout: float) -> None:
    """A gRPC server answers the HTTP/2 client greeting with a SETTINGS frame (type 4) at once."""
    import os
    import socket

    with socket.create_connection((host, port), timeout=timeout) as sock:
        if os.environ.get("RAY_USE_TLS", "0") not in ("0", ""):
            return  # a TLS GCS does not speak cleartext HTTP/2; the connection is all we can check
        sock.settimeout(timeout)
        sock.sendall(_HTTP2_GREETING)
        header = sock.recv(9)
    if len(header) < 4 or header[3] != 0x04:
        raise ValueError("not a Ray GCS: no HTTP/2 answer")


def _answers_http(url: str, timeout: float) -> None:
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/api/version", timeout=timeout)  # any answer will do (auth may refuse it)
    except httpx.TimeoutException:
        raise TimeoutError from None
    except httpx.HTTPError as err:
        raise OSError(str(err) or type(err).__name__) from None


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
        ray.kill(handle, no_restart=True)
    return cls.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
                       **options).remote(*args)


def _check_store_owner(config: RaylensConfig, name: str) -> None:
    """A DuckDB file has one writer: refuse, with the way out, when a StoreActor built from other
    ``activations`` settings already holds this config's store file."""
    namespace = config.ray.namespace
    wanted = str(Path(config.activations.db_path).resolve())
    for entry in ray.util.list_named_actors(all_namespaces=True):
        other = entry["name"]
        if entry["namespace"] != namespace or other == name or not other.startswith(f"{STORE}-"):
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
                                   r.call_timeout_s)
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
