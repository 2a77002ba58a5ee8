"""The rows' keys and values a CPU forward's attention reads, kept gathered from one forward to the
next.

Without a paged kernel, every layer of every forward gathers each row's keys and values, positions
``0 … kv_len-1``, out of the paged pool (:class:`~engine.model.kv_cache.BatchCacheView`): a copy of
the whole context, every step (on the embedded model at 32 concurrent requests, ~10 % of a decode
step). Between two decode steps of the same batch only each row's newest position changes, so
:class:`GatheredRows` keeps the last forward's gathered rows, ``(rows, positions, kv_heads,
head_dim)`` per layer, and copies again only the positions whose slot changed (a row that joined,
moved or went back) or was written by this forward.

What it keeps is exactly the pool's contents: after each forward, every kept position holds what
its slot holds. That stays true from one forward to the next because the pool changes only by a
forward's writes (each copied again in that same forward, after the layer wrote them), by a
copy-on-write of a block (:attr:`PagedKVCache.version` moves: everything is copied again), or by a
forward that does not go through this (a static decode, a paged kernel, a forward that failed half
way), after which the runner calls :meth:`GatheredRows.forget`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.kv_cache import PagedKVCache

__all__ = ["GatheredRows", "Refresh", "GATHERED_MAX_BYTES", "GATHERED_MIN_BYTES"]

#: The most memory the kept rows may take (every layer's keys and values); a forward whose rows
#: would need more gathers them afresh, as if nothing were kept.
GATHERED_MAX_BYTES = 1 << 30
#: A forward whose whole gather is smaller than this gathers afresh: deciding what to copy again
#: costs a few tenths of a millisecond a forward on a 2-core VM, more than a small gather (the
#: host-overhead bench's 2-layer model at 64 requests, 2.6 MB a forward, ran 3.5 % slower keeping
#: its rows; the embedded model at 32 requests, ~150 MB a forward, 4.5 % faster).
GATHERED_MIN_BYTES = 16 << 20
#: Kept positions grow in steps of this many (a forward reads one more each decode step).
_POSITIONS_STEP = 64


@dataclass(frozen=True)
class Refresh:
    """Which kept positions one forward copies again from the pool: all of them (``every``), or
    those at flat index ``kept`` (``row * positions kept a row + position``), whose slots are
    ``slots``."""

    every: bool
    kept: torch.Tensor | None = None
    slots: torch.Tensor | None = None


class GatheredRows:
    """Keeps the gathered keys and values of the last forward's rows (see the module docstring)."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.keys: list[torch.Tensor] = []  # per layer (rows, positions, kv_heads, head_dim)
        self.values: list[torch.Tensor] = []
        self._slots: torch.Tensor | None = None  # (B, kv_len): the slot each kept position was copied from
        self._version = -1  # the pool's version then

    def forget(self) -> None:
        """The pool may have changed other than by a forward through here: copy everything again."""
        self._slots = None

    def refresh(self, read_index: torch.Tensor, positions: torch.Tensor) -> Refresh | None:
        """What a forward reading ``read_index (B, kv_len)`` and writing each row's ``positions (B,
        q)`` copies again (None: its whole gather is under :data:`GATHERED_MIN_BYTES`, or its rows
        would take more than :data:`GATHERED_MAX_BYTES`; gather them afresh). Called once a
        forward, before its first layer reads."""
        rows, length = read_index.shape
        if self._nbytes(rows, length) < GATHERED_MIN_BYTES or not self._fit(rows, length):
            self.forget()
            return None
        last, last_version = self._slots, self._version
        self._slots, self._version = read_index, self.cache.version
        if last is None or last_version != self.cache.version:
            return Refresh(every=True)
        changed = torch.ones(rows, length, dtype=torch.bool, device=read_index.device)
        kept_rows, kept = min(rows, last.shape[0]), min(length, last.shape[1])
        changed[:kept_rows, :kept] = read_index[:kept_rows, :kept] != last[:kept_rows, :kept]
        # what this forward writes (a padding column writes position 0's: copied again, harmless)
        changed[torch.arange(rows, device=read_index.device)[:, None], positions] = True
        where = changed.view(-1).nonzero().view(-1)  # row * length + position
        kept_index = where // length * self.keys[0].shape[1] + where % length
        return Refresh(every=False, kept=kept_index, slots=read_index.view(-1).index_select(0, where))

    def read(self, layer: int, values: bool, flat: torch.Tensor, read_index: torch.Tensor,
             refresh: Refresh) -> torch.Tensor:
        """Layer ``layer``'s kept keys (or ``values``) ``(B, kv_heads, kv_len, head_dim)``, refreshed
        from the pool ``flat (slots, kv_heads, head_dim)`` (which this forward's layer has written)."""
        store = (self.values if values else self.keys)[layer]
        rows, length = read_index.shape
        kept = store[:rows, :length]
        if refresh.every:
            kept.copy_(flat.index_select(0, read_index.reshape(-1)).view(rows, length, *flat.shape[1:]))
        elif refresh.slots is not None and refresh.slots.numel():
            store.view(-1, *flat.shape[1:]).index_copy_(0, refresh.kept, flat.index_select(0, refresh.slots))
        return kept.transpose(1, 2)

    def _nbytes(self, rows: int, length: int) -> int:
        """Every layer's keys and values of ``rows × length`` positions."""
        cache = self.cache
        return 2 * cache.num_layers * rows * length * cache.kv_heads * cache.head_dim * cache.dtype.itemsize

    def _fit(self, rows: int, length: int) -> bool:
        """Room for ``rows × length`` positions (grown, keeping what is kept), within the budget."""
        cache = self.cache
        have_rows, have = (self.keys[0].shape[0], self.keys[0].shape[1]) if self.keys else (0, 0)
        if rows <= have_rows and length <= have:
            return True
        want_rows, want = max(rows, have_rows), max(have, -(-length // _POSITIONS_STEP) * _POSITIONS_STEP)
        if self._nbytes(want_rows, want) > GATHERED_MAX_BYTES:
            return False
        shape = (want_rows, want, cache.kv_heads, cache.head_dim)
        grown = []
        for old in self.keys + self.values:
            new = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
            new[:old.shape[0], :old.shape[1]].copy_(old)
            grown.append(new)
        if not grown:
            grown = [torch.zeros(shape, dtype=cache.dtype, device=cache.device) for _ in range(2 * cache.num_layers)]
        self.keys, self.values = grown[:cache.num_layers], grown[cache.num_layers:]
        return True
