"""Requests that were running alone on a generator when its process died, refused for a while.

A generator's death fails every request it was running, with a retryable 503; clients (and the
``openai`` SDK, on its own) retry a 503. When this server had exactly one request running on the
dead generator, that request is the likely cause — a grammar or a mod that crashes native code — and
retrying it would kill the generator again, cutting off everyone else's streams. So its
fingerprint (the request without its id: :func:`fingerprint`) is quarantined for ``ttl_s``: the
request itself still gets the 503 (the server cannot be sure it caused the death), and an
identical request gets a 400 ``QUARANTINED`` without reaching a generator. With several requests
running, none is blamed: their retries run, and the one that crashes the generator again, once it
runs alone, is caught then.

A request sent to a generator already dead (before its death was noticed, or while it restarts)
fails too, without having caused anything. So once a death is noticed the generator counts as
down, a request sent to it is not blamed, and the server first asks a down generator whether it
answers again (:meth:`CrashQuarantine.is_down`, :meth:`CrashQuarantine.answered`).

What this server cannot see: requests of other replicas or Ray Jobs on the same generator, and
why the process died — a generator killed by an operator (``ray kill``, a lost node) while it ran
one request quarantines that request too; its entry ends after ``ttl_s``.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import threading
import time
from typing import Any, Callable

from engine.core.inputs import GenerationRequest
from engine.errors import QuarantinedRequestError

__all__ = ["CrashQuarantine", "fingerprint", "QUARANTINE_S"]

#: how long an identical request is refused after the generator died running it alone
QUARANTINE_S = 600.0
#: fingerprints kept at most (the oldest go first)
CAPACITY = 1024


def fingerprint(request: GenerationRequest) -> str:
    """What makes two requests the same work: every field but the request id (a retry gets a new
    one), as canonical JSON, hashed."""
    fields = {f.name: getattr(request, f.name) for f in dataclasses.fields(request) if f.name != "request_id"}
    text = json.dumps(fields, sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class CrashQuarantine:
    """This server's requests in flight per generator, and the fingerprints quarantined.

    :meth:`begin` a request on a generator before it is sent, :meth:`end` it once its stream ends
    (``lost``: the generator died under it); :meth:`check` refuses a quarantined request."""

    def __init__(self, *, ttl_s: float = QUARANTINE_S, capacity: int = CAPACITY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.capacity, self._clock = ttl_s, capacity, clock
        self._running: dict[str, dict[int, str]] = collections.defaultdict(dict)  # generator -> token -> print
        # the requests a generator was running when its death was first noticed (each one's stream
        # notices on its own thread, one after another): they died together. (not ended yet, how many)
        self._cohorts: list[tuple[set[int], int]] = []
        self._down: set[str] = set()  # generators whose death was noticed, not seen answering since
        self._sent_down: set[int] = set()  # requests sent to a generator that was down
        self._until: collections.OrderedDict[str, float] = collections.OrderedDict()  # print -> expiry
        self._tokens = itertools.count()
        self._lock = threading.Lock()

    def seconds_left(self, request: GenerationRequest) -> float | None:
        """How long ``request`` stays quarantined (None: it is not)."""
        key = fingerprint(request)
        with self._lock:
            until = self._until.get(key)
            if until is not None and until <= self._clock():
                del self._until[key]
                until = None
            return None if until is None else until - self._clock()

    def check(self, request: GenerationRequest) -> None:
        """Raise :class:`QuarantinedRequestError` if ``request`` is quarantined."""
        seconds = self.seconds_left(request)
        if seconds is not None:
            left = max(1, round(seconds))
            raise QuarantinedRequestError(
                "this request must differ from one that was running alone on a generator when its process died, "
                f"got the same request again; it is refused for {left} more s instead of being run (and crashing "
                "the generator) again. Change it (a grammar, a mod, the prompt), or ask the operator",
                parameter=None, value=fingerprint(request))

    def begin(self, generator: Any, request: GenerationRequest) -> tuple[str, int]:
        """Record ``request`` as running on ``generator`` (an actor handle); the token for :meth:`end`."""
        token, key = next(self._tokens), _generator_key(generator)
        with self._lock:
            self._running[key][token] = fingerprint(request)
            if key in self._down:
                self._sent_down.add(token)
        return key, token

    def is_down(self, generator: Any) -> bool:
        """A death of ``generator`` was noticed and it has not answered since."""
        with self._lock:
            return _generator_key(generator) in self._down

    def answered(self, generator: Any) -> None:
        """``generator`` answered a call: it runs (again)."""
        with self._lock:
            self._down.discard(_generator_key(generator))

    def end(self, running: tuple[str, int], *, lost: bool) -> bool:
        """The request's stream ended; ``lost``: its generator died under it. True when it was then
        the only request this server had on that generator, and is now quarantined."""
        generator, token = running
        with self._lock:
            peers = self._running.get(generator, {})
            cohort = next((c for c in self._cohorts if token in c[0]), None)
            if lost and cohort is None:
                cohort = (set(peers), len(peers))  # the first to notice: everyone running then died with it
                self._cohorts.append(cohort)
            key = peers.pop(token, None)
            if not peers:
                self._running.pop(generator, None)
            sent_down = token in self._sent_down
            self._sent_down.discard(token)
            if lost:
                self._down.add(generator)
            alone = lost and not sent_down and key is not None and cohort is not None and cohort[1] == 1
            if cohort is not None:
                cohort[0].discard(token)
                if not cohort[0]:
                    self._cohorts.remove(cohort)
            if alone:
                self._until[key] = self._clock() + self.ttl_s  # type: ignore[index]
                self._until.move_to_end(key)  # type: ignore[arg-type]
                while len(self._until) > self.capacity:
                    self._until.popitem(last=False)
        return alone

    @property
    def quarantined(self) -> int:
        """Fingerprints refused now."""
        with self._lock:
            now = self._clock()
            return sum(1 for until in self._until.values() if until > now)


def _generator_key(generator: Any) -> str:
    actor_id = getattr(generator, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else str(id(generator))
