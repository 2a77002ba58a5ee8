"""Which generator replica runs a request: the routing policy alone (no Ray, no clock of its own).

``affinity`` (the default) sends a request to the replica most likely to hold its prefix: the
longest run of its leading block hashes (:func:`engine.cache_events.leading_block_keys`, the
chain the KV manager caches blocks under) found in what each replica reported it cached, with
load breaking ties. ``round_robin`` takes turns. Under either:

* a replica with ``queue_bound`` requests in flight is skipped while another has room (it is
  ranked last, not dropped: when every replica is full the least loaded still gets the request,
  and the replica's own queue decides);
* requests of one ``group`` (the ``n`` choices of one OpenAI request) stay on the replica the
  first of them went to, while it is up;
* a replica that died or is draining (``raylens scale`` is removing it) gets nothing until it
  reports again.

What a replica caches comes from its own cache events (``on_cache_events``), never from guessing;
the router only adds what it itself sent and has not yet seen reported: the keys of requests
routed to a replica count for it until an event read that started after they finished (the blocks
of a prompt are stored before its first token, so that read has them, or their eviction).

The interface follows Ray Serve's request router (``ray.serve.request_router.RequestRouter``):
``update_replicas``, ``choose_replicas(candidate_replicas, pending_request)`` returning ranked
groups, ``on_request_routed`` and ``on_replica_actor_died``. The generators stay plain actors
(the README's "More than one GPU" says why); a Serve deployment of them would wrap this class in a
``RequestRouter`` subclass, its replica ids the Serve replica ids.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Literal, Sequence

from engine.cache_events import CacheEvents, apply_events

__all__ = ["RouteRequest", "Router", "RouterStats", "ReplicaStatus", "Policy"]

Policy = Literal["affinity", "round_robin"]


@dataclass(frozen=True)
class RouteRequest:
    """What routing reads of a request (Serve's ``PendingRequest``): its id, the chained hashes of
    its prompt's leading blocks, and the group whose requests share one replica (None: alone)."""

    request_id: str
    block_keys: tuple[bytes, ...] = ()
    group: str | None = None


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica as the router sees it (for ``/metrics`` and ``raylens status``)."""

    up: bool
    draining: bool
    load: int
    cached_blocks: int


@dataclass(frozen=True)
class RouterStats:
    """Decisions by (replica, reason) — ``prefix`` (its cache held the request's leading block),
    ``load`` (none did: least loaded), ``round_robin``, ``group`` (a choice following its group) —
    times a replica was skipped for its queue bound, and every replica's status."""

    policy: Policy
    decisions: dict[tuple[str, str], int]
    skipped: dict[str, int]
    replicas: dict[str, ReplicaStatus]


@dataclass
class _Claim:
    keys: tuple[bytes, ...]
    finished_at: float | None = None


@dataclass
class _View:
    up: bool = True
    draining: bool = False
    reported_load: int = 0
    inflight: int = 0  # requests this router routed here that have not finished
    cached: set[bytes] = field(default_factory=set)
    cursor: object | None = None
    claims: dict[str, _Claim] = field(default_factory=dict)
    claimed: collections.Counter = field(default_factory=collections.Counter)  # key -> claims holding it

    @property
    def load(self) -> int:
        """Requests in flight there: what it reported (every router's), or what this router sent
        since, whichever is more."""
        return max(self.reported_load, self.inflight)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, it holds (reported, or sent and not yet reported)."""
        n = 0
        for key in keys:
            if key not in self.cached and not self.claimed[key]:
                break
            n += 1
        return n

    def drop_claim(self, request_id: str) -> None:
        claim = self.claims.pop(request_id, None)
        if claim is not None:
            self.claimed.subtract(claim.keys)


class Router:
    """The routing state of one caller (the server, a job): per replica its reported cache and
    load, what this caller sent there, and the groups in flight. Not thread-safe: the caller
    serialises calls (:class:`pipelines.cluster.replicas.ReplicaSet` holds a lock)."""

    def __init__(self, policy: Policy = "affinity", *, queue_bound: int) -> None:
        if policy not in ("affinity", "round_robin"):
            raise ValueError(f"`policy` must be affinity or round_robin, got {policy!r}")
        self.policy: Policy = policy
        self.queue_bound = queue_bound
        self._views: dict[str, _View] = {}
        self._groups: dict[str, tuple[str, int]] = {}  # group -> (replica, requests in flight)
        self._turn = 0  # rotates among equal candidates, and the round-robin order
        self._decisions: collections.Counter = collections.Counter()
        self._skipped: collections.Counter = collections.Counter()

    # ----------------------------------------------------------------------------- replicas

    def update_replicas(self, replica_ids: Sequence[str]) -> None:
        """The replicas that exist now: new ones join (up, nothing cached), gone ones leave."""
        for gone in set(self._views) - set(replica_ids):
            del self._views[gone]
        for rid in replica_ids:
            self._views.setdefault(rid, _View())

    def on_replica_actor_died(self, replica_id: str) -> None:
        """Down until its next report; its process, and so its cache, is gone."""
        view = self._views.get(replica_id)
        if view is not None:
            view.up, view.cached, view.cursor = False, set(), None
            for request_id in list(view.claims):
                view.drop_claim(request_id)

    def on_cache_events(self, replica_id: str, answer: CacheEvents, *, read_at: float, load: int,
                        draining: bool = False) -> None:
        """A replica's report: its cache events since the last (applied in order), its load, and
        whether it is draining. ``read_at``: when the read was sent; claims of requests that
        finished before it are now covered by the events, and dropped."""
        view = self._views.get(replica_id)
        if view is None:
            return
        apply_events(view.cached, answer.events)
        view.cursor, view.up, view.reported_load, view.draining = answer.cursor, True, load, draining
        for request_id, claim in list(view.claims.items()):
            if claim.finished_at is not None and claim.finished_at < read_at:
                view.drop_claim(request_id)

    def set_draining(self, replica_id: str) -> None:
        view = self._views.get(replica_id)
        if view is not None:
            view.draining = True

    def cursor(self, replica_id: str) -> object | None:
        view = self._views.get(replica_id)
        return view.cursor if view is not None else None

    # ------------------------------------------------------------------------------ routing

    def choose_replicas(self, candidate_replicas: Sequence[str] | None,
                        pending_request: RouteRequest) -> list[list[str]]:
        """Replicas to try, best first, one per group (Serve's ranked groups); empty when none is
        up. ``candidate_replicas`` None means every replica."""
        ids = list(self._views) if candidate_replicas is None else [r for r in candidate_replicas if r in self._views]
        usable = [r for r in ids if self._views[r].up and not self._views[r].draining]
        if not usable:
            return []
        pinned = self._groups.get(pending_request.group or "")
        room = [r for r in usable if self._views[r].load < self.queue_bound]
        full = sorted((r for r in usable if r not in room), key=lambda r: self._views[r].load)
        if room and full:
            for r in full:
                self._skipped[r] += 1
        n = len(room)
        order = {r: (i - self._turn) % n for i, r in enumerate(room)} if n else {}
        if self.policy == "round_robin":
            ranked = sorted(room, key=order.__getitem__)
        else:
            keys = pending_request.block_keys
            ranked = sorted(room, key=lambda r: (-self._views[r].match(keys), self._views[r].load, order[r]))
        ranked += full
        if pinned is not None and pinned[0] in usable:
            ranked.remove(pinned[0])
            ranked.insert(0, pinned[0])
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: RouteRequest, replica_id: str) -> None:
        """The request went to ``replica_id``: count it there, claim its keys, pin its group."""
        view = self._views.get(replica_id)
        if view is None:
            return
        group = pending_request.group
        if group is not None and group in self._groups and self._groups[group][0] == replica_id:
            reason = "group"
        elif self.policy == "round_robin":
            reason = "round_robin"
        else:
            reason = "prefix" if view.match(pending_request.block_keys) else "load"
        self._decisions[(replica_id, reason)] += 1
        if reason in ("load", "round_robin"):
            self._turn += 1  # the next tie (or turn) goes to the next replica
        view.inflight += 1
        view.drop_claim(pending_request.request_id)
        view.claims[pending_request.request_id] = _Claim(tuple(pending_request.block_keys))
        view.claimed.update(pending_request.block_keys)
        if group is not None:
            replica, count = self._groups.get(group, (replica_id, 0))
            self._groups[group] = (replica, count + 1)

    def on_request_finished(self, pending_request: RouteRequest, replica_id: str, *, at: float,
                            lost: bool = False) -> None:
        """The request ended there at ``at`` (``lost``: its replica died under it; nothing of it is
        cached there)."""
        view = self._views.get(replica_id)
        if view is not None:
            view.inflight = max(0, view.inflight - 1)
            claim = view.claims.get(pending_request.request_id)
            if claim is not None:
                if lost:
                    view.drop_claim(pending_request.request_id)
                else:
                    claim.finished_at = at
        group = pending_request.group
        if group is not None and group in self._groups:
            replica, count = self._groups[group]
            if count <= 1:
                del self._groups[group]
            else:
                self._groups[group] = (replica, count - 1)

    def stats(self) -> RouterStats:
        return RouterStats(self.policy, dict(self._decisions), dict(self._skipped),
                           {r: ReplicaStatus(v.up, v.draining, v.load, len(v.cached)) for r, v in self._views.items()})
