"""The KV block pool's bookkeeping: which blocks are free, held, or cached — reference counts and
the LRU of cached blocks. Only ids: the tensors are the model runner's (:mod:`engine.model.kv_cache`).

A block is in exactly one of three states:

* **free** — on the free list, contents meaningless;
* **held** — ``refs > 0``: in one or more requests' block tables (more than one only for a cached
  prefix block several requests reuse);
* **cached, unreferenced** — ``refs == 0`` but indexed by the prefix cache
  (:mod:`engine.core.prefix_index`): its contents are kept for a later request and it sits in
  an LRU; when the free list runs dry the least recently released one is evicted (its index
  entry dropped through ``on_evict``) and reused.

The pool grows (doubling, through ``grow``) before anything cached is evicted; a static pool
(CUDA graphs hold its addresses) never grows. Block 0 is the scratch block and is never handed
out (:data:`engine.model.kv_cache.SCRATCH_BLOCK`).
"""

from __future__ import annotations

import collections
from typing import Callable

from engine.errors import QueueFullError

__all__ = ["BlockPool"]


class BlockPool:
    def __init__(self, *, num_blocks: int, max_blocks: int, grow: Callable[[int], int],
                 on_evict: Callable[[int], None]) -> None:
        """``num_blocks`` in the pool now (block 0 included), at most ``max_blocks``; ``grow(n)``
        says the pool must hold ``n`` blocks from the next forward on and returns the new count;
        ``on_evict(block)`` drops a cached block's index entry before the block is reused."""
        self.max_blocks = max_blocks
        self._grow, self._on_evict = grow, on_evict
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._cached: set[int] = set()  # blocks the prefix index holds
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached with refs == 0
        self.evictions = 0

    # ----------------------------------------------------------------------------- counting

    @property
    def usable(self) -> int:
        """Blocks requests can ever hold at once (every block but the scratch one, at full size)."""
        return self.max_blocks - 1

    @property
    def free(self) -> int:
        """Blocks an allocation can take now without growing: free, or cached and unreferenced."""
        return len(self._free) + len(self._lru)

    @property
    def held(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    @property
    def cached(self) -> int:
        return len(self._cached)

    # --------------------------------------------------------------------------- operations

    def allocate(self) -> int:
        """A block with ``refs == 1`` for one request's table."""
        if not self._free and self.num_blocks < self.max_blocks:
            self._extend(self._grow(min(self.max_blocks, max(2 * self.num_blocks, 2))))
        if self._free:
            block = self._free.pop()
        elif self._lru:
            block = self._evict_oldest()
        else:
            raise QueueFullError(f"all {self.usable} KV blocks are held by running requests; wait for one to "
                                 f"finish, or raise backend.kv_cache_tokens")
        self.refs[block] = 1
        return block

    def evict_oldest(self) -> bool:
        """Free the least recently released cached block nobody holds (the prefix cache is over
        its rows budget); False when there is none."""
        if not self._lru:
            return False
        self._free.append(self._evict_oldest())
        return True

    def _evict_oldest(self) -> int:
        block, _ = self._lru.popitem(last=False)
        self._cached.discard(block)
        self._on_evict(block)
        self.evictions += 1
        return block

    def retain(self, block: int) -> None:
        """One more table holds ``block`` (a reused prefix block leaves the LRU while held)."""
        if self.refs[block] == 0:
            self._lru.pop(block, None)
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One table lets go of ``block``; at zero it is free, or waits in the LRU when cached."""
        self.refs[block] -= 1
        if self.refs[block] > 0:
            return
        if block in self._cached:
            self._lru[block] = None
            self._lru.move_to_end(block)
        else:
            self._free.append(block)

    def mark_cached(self, block: int) -> None:
        """The prefix index now holds ``block``: its contents must not change (copy-on-write)."""
        self._cached.add(block)

    def uncache(self, block: int) -> None:
        """Drop ``block``'s index entry (its only holder is about to overwrite it)."""
        if block in self._cached:
            self._cached.discard(block)
            self._lru.pop(block, None)
            self._on_evict(block)

    def is_shared(self, block: int) -> bool:
        """Writing into ``block`` would change what someone else reads: copy it first."""
        return self.refs[block] > 1 or block in self._cached

    def _extend(self, num_blocks: int) -> None:
        if num_blocks <= self.num_blocks:
            return
        self.refs += [0] * (num_blocks - self.num_blocks)
        self._free = list(range(num_blocks - 1, self.num_blocks - 1, -1)) + self._free
        self.num_blocks = num_blocks
