"""The scheduler's KV manager: each request's block table over the paged cache, its block
reservation, the prefix cache's two doors — :meth:`KVManager.lookup` (reuse the longest cached
prefix) and the registration of every block a forward fills (:meth:`KVManager.record`) — and
eviction. It holds block ids only: the keys and values are the model runner's tensors
(:class:`~engine.model.kv_cache.PagedKVCache`), and what this decides for them — the pool's size
and the block copies of a copy-on-write — reaches the runner as data in each step's
:class:`~engine.model.backend.ForwardBatch` (:meth:`take_copies`, :attr:`num_blocks`).

Admission by tokens, not slots: a request reserves the blocks its whole possible sequence needs
(``prompt + max_tokens``, at most ``max_sequence``) and is admitted while the reservations of
every running request fit the pool (:meth:`KVManager.reserve`); a request that outgrows its
reservation (forced tokens, an adjusted prefill) reserves more before it feeds, or waits. Because
the reservations never exceed the pool, every allocation within them succeeds: blocks are taken
from the free list, by growing the pool, or by evicting the least recently used cached block
nobody holds. Reservations count a shared prefix block once per request that holds it, so a hit
saves compute and never makes admission unsafe.

Writes never reach a block someone else reads: a request writing into a block that is shared
(another table holds it) first gets a copy (copy-on-write: the runner copies it before the
forward that writes); writing into a cached block it alone holds drops that block's index entry
instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.core.block_pool import BlockPool
from engine.core.prefix_index import BlockRows, PrefixIndex, block_key, hit_capture
from engine.errors import InvalidRequestError
from engine.model.backend import KVLayout
from engine.model.capture import CapturePlan, RowCapture

__all__ = ["KVManager", "PrefixStats"]

# per position: ({layer: hidden row (d,)}, {layer: attention row (heads, position + 1)})
Rows = tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]


@dataclass
class PrefixStats:
    lookups: int = 0
    prompt_tokens: int = 0  # prompt tokens of every request that looked a prefix up
    hit_tokens: int = 0  # of those, the tokens whose keys/values and internals came from the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Request:
    table: list[int] = field(default_factory=list)  # block ids, position p in table[p // block_size]
    length: int = 0  # positions written
    reserved: int = 0  # blocks reserved
    caching: bool = False  # looked a prefix up: its full blocks are offered to the index
    tokens: list[int] = field(default_factory=list)  # per written position (caching only)
    rows: list[Rows | None] = field(default_factory=list)  # per written position (caching only)
    keys: list[bytes] = field(default_factory=list)  # chained keys of the leading full blocks
    steered_from: int | None = None  # the first position fed under a steer (its KV and all after differ)


class KVManager:
    def __init__(self, layout: KVLayout, *, rows_budget: int | None = None) -> None:
        """``layout``: the runner's pool (block size, blocks now, the most it may grow to);
        ``rows_budget``: bytes the captured rows of cached blocks may take (None: no bound); past
        it the least recently released cached blocks are evicted, and while every cached block is
        held a new one is not indexed."""
        self.layout = layout
        self.rows_budget = rows_budget
        self.block_size = layout.block_size
        self.index = PrefixIndex()
        self.allocator = BlockPool(num_blocks=layout.blocks, max_blocks=layout.max_blocks, grow=lambda n: n,
                                   on_evict=self.index.evict)
        self.stats = PrefixStats()
        self._requests: dict[str, _Request] = {}
        self._reserved = 0  # blocks reserved by every request
        self._copies: list[tuple[int, int, int]] = []  # (source, destination, positions) for the next forward

    @property
    def num_blocks(self) -> int:
        """Blocks the pool must hold for the next forward (it grows by doubling as tables need)."""
        return self.allocator.num_blocks

    def take_copies(self) -> tuple[tuple[int, int, int], ...]:
        """The copy-on-write copies ``(source block, destination block, positions)`` decided since
        the last call; the runner makes them before the forward that writes the copies."""
        copies, self._copies = tuple(self._copies), []
        return copies

    @property
    def capacity_tokens(self) -> int:
        """Positions the whole pool can hold at its largest (what no single request may exceed)."""
        return self.allocator.usable * self.block_size

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---------------------------------------------------------------------------- requests

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str) -> None:
        self._requests[request_id] = _Request()

    def remove(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._reserved -= request.reserved
            for block in reversed(request.table):  # a prefix's tail is evicted before its head,
                self.allocator.release(block)     # whose loss would strand every block after it

    def clear(self) -> None:
        for request_id in list(self._requests):
            self.remove(request_id)

    def table(self, request_id: str) -> list[int]:
        return self._requests[request_id].table

    def length(self, request_id: str) -> int:
        return self._requests[request_id].length

    def reserve(self, request_id: str, tokens: int) -> bool:
        """Reserve blocks for ``tokens`` positions (never fewer than already reserved); False when
        the reservations of every request would exceed the pool (the caller waits)."""
        request = self._requests[request_id]
        need = self._blocks(tokens)
        if need <= request.reserved:
            return True
        if self._reserved - request.reserved + need > self.allocator.usable:
            return False
        self._reserved += need - request.reserved
        request.reserved = need
        return True

    # ----------------------------------------------------------------------- prefix cache

    def lookup(self, request_id: str, prompt: Sequence[int], plan: CapturePlan) -> tuple[int, RowCapture] | None:
        """Reuse the longest cached prefix of ``prompt`` (whole blocks, leaving at least one token
        to feed) whose captured rows cover ``plan``; the request's table starts with those blocks.
        Returns the reused length and the internals a forward of it would have captured. From
        here on the request's own full blocks are offered to the index."""
        request = self._requests[request_id]
        assert request.length == 0, "a prefix is looked up before the first forward"
        request.caching = True
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(prompt)
        hits = self.index.lookup(prompt, self.block_size, (len(prompt) - 1) // self.block_size, plan)
        if not hits:
            return None
        n = len(hits) * self.block_size
        for entry in hits:
            self.allocator.retain(entry.block)
        request.table = [e.block for e in hits]
        request.keys = [e.key for e in hits]
        request.length, request.tokens, request.rows = n, list(prompt[:n]), [None] * n
        self.stats.hit_tokens += n
        return n, hit_capture(hits, plan)

    # --------------------------------------------------------------------------- forwards

    def prepare(self, request_id: str, start: int, n: int) -> list[int]:
        """Before a forward feeding ``n`` tokens at ``start``: positions from ``start`` on are
        forgotten (a position move back frees the blocks wholly past it), the block ``start``
        falls in is made writable, and blocks are allocated up to ``start + n``. Returns the table."""
        request = self._requests[request_id]
        bs, allocator = self.block_size, self.allocator
        if start > request.length:
            raise InvalidRequestError(f"`start` must be <= the {request.length} positions written for "
                                      f"{request_id!r}, got {start}; feed positions in order", parameter="start",
                                      value=start)
        if start < request.length:
            keep = self._blocks(start)
            for block in reversed(request.table[keep:]):
                allocator.release(block)
            del request.table[keep:], request.keys[start // bs:], request.tokens[start:], request.rows[start:]
            request.length = start
            if request.steered_from is not None and request.steered_from >= start:
                request.steered_from = None
        if start % bs and start // bs < len(request.table):
            i = start // bs
            block = request.table[i]
            if allocator.refs[block] > 1:  # another table reads it: write into a copy
                copy = allocator.allocate()
                self._copies.append((block, copy, start % bs))  # made before the forward writes into it
                allocator.release(block)
                request.table[i] = copy
            elif allocator.is_shared(block):  # cached, held by this request alone
                allocator.uncache(block)
        while len(request.table) < self._blocks(start + n):
            request.table.append(allocator.allocate())
        return request.table

    def record(self, request_id: str, start: int, tokens: Sequence[int], captured: RowCapture | None,
               steered: bool) -> None:
        """After the forward :meth:`prepare` set up: the positions are written; every block this
        filled is offered to the prefix index, with the rows ``captured`` holds for its tokens."""
        request = self._requests[request_id]
        q = len(tokens)
        request.length = start + q
        if steered:
            request.steered_from = start if request.steered_from is None else min(start, request.steered_from)
        if not request.caching:
            return
        request.tokens.extend(int(t) for t in tokens)
        request.rows.extend(_position_rows(captured, start, q))
        self._register(request)
        # rows still waiting for their block to fill are views of this forward's whole capture
        # (a prompt's attention is (heads, n, n)): keep copies of just them
        for p in range(max(start, len(request.keys) * self.block_size), request.length):
            row = request.rows[p]
            if row is not None:
                request.rows[p] = ({k: t.clone() for k, t in row[0].items()}, {k: t.clone() for k, t in row[1].items()})

    def _register(self, request: _Request) -> None:
        bs = self.block_size
        while len(request.keys) < request.length // bs:
            i = len(request.keys)
            end = (i + 1) * bs
            if request.steered_from is not None and request.steered_from < end:
                return
            rows = request.rows[i * bs:end]
            if any(r is None for r in rows):
                return
            key = block_key(request.keys[-1] if request.keys else None, request.tokens[i * bs:end])
            if self.index.get(key) is None:  # else another block holds this prefix already
                block_rows = _block_rows(rows, end)  # type: ignore[arg-type]
                if not self._room_for(block_rows.nbytes()):
                    return  # every cached block is held: offered again after the next forward
                self.index.put(key, request.table[i], block_rows)
                self.allocator.mark_cached(request.table[i])
            request.keys.append(key)
            request.rows[i * bs:end] = [None] * bs  # the index holds them now

    def _room_for(self, nbytes: int) -> bool:
        """Evict cached blocks nobody holds, least recently released first, until ``nbytes`` more
        rows fit the budget; False when they cannot."""
        if self.rows_budget is None:
            return True
        while self.index.rows_bytes + nbytes > self.rows_budget:
            if not self.allocator.evict_oldest():
                return False
        return True

    # -------------------------------------------------------------------------------- stats

    def as_dict(self) -> dict[str, Any]:
        a = self.allocator
        return {
            "block_size": self.block_size,
            "blocks_total": a.usable,
            "blocks_used": a.held,
            "blocks_free": a.usable - a.held,
            "blocks_cached": a.cached,
            "blocks_reserved": self._reserved,
            "blocks_allocated": a.num_blocks - 1,
            "evictions": a.evictions,
            "prefix_lookups": self.stats.lookups,
            "prompt_tokens": self.stats.prompt_tokens,
            "hit_tokens": self.stats.hit_tokens,
            "hit_rate": self.stats.hit_rate,
            "cached_rows_bytes": self.index.rows_bytes,
            "cached_rows_budget_bytes": self.rows_budget,
            "kv_bytes": a.num_blocks * self.layout.block_bytes,
        }


def _position_rows(captured: RowCapture | None, start: int, q: int) -> list[Rows]:
    """One forward's captured internals split per fed position. An attention layer whose capture
    holds only the newest query row of a multi-token feed gives those positions no row."""
    if captured is None:
        return [({}, {}) for _ in range(q)]
    full = {layer: t for layer, t in captured.attention.items() if t.shape[1] == q}
    return [({layer: t[j] for layer, t in captured.hidden.items()},
             {layer: t[:, j, : start + j + 1] for layer, t in full.items()}) for j in range(q)]


def _block_rows(rows: Sequence[Rows], end: int) -> BlockRows:
    """Stack one block's per-position rows: hidden ``(block_size, d)``, attention
    ``(heads, block_size, end)`` — only the layers every position has."""
    hidden_layers = set.intersection(*(set(h) for h, _ in rows))
    attention_layers = set.intersection(*(set(a) for _, a in rows))
    hidden = {layer: torch.stack([h[layer] for h, _ in rows]) for layer in hidden_layers}
    attention = {layer: torch.stack([torch.nn.functional.pad(a[layer], (0, end - a[layer].shape[-1]))
                                     for _, a in rows], dim=1) for layer in attention_layers}
    return BlockRows(hidden, attention)
