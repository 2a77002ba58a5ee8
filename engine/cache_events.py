"""What a replica's prefix cache holds, as a stream of events a router can follow.

A cache-aware router must know which prompt prefixes each replica has cached; guessing from what
it sent there goes wrong as soon as a replica evicts, restarts or is shared with another router.
So the prefix index reports every block it indexes (:class:`BlockStored`) and every block it
forgets (:class:`BlockRemoved`), keyed by the block's chained hash
(:func:`engine.core.prefix_index.block_key`: equal keys mean equal token prefixes). A router
computes the same keys over a request's prompt (:func:`leading_block_keys`) and looks them up.
The names follow vLLM's KV-cache events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``).

:class:`CacheEventLog` keeps the recent events in a bounded ring, numbered from a random epoch.
A reader passes back the :class:`CacheCursor` of its last answer and gets what happened since.
A reader whose cursor is from another epoch (the replica restarted, or it never asked) or older
than the ring gets a resync instead: :class:`AllBlocksCleared`, then a :class:`BlockStored` for
every block cached now. Either way, applying the answer in order leaves the reader with exactly
the replica's cached set.
"""

from __future__ import annotations

import collections
import threading
import uuid
from dataclasses import dataclass
from typing import Sequence, Union

from engine.core.prefix_index import block_key

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "CacheEvent", "CacheCursor", "CacheEvents",
           "CacheEventLog", "leading_block_keys", "apply_events"]


@dataclass(frozen=True)
class BlockStored:
    """The prefix index now holds a block whose chained key is ``key`` (16 bytes)."""

    key: bytes


@dataclass(frozen=True)
class BlockRemoved:
    """The prefix index forgot the block ``key`` (evicted, or overwritten by its only holder)."""

    key: bytes


@dataclass(frozen=True)
class AllBlocksCleared:
    """Forget every block known so far: what follows is the whole cached set (a resync)."""


CacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class CacheCursor:
    """Where a reader stands in one log: ``epoch`` names the log (a new one per process), ``seq``
    the number of events it has seen."""

    epoch: str
    seq: int


@dataclass(frozen=True)
class CacheEvents:
    """One answer of :meth:`CacheEventLog.since`: ``events`` in order, the ``cursor`` to ask with
    next, and the ``block_size`` (tokens per block) the keys were computed with. ``resync``: the
    events start with :class:`AllBlocksCleared` and list the whole cached set."""

    cursor: CacheCursor
    events: tuple[CacheEvent, ...]
    block_size: int
    resync: bool = False


class CacheEventLog:
    """A bounded, thread-safe log of one prefix index's changes (the index calls :meth:`stored`
    and :meth:`removed`; readers call :meth:`since`). It also keeps the set of keys cached now,
    so a resync needs nothing from the index."""

    def __init__(self, block_size: int, *, capacity: int = 65536) -> None:
        self.block_size = block_size
        self.epoch = uuid.uuid4().hex
        self._ring: collections.deque[CacheEvent] = collections.deque(maxlen=capacity)
        self._seq = 0  # events ever logged; the ring holds the last len(self._ring) of them
        self._cached: dict[bytes, None] = {}  # insertion-ordered: a resync lists oldest first
        self._lock = threading.Lock()

    def stored(self, key: bytes) -> None:
        with self._lock:
            self._cached[key] = None
            self._ring.append(BlockStored(key))
            self._seq += 1

    def removed(self, key: bytes) -> None:
        with self._lock:
            self._cached.pop(key, None)
            self._ring.append(BlockRemoved(key))
            self._seq += 1

    def __len__(self) -> int:
        """Blocks cached now."""
        with self._lock:
            return len(self._cached)

    def since(self, cursor: CacheCursor | None) -> CacheEvents:
        """The events after ``cursor``, or a resync when the ring no longer holds them all."""
        with self._lock:
            now = CacheCursor(self.epoch, self._seq)
            oldest = self._seq - len(self._ring)
            if cursor is not None and cursor.epoch == self.epoch and oldest <= cursor.seq <= self._seq:
                events = tuple(self._ring)[len(self._ring) - (self._seq - cursor.seq):]
                return CacheEvents(now, events, self.block_size)
            snapshot = (AllBlocksCleared(),) + tuple(BlockStored(key) for key in self._cached)
            return CacheEvents(now, snapshot, self.block_size, resync=True)


def apply_events(cached: set[bytes], events: Sequence[CacheEvent]) -> None:
    """Apply ``events`` in order to a reader's copy of the cached set."""
    for event in events:
        if isinstance(event, BlockStored):
            cached.add(event.key)
        elif isinstance(event, BlockRemoved):
            cached.discard(event.key)
        else:
            cached.clear()


def leading_block_keys(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained keys of the prompt's full blocks that a prefix-cache lookup may reuse: every
    full block but one that would leave no token to feed, as the KV manager looks them up."""
    keys: list[bytes] = []
    parent: bytes | None = None
    for i in range(max(0, (len(token_ids) - 1) // block_size)):
        parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys
