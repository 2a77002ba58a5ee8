"""A KV cache built for continuous batching: one preallocated slot per active request.

Every layer keeps ``keys``/``values`` of shape ``(slots, kv_heads, capacity, head_dim)``. A request
owns one slot; its tokens sit at positions ``0 … n-1`` of that slot. Positions are data, not
shapes (as in gpt-fast's ``KVCache`` and vLLM's ``num_computed_tokens``):

* a forward writes the keys/values of the tokens it feeds at their positions and attends over the
  slot's first ``start + q`` positions, through a boolean mask that also hides stale entries;
* Backtrack is moving the request's position back: nothing is freed or copied, the stale entries
  are masked and later overwritten;
* requests of different lengths share one batched decode forward: each row writes at its own
  position and the mask gives each row its own causal window.

Active slots are kept dense (``0 … active-1``): when a request leaves, the last slot's entries are
moved into the hole, so the usual decode batch (every active request) reads the buffers as a view,
without a gather. Capacity grows by doubling up to ``max_capacity``; growing copies the buffers
once (a static cache for CUDA graphs sets ``capacity = max_capacity`` up front).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SlotKVCache", "BatchCacheView"]


class SlotKVCache:
    def __init__(self, *, num_layers: int, slots: int, kv_heads: int, head_dim: int, capacity: int,
                 max_capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers, self.slots, self.kv_heads, self.head_dim = num_layers, slots, kv_heads, head_dim
        self.max_capacity = max_capacity
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._grow(min(capacity, max_capacity))

    def _grow(self, capacity: int) -> None:
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for old, new in zip(self.keys + self.values, keys + values):
            new[:, :, : self.capacity].copy_(old)
        self.keys, self.values, self.capacity = keys, values, capacity

    def ensure_capacity(self, length: int) -> None:
        """Make room for ``length`` positions per slot (callers check ``max_capacity`` first)."""
        if length <= self.capacity:
            return
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        self._grow(min(capacity, self.max_capacity))

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (compaction)."""
        if src == dst or length <= 0:
            return
        for buf in self.keys + self.values:
            buf[dst, :, :length].copy_(buf[src, :, :length])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


@dataclass
class BatchCacheView:
    """What one batched forward hands transformers as ``past_key_values``.

    ``slots (B,)``: each row's slot; ``starts (B,)``: the position of each row's first fed token;
    ``q``: tokens fed per row; ``kv_len``: positions attended (``max(start) + q``). transformers'
    attention modules call :meth:`update` once per layer with the new keys/values ``(B, kv, q, hd)``;
    it writes them at their positions and returns the slots' keys/values ``(B, kv, kv_len, hd)``.
    """

    cache: SlotKVCache
    slots: torch.Tensor  # (B,) long, on the cache's device
    write_rows: torch.Tensor  # (B*q,) slot of each fed token
    write_positions: torch.Tensor  # (B*q,) position of each fed token
    kv_len: int
    dense: bool  # slots are 0 … B-1 in order: read through a view, no gather

    @classmethod
    def build(cls, cache: SlotKVCache, slots: list[int], starts: list[int], lengths: list[int], *,
              scratch_slot: int) -> tuple["BatchCacheView", torch.Tensor]:
        """Rows feeding ``lengths[b]`` tokens each, left-padded to the longest: row ``b``'s real
        tokens sit in the last ``lengths[b]`` columns at positions ``starts[b], …``; padding columns
        write ``scratch_slot`` (no request's slot). Returns the view and the ``(B, q)`` positions."""
        q = max(lengths)
        rows, positions = [], []
        for slot, start, n in zip(slots, starts, lengths):
            rows += [scratch_slot] * (q - n) + [slot] * n
            positions += [0] * (q - n) + list(range(start, start + n))
        device = cache.device
        pos_t = torch.tensor(positions, dtype=torch.long, device=device)  # (B*q,)
        view = cls(cache, torch.tensor(slots, dtype=torch.long, device=device),
                   torch.tensor(rows, dtype=torch.long, device=device), pos_t,
                   max(s + n for s, n in zip(starts, lengths)), slots == list(range(len(slots))))
        return view, pos_t.view(len(slots), q)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        b, kv, q, hd = key_states.shape
        out = []
        for buf, new in ((self.cache.keys[layer_idx], key_states), (self.cache.values[layer_idx], value_states)):
            # (S, L, kv, hd) view: one index_put_ writes every row's tokens at their own positions
            buf.transpose(1, 2).index_put_((self.write_rows, self.write_positions),
                                           new.transpose(1, 2).reshape(b * q, kv, hd).to(buf.dtype))
            if self.dense:
                out.append(buf[:b, :, : self.kv_len])
            else:
                out.append(buf[:, :, : self.kv_len].index_select(0, self.slots))
        return out[0], out[1]

    # transformers asks a cache these when it builds masks or positions itself; we pass both, so
    # they are answered only for completeness.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    @property
    def is_compileable(self) -> bool:
        return False
