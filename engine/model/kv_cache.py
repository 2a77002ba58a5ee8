"""A paged KV cache: fixed-size blocks from one pool per layer, a block table per request.

Every layer keeps ``keys``/``values`` of shape ``(num_blocks, block_size, kv_heads, head_dim)``.
Position ``p`` of a request lives in block ``table[p // block_size]`` at offset ``p % block_size``;
the pool read flat, ``(num_blocks * block_size, kv_heads, head_dim)``, is indexed by one *slot*
per position: ``table[p // block_size] * block_size + p % block_size``. Positions are data, not
shapes:

* a forward writes the keys/values of the tokens it feeds into their slots and reads, per row,
  the slots of positions ``0 … kv_len-1`` gathered into the ``(B, kv_heads, kv_len, head_dim)``
  view transformers' attention (SDPA) expects; a boolean causal mask hides what lies past each
  row's own position (stale entries after a Backtrack, padding);
* Backtrack is moving the request's position back; blocks wholly past the new end go back to the
  pool (:mod:`engine.core.kv_manager`), the rest are overwritten as the request feeds again;
* requests of different lengths share one batched forward: each row has its own table;
* where a paged kernel serves the model (:mod:`engine.model.paged_attention`) nothing is gathered:
  the kernel reads each row's blocks through its table;
* on a CPU with no such kernel, the rows an eager forward gathered are kept for the next
  (:mod:`engine.model.gathered_rows`): a decode step copies again only what changed.

Block 0 is the scratch block no request owns: left-padding columns, the padding rows of a static
decode bucket and table entries past a request's end point there, so they never touch a live
request's keys. The pool grows by doubling up to ``max_blocks`` (growing copies it once); a
static cache for CUDA graphs is allocated whole, up front.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:  # gathered_rows imports this module
    from engine.model.gathered_rows import GatheredRows, Refresh

__all__ = ["PagedKVCache", "BatchCacheView", "SCRATCH_BLOCK", "read_slots", "write_slots", "cache_argument"]

SCRATCH_BLOCK = 0


class PagedKVCache:
    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, block_size: int, blocks: int,
                 max_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.block_size, self.max_blocks = block_size, max_blocks
        self.dtype, self.device = dtype, device
        self.num_blocks = 0
        self.version = 0  # moves when a block is copied into another (the gathered rows kept go stale)
        self.keys: list[torch.Tensor] = []  # per layer (num_blocks, block_size, kv_heads, head_dim)
        self.values: list[torch.Tensor] = []
        self.grow(min(max(blocks, 2), max_blocks))

    def grow(self, blocks: int) -> None:
        """Reallocate the pool with ``blocks`` blocks, keeping every block's contents."""
        blocks = min(blocks, self.max_blocks)
        if blocks <= self.num_blocks:
            return
        shape = (blocks, self.block_size, self.kv_heads, self.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for old, new in zip(self.keys + self.values, keys + values):
            new[: self.num_blocks].copy_(old)
        self.keys, self.values, self.num_blocks = keys, values, blocks

    def copy_block(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of block ``src`` into ``dst`` (copy-on-write)."""
        if length <= 0:
            return
        self.version += 1
        for buf in self.keys + self.values:
            buf[dst, :length].copy_(buf[src, :length])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def block_nbytes(self) -> int:
        """Bytes one block holds over every layer's keys and values."""
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.head_dim * \
            torch.empty((), dtype=self.dtype).element_size()


def read_slots(tables: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    """``tables (B, nb)`` block ids → ``(B, kv_len)`` flat pool slots of positions ``0 … kv_len-1``
    (entries past a table's end must be :data:`SCRATCH_BLOCK`). Pure tensor ops: a CUDA graph
    computes it from its static table on every replay."""
    key_pos = torch.arange(kv_len, device=tables.device)
    return tables[:, key_pos // block_size] * block_size + key_pos % block_size


def write_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """``tables (B, nb)`` and ``positions (B, q)`` → ``(B*q,)`` flat slots the fed tokens write."""
    return (tables.gather(1, positions // block_size) * block_size + positions % block_size).reshape(-1)


@dataclass
class BatchCacheView:
    """What one batched forward hands transformers as its KV cache (``cache_argument``).

    ``write_index (B*q,)``: the flat pool slot of every fed token (padding columns: the scratch
    block); ``read_index (B, kv_len)``: the slots of each row's positions ``0 … kv_len-1``.
    transformers' attention modules call :meth:`update` once per layer with the new keys/values
    ``(B, kv, q, hd)``; it writes them into their slots and returns the rows' gathered keys/values
    ``(B, kv, kv_len, hd)``.
    """

    cache: PagedKVCache
    write_index: torch.Tensor  # (B*q,) long, on the cache's device
    read_index: torch.Tensor  # (B, kv_len) long
    kv_len: int
    tables: torch.Tensor | None = None  # (B, ceil(kv_len / block_size)) long: what a paged kernel reads by
    # the rows kept gathered between forwards (engine/model/gathered_rows.py); None: gathered afresh
    gathered: "GatheredRows | None" = None
    refresh: "Refresh | None" = None  # what this forward copies into them again (decided at its first layer)
    positions: torch.Tensor | None = None  # (B, q): the positions each row writes (for ``gathered``)

    @classmethod
    def build(cls, cache: PagedKVCache, tables: Sequence[Sequence[int]], starts: Sequence[int],
              lengths: Sequence[int], gathered: "GatheredRows | None" = None) -> tuple["BatchCacheView", torch.Tensor]:
        """Rows feeding ``lengths[b]`` tokens each, left-padded to the longest: row ``b``'s real
        tokens sit in the last ``lengths[b]`` columns at positions ``starts[b], …`` and its blocks
        are ``tables[b]`` (covering those positions). Returns the view and the ``(B, q)`` positions
        (padding columns: position 0, written to the scratch block). ``gathered``: the runner's
        :class:`~engine.model.gathered_rows.GatheredRows`, whose kept rows :meth:`update` reads
        (None: every layer gathers afresh)."""
        q = max(lengths)
        bs = cache.block_size
        kv_len = max(s + n for s, n in zip(starts, lengths))
        writes, positions = [], []
        for table, start, n in zip(tables, starts, lengths):
            writes += [SCRATCH_BLOCK * bs] * (q - n) + [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            positions += [0] * (q - n) + list(range(start, start + n))
        nb = -(-kv_len // bs)
        padded = [list(t[:nb]) + [SCRATCH_BLOCK] * (nb - len(t[:nb])) for t in tables]
        device = cache.device
        table_t = torch.tensor(padded, dtype=torch.long, device=device)  # (B, nb)
        fed = torch.tensor(positions, dtype=torch.long, device=device).view(len(tables), q)
        view = cls(cache, torch.tensor(writes, dtype=torch.long, device=device),
                   read_slots(table_t, kv_len, bs), kv_len, table_t, gathered, positions=fed)
        return view, fed

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Any = None, **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers < 5.24 passes ``cache_kwargs`` positionally, 5.24+ the layer's kwargs as
        # ``kwargs=``; neither carries anything a paged view needs.
        b, kv, q, hd = key_states.shape
        length = self.read_index.shape[1]
        gathered = self.gathered
        if gathered is not None and self.refresh is None:
            assert self.positions is not None  # internal invariant: build() gives them with gathered rows
            self.refresh = gathered.refresh(self.read_index, self.positions)
            if self.refresh is None:  # too small to pay, or too large to keep: gathered afresh, as below
                self.gathered = gathered = None
        refresh = self.refresh
        out = []
        for values, buf, new in ((False, self.cache.keys[layer_idx], key_states),
                                 (True, self.cache.values[layer_idx], value_states)):
            flat = buf.view(-1, kv, hd)  # (num_blocks * block_size, kv, hd)
            flat.index_copy_(0, self.write_index, new.transpose(1, 2).reshape(b * q, kv, hd).to(buf.dtype))
            if gathered is not None and refresh is not None:
                out.append(gathered.read(layer_idx, values, flat, self.read_index, refresh))
            else:
                out.append(flat.index_select(0, self.read_index.reshape(-1)).view(b, length, kv, hd).transpose(1, 2))
        return out[0], out[1]

    # transformers asks a cache these when it builds masks or positions itself; we pass both, so
    # they are answered only for completeness.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    @property
    def is_compileable(self) -> bool:
        return False


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(...)``, under the name its forward takes the cache by:
    transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name still works but warns
    on every call, and goes in 5.40); earlier releases know only ``past_key_values``."""
    model_class: Any = type(getattr(model, "_orig_mod", model))  # torch.compile wraps it
    return {_cache_parameter(model_class): cache}


@lru_cache(maxsize=None)
def _cache_parameter(model_class: Any) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
