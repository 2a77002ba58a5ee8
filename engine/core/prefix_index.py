"""The prefix cache: full KV blocks indexed by a hash chained over every token before them, kept
together with the internals their tokens' forward captured.

A block's key is ``blake2b(parent key, the block's token ids)``: equal keys mean equal token
prefixes, hence equal keys/values — the model is a function of the tokens before a position.
Nothing else may change them, so a block is indexed only while every one of its positions and
every position before it was fed without a steer (:mod:`engine.core.kv_manager` tracks that);
an adjusted prefill is just other tokens, and hashes differently.

A hit must not change what mods and stores see: ``Prefilled`` carries every prompt token's
hidden state and attention row at the event layer, the SAE hand-off encodes every prompt token's
residual stream. So each cached block keeps what its forward captured for its tokens
(:class:`BlockRows`) — per captured layer the hidden rows ``(block_size, d)`` and the attention
rows ``(heads, block_size, block_end)`` — and a request reuses a block only if the block holds
every internal its own prefill plan asks for; the hit ends at the first block that does not.
Memory: hidden rows cost ``block_size · d`` per layer and block (≈5 % of the block's keys and
values on the embedded model); attention rows grow with the block's position — a cached prefix
of ``n`` tokens keeps ``heads · n² / 2`` floats per attention layer (18 MB for 1,000 tokens and
9 heads in float32, next to 46 MB of keys and values).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from engine.model.capture import CapturePlan, RowCapture

__all__ = ["BlockRows", "CachedBlock", "PrefixIndex", "block_key", "hit_capture"]


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    digest = hashlib.blake2b(parent or b"root", digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


@dataclass(frozen=True)
class BlockRows:
    """What the forward that computed a block captured for its tokens: ``hidden[L]``
    ``(block_size, d)``; ``attention[L]`` ``(heads, block_size, block_end)`` (each query row's
    weights over every key up to the block's end, zeros past its own position)."""

    hidden: dict[int, torch.Tensor]
    attention: dict[int, torch.Tensor]

    def covers(self, plan: CapturePlan) -> bool:
        return set(plan.hidden_layers) <= self.hidden.keys() and set(plan.attention_layers) <= self.attention.keys()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.hidden.values()) + list(self.attention.values()))


@dataclass(frozen=True)
class CachedBlock:
    key: bytes
    block: int
    rows: BlockRows


class PrefixIndex:
    """Chained block keys → cached blocks. The allocator owns the blocks' lifetimes; this only
    remembers which block holds which prefix, and forgets it when the block is evicted."""

    def __init__(self) -> None:
        self._by_key: dict[bytes, CachedBlock] = {}
        self._key_of: dict[int, bytes] = {}
        self.rows_bytes = 0  # captured rows every indexed block keeps, kept as entries come and go
        # told of every key indexed and forgotten (``stored(key)``/``removed(key)``): the engine's
        # cache-event log, which routers follow (engine/cache_events.py)
        self.listener: Any = None

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: bytes) -> CachedBlock | None:
        return self._by_key.get(key)

    def put(self, key: bytes, block: int, rows: BlockRows) -> bool:
        """Index ``block`` under ``key``; False when another block already holds that prefix."""
        if key in self._by_key:
            return False
        self._by_key[key] = CachedBlock(key, block, rows)
        self._key_of[block] = key
        self.rows_bytes += rows.nbytes()
        if self.listener is not None:
            self.listener.stored(key)
        return True

    def evict(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            self.rows_bytes -= self._by_key.pop(key).rows.nbytes()
            if self.listener is not None:
                self.listener.removed(key)

    def lookup(self, tokens: Sequence[int], block_size: int, max_blocks: int, plan: CapturePlan) -> list[CachedBlock]:
        """The longest run of cached blocks (at most ``max_blocks``) starting at position 0 whose
        keys match ``tokens`` and whose captured rows cover ``plan``."""
        hits: list[CachedBlock] = []
        parent: bytes | None = None
        for i in range(max_blocks):
            parent = block_key(parent, tokens[i * block_size:(i + 1) * block_size])
            entry = self._by_key.get(parent)
            if entry is None or not entry.rows.covers(plan):
                break
            hits.append(entry)
        return hits


def hit_capture(hits: Sequence[CachedBlock], plan: CapturePlan) -> RowCapture:
    """The internals a forward of the hit's tokens would have captured under ``plan``: hidden
    ``(n, d)`` and attention ``(heads, n, n)`` for the ``n`` reused positions (each block's rows
    zero-padded on the key axis, where causal attention puts no weight)."""
    hidden = {layer: torch.cat([e.rows.hidden[layer] for e in hits]) for layer in plan.hidden_layers}
    attention = {}
    for layer in plan.attention_layers:
        rows = [e.rows.attention[layer] for e in hits]  # (h, block_size, block_end) each
        n = rows[-1].shape[-1]
        out = rows[0].new_zeros(rows[0].shape[0], n, n)  # one copy of every row, no intermediate pads
        first = 0
        for r in rows:
            out[:, first:first + r.shape[1], : r.shape[-1]] = r
            first += r.shape[1]
        attention[layer] = out
    return RowCapture(hidden, attention)
