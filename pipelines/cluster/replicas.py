"""The generator replicas of one config, as one caller (the server, a job) routes requests over them.

:class:`ReplicaSet` keeps a :class:`~pipelines.cluster.router.Router` up to date from Ray:

* which replicas exist — found by name (every replica of a config is
  ``raylens-generator-<key>-<i>``), so replicas that ``raylens scale`` adds join and removed
  ones leave, whoever created them;
* what each one's prefix cache holds and how loaded it is — every replica's
  ``routing_report(cursor)`` is read at most every ``ray.router_refresh_s`` (one small call per
  replica, in the actor's control group, answered even while every request thread streams);
* which ones are down — a read or a request that finds the actor dead marks it down; Ray restarts
  it (``max_restarts``), and its first answer brings it back, with an empty cache.

Reads are sent and collected while routing (:meth:`candidates`), reading the router's state
(:meth:`stats`) and scraping metrics — never by a thread of its own: a thread outliving its
caller would call Ray after ``ray.shutdown()``, which starts a new local Ray. An answer is applied
only if it continues from the cursor the router holds, so answers are applied once and in order.

Callers ask :meth:`ReplicaSet.candidates` where a request should go, tell :meth:`routed`,
:meth:`finished` and :meth:`died`; the router decides (its docstring has the policy).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable

import ray

from engine.config import RaylensConfig

from .actor_specs import generator_prefix, replica_index
from .ending import listed_names
from .router import RouteRequest, Router, RouterStats

__all__ = ["ReplicaSet", "is_lost_actor"]

log = logging.getLogger("raylens.replicas")

DISCOVERY_S = 1.0  # how often the names of the config's replicas are listed again (one GCS call)


def is_lost_actor(err: BaseException) -> bool:
    """A Ray actor died or became unreachable (its requests can go elsewhere)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(err, (RayActorError, ActorUnavailableError))


class ReplicaSet:
    """The config's generator replicas and the router over them; :meth:`start` begins the reads."""

    def __init__(self, config: RaylensConfig, handles: dict[str, Any] | None = None) -> None:
        r = config.ray
        self.config = config
        self.router = Router(r.router, queue_bound=r.router_queue_bound or r.generator_max_concurrency)
        self._handles: dict[str, Any] = dict(handles or {})
        self._lock = threading.RLock()
        # replica -> (its outstanding read, when sent, the cursor it asked from)
        self._reads: dict[str, tuple[Any, float, Any]] = {}
        self._sent_at: dict[str, float] = {}
        self._discovered_at = float("-inf")
        self.reruns = 0  # requests re-run elsewhere after their replica died before their first token
        self.router.update_replicas(list(self._handles))

    # -------------------------------------------------------------------------------- set

    def start(self) -> "ReplicaSet":
        """Discover the replicas and read each once (waiting at most ``ray.call_timeout_s``)."""
        self.discover()
        self.refresh(wait_s=self.config.ray.call_timeout_s)
        return self

    def close(self) -> None:
        """Forget the outstanding reads (nothing runs in the background)."""
        with self._lock:
            self._reads.clear()

    def discover(self, *, fresh: bool = False) -> None:
        """The config's replicas running now, by name. A replica that is down is looked up again
        (``fresh``: every one), since a new actor may have taken its name."""
        namespace, prefix = self.config.ray.namespace, generator_prefix(self.config)
        names = {name for name in listed_names(namespace) if name.startswith(prefix)}
        with self._lock:
            down = {name for name, status in self.router.stats().replicas.items() if not status.up}
        found = {}
        for name in names:
            handle = None if fresh or name in down else self._handles.get(name)
            if handle is None:
                try:
                    handle = ray.get_actor(name, namespace=namespace)
                except ValueError:  # ended since it was listed
                    continue
            found[name] = handle
        with self._lock:
            for name, handle in found.items():
                old = self._handles.get(name)
                if old is not None and old._actor_id != handle._actor_id:  # another actor under the name
                    self.router.on_replica_actor_died(name)
                    self._reads.pop(name, None)
            self._handles = found
            self.router.update_replicas(sorted(found, key=self._order))
            for gone in set(self._reads) - set(found):
                del self._reads[gone]
            self._discovered_at = time.monotonic()

    def _order(self, name: str) -> int:
        index = replica_index(self.config, name)
        return index if index is not None else 1 << 30

    def label(self, name: str) -> str:
        """A replica's label in metrics: its index (``0``, ``1``, …)."""
        index = replica_index(self.config, name)
        return str(index) if index is not None else name

    @property
    def handles(self) -> dict[str, Any]:
        """Replica name -> actor handle, in replica order."""
        with self._lock:
            return {name: self._handles[name] for name in sorted(self._handles, key=self._order)}

    # ------------------------------------------------------------------------------- reads

    def poll(self) -> None:
        """Take the answers that arrived and send the reads that are due, without waiting."""
        try:
            self.refresh(wait_s=0.0)
        except Exception:  # a failed round must not fail the request it runs in; the next one tries again
            log.exception("reading the generator replicas failed")

    def refresh(self, *, wait_s: float) -> None:
        """One round: send a read to every replica without one outstanding whose last read is at
        least ``ray.router_refresh_s`` old (every one, when ``wait_s`` > 0), then apply the
        answers that arrive within ``wait_s`` (a restarting replica's read waits for its restart)."""
        now = time.monotonic()
        if now - self._discovered_at > DISCOVERY_S:
            self.discover()
        due = 0.0 if wait_s > 0 else self.config.ray.router_refresh_s
        with self._lock:
            for name, handle in self._handles.items():
                if name not in self._reads and now - self._sent_at.get(name, float("-inf")) >= due:
                    cursor = self.router.cursor(name)
                    self._reads[name] = (handle.routing_report.remote(cursor), now, cursor)
                    self._sent_at[name] = now
            refs = [ref for ref, _, _ in self._reads.values()]
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        done = set(ready)
        with self._lock:  # applied under the lock: once, in order, from the cursor they asked from
            for name, (ref, sent_at, cursor) in list(self._reads.items()):
                if ref in done:
                    del self._reads[name]
                    self._apply(name, ref, sent_at, cursor)

    def _apply(self, name: str, ref: Any, sent_at: float, cursor: Any) -> None:
        try:
            report = ray.get(ref, timeout=0)
        except Exception as err:
            if is_lost_actor(err):
                self.router.on_replica_actor_died(name)
            else:
                log.warning("replica %s: its report failed: %s", name, err)
            return
        if self.router.cursor(name) == cursor:  # else the view moved on (a death, another read): read again
            self.router.on_cache_events(name, report.cache, read_at=sent_at, load=report.load,
                                        draining=report.draining)

    # ----------------------------------------------------------------------------- routing

    def candidates(self, request: RouteRequest, exclude: Iterable[str] = ()) -> list[tuple[str, Any]]:
        """(name, handle) of the replicas to try for ``request``, best first."""
        skip = set(exclude)
        self.poll()
        with self._lock:
            ranked = self.router.choose_replicas(None, request)
            return [(group[0], self._handles[group[0]]) for group in ranked
                    if group[0] not in skip and group[0] in self._handles]

    def routed(self, request: RouteRequest, name: str) -> None:
        with self._lock:
            self.router.on_request_routed(request, name)

    def finished(self, request: RouteRequest, name: str, *, lost: bool = False) -> None:
        with self._lock:
            self.router.on_request_finished(request, name, at=time.monotonic(), lost=lost)

    def died(self, name: str) -> None:
        with self._lock:
            self.router.on_replica_actor_died(name)

    def draining(self, name: str) -> None:
        with self._lock:
            self.router.set_draining(name)

    def rerun(self) -> None:
        with self._lock:
            self.reruns += 1

    def stats(self) -> RouterStats:
        self.poll()
        with self._lock:
            return self.router.stats()

    # ----------------------------------------------------------------------------- metrics

    def metrics(self, timeout: float) -> dict[str, Any]:
        """Each replica's :class:`~engine.engine_metrics.EngineMetrics` by label (None for one that
        did not answer within ``timeout``: it is down or restarting)."""
        self.poll()
        handles = self.handles
        refs = {name: handle.metrics.remote() for name, handle in handles.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        done, out = set(ready), {}
        for name, ref in refs.items():
            try:
                out[self.label(name)] = ray.get(ref, timeout=0) if ref in done else None
            except Exception:
                out[self.label(name)] = None
        return out
