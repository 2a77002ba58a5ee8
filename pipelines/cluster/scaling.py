"""``raylens scale N``: add or remove generator replicas of a running config without dropping a request.

Adding is getting the config's actors with ``ray.generators: N`` (get or create: the replicas that
run are kept, the missing ones start and load their model). Removing takes the highest-numbered
replicas away one by one, each drained first:

1. ``start_draining()``: from now on the replica refuses new requests with
   :class:`~engine.errors.ReplicaDrainingError`, which every router (the server's, a job's) takes
   as "send it elsewhere" — a request refused there never started, so nothing is lost;
2. wait until the requests running there have finished (its ``in_flight`` count is 0), at most
   ``ray.call_timeout_s`` — past that the replica is left running and draining, and the command
   says so, rather than cut requests off;
3. ``drain()``: its SAE blocks and store/ingest calls settle;
4. the actor is ended (``no_restart``), and the command waits (at most ``ray.call_timeout_s``)
   until Ray no longer lists its name (:func:`~pipelines.cluster.ending.end_named_actors`): the
   replica set it reports, and the routers see at their next look, no longer holds it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import ray

from engine.config import RaylensConfig
from engine.errors import ConfigError

from .actor_specs import replica_index
from .ending import end_named_actors, listed_names
from .topology import build_topology

__all__ = ["scale", "running_replicas"]


def running_replicas(config: RaylensConfig) -> dict[int, str]:
    """Replica index -> actor name, for the config's generator replicas alive now."""
    found = {}
    for name in listed_names(config.ray.namespace):
        index = replica_index(config, name)
        if index is not None:
            found[index] = name
    return dict(sorted(found.items()))


def scale(config: RaylensConfig, replicas: int, *, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Make ``replicas`` of the config's generators run (the cluster must be connected)."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
        raise ConfigError(f"`replicas` must be an integer >= 1, got {replicas!r}; use `raylens stop` to end them all",
                          parameter="replicas", value=replicas)
    before = running_replicas(config)
    wanted = dataclasses.replace(config, ray=dataclasses.replace(config.ray, generators=replicas))
    added = [i for i in range(replicas) if i not in before]
    if added:
        progress(f"starting replica(s) {added} (each loads the model)…")
        build_topology(wanted)
    removed, still_draining = [], []
    for index in sorted((i for i in before if i >= replicas), reverse=True):
        name = before[index]
        progress(f"draining replica {index} ({name})…")
        if _drain_and_end(config, name):
            removed.append(index)
        else:
            still_draining.append(index)
    return {"replicas": sorted(running_replicas(config)), "added": added, "removed": removed,
            "still_draining": still_draining}


def _drain_and_end(config: RaylensConfig, name: str) -> bool:
    """Drain replica ``name`` and end it; False when its requests did not finish in time."""
    timeout = config.ray.call_timeout_s
    try:
        actor = ray.get_actor(name, namespace=config.ray.namespace)
    except ValueError:  # ended meanwhile
        return True
    ray.get(actor.start_draining.remote(), timeout=timeout)
    deadline = time.monotonic() + timeout
    while ray.get(actor.stats.remote(), timeout=timeout)["in_flight"] > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    ray.get(actor.drain.remote(), timeout=timeout * 4)
    # past the deadline the report lists the replica as still running, which is what Ray says
    end_named_actors(config.ray.namespace, [name], timeout_s=timeout)
    return True
