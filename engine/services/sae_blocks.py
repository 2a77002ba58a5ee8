"""Hidden-state blocks and their rows: what the SAE hand-off (:mod:`engine.services.sae_handoff`)
cuts, ships and stores, whatever transport carries it.

The loop reports every forward pass: the tokens it read, their positions and their hidden states
at the SAE's layer. :class:`BlockAccumulator` gathers them per request into :class:`HiddenBlock` s
of ``block_steps`` forwards; :func:`encode_block` turns a block into Arrow rows of top-k features,
in this process or on a Ray SAE worker alike, so every transport stores the same rows (up to float
reassociation between batch shapes).

Position 0 is not encoded by default: its residual norm is ~100× every other position's (an
attention sink), SAEs are trained without it, and its "features" would top every query.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch

from engine.model.backend import ForwardRecord
from engine.services.sae import SAEEncoder, SAEIdentity
from engine.services.store_schema import ACTIVATION_SCHEMA

__all__ = ["EncodedForward", "BlockMeta", "HiddenBlock", "BlockAccumulator", "encode_block", "rows_from_topk"]


def _batch_id(request_id: str, index: int) -> str:
    """Deterministic per block, so a block sent twice (a worker died) is stored once."""
    return f"{request_id}/{index}"


@dataclass(frozen=True)
class BlockMeta:
    """A block without its hidden states: what travels beside the hidden-state object ref to a Ray
    SAE worker, and what the store's block ledger records."""

    request_id: str
    index: int
    steps: tuple[int, ...]
    positions: tuple[int, ...]
    token_ids: tuple[int, ...]
    created_at: float

    @property
    def batch_id(self) -> str:
        return _batch_id(self.request_id, self.index)

    def ledger(self) -> dict[str, Any]:
        """The keyword arguments of ``ActivationStore.expect_block`` / ``record_missing_block``."""
        return {"batch_id": self.batch_id, "request_id": self.request_id, "first_step": min(self.steps),
                "last_step": max(self.steps), "token_count": len(self.token_ids)}


@dataclass
class HiddenBlock:
    """Hidden states of consecutive forwards of one request: ``hidden (n, d)`` with one step,
    position and token id per row."""

    request_id: str
    index: int  # the block's number within its request: makes batch ids deterministic
    steps: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    # inline: the block's top-k ``(values (n, k), indices (n, k))``, already encoded for the events
    topk: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_meta(cls, meta: BlockMeta, hidden: torch.Tensor) -> "HiddenBlock":
        return cls(meta.request_id, meta.index, list(meta.steps), list(meta.positions), list(meta.token_ids),
                   [hidden], meta.created_at)

    def meta(self) -> BlockMeta:
        return BlockMeta(self.request_id, self.index, tuple(self.steps), tuple(self.positions),
                         tuple(self.token_ids), self.created_at)

    @property
    def batch_id(self) -> str:
        return _batch_id(self.request_id, self.index)

    @property
    def forwards(self) -> int:
        return len(self.parts)

    def add(self, step: int, record: ForwardRecord, hidden: torch.Tensor) -> None:
        n = len(record.token_ids)
        self.steps.extend([step] * n)
        self.positions.extend(range(record.start_position, record.start_position + n))
        self.token_ids.extend(record.token_ids)
        self.parts.append(hidden)

    def hidden(self) -> torch.Tensor:
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


def rows_from_topk(block: HiddenBlock, values: np.ndarray, indices: np.ndarray, identity: SAEIdentity, *,
                   source_mode: str, model_id: str) -> pa.Table:
    """Arrow rows for every (token, active feature) of ``values/indices (n, k)``; inactive
    (value ≤ 0) entries are left out."""
    token_index, rank = np.nonzero(values > 0)
    n = len(token_index)
    steps = np.asarray(block.steps, dtype=np.int32)[token_index]
    positions = np.asarray(block.positions, dtype=np.int32)[token_index]
    token_ids = np.asarray(block.token_ids, dtype=np.int32)[token_index]
    created = pa.array(np.full(n, int(block.created_at * 1_000_000), dtype=np.int64), pa.int64()).cast(
        pa.timestamp("us", tz="UTC"))
    return pa.table({
        "request_id": pa.array([block.request_id] * n, pa.string()),
        "step": steps,
        "token_position": positions,
        "token_id": token_ids,
        "created_at": created,
        "sae_release": pa.array([identity.release] * n, pa.string()),
        "sae_layer": np.full(n, identity.layer, dtype=np.int16),
        "feature_id": indices[token_index, rank].astype(np.int32),
        "activation_value": values[token_index, rank].astype(np.float32),
        "rank": rank.astype(np.int16),
        "source_mode": pa.array([source_mode] * n, pa.string()),
        "model_id": pa.array([model_id] * n, pa.string()),
    }, schema=ACTIVATION_SCHEMA)


def encode_block(encoder: SAEEncoder, block: HiddenBlock, *, source_mode: str, model_id: str) -> pa.Table:
    """The block's rows; its top-k encoded now unless the loop already did (inline)."""
    values, indices = block.topk if block.topk is not None else encoder.encode_topk(block.hidden())
    return rows_from_topk(block, values.cpu().numpy(), indices.cpu().numpy(), encoder.identity,
                          source_mode=source_mode, model_id=model_id)


class BlockAccumulator:
    """Gathers each request's forwards into :class:`HiddenBlock` s of ``block_steps`` forwards and
    hands every full block (and each request's remainder, at ``finish``) to ``on_block``."""

    def __init__(self, layer: int, on_block: Callable[[HiddenBlock], None], *, block_steps: int,
                 skip_first_position: bool = True) -> None:
        self.layer = layer
        self.block_steps = block_steps
        self.skip_first_position = skip_first_position
        self._on_block = on_block
        self._open: dict[str, HiddenBlock] = {}
        self._next_index: dict[str, int] = {}
        self._lock = threading.Lock()

    def on_forward(self, request_id: str, step: int, record: ForwardRecord) -> None:
        hidden = record.hidden.get(self.layer)
        if hidden is not None and record.start_position == 0 and self.skip_first_position:
            record = ForwardRecord(1, record.token_ids[1:], record.hidden)
            hidden = hidden[1:]
        if hidden is None or not record.token_ids:
            return
        with self._lock:
            block = self._open.get(request_id)
            if block is None:
                index = self._next_index.get(request_id, 0)
                self._next_index[request_id] = index + 1
                block = self._open[request_id] = HiddenBlock(request_id, index)
            block.add(step, record, hidden)
            full = block.forwards >= self.block_steps
            if full:
                del self._open[request_id]
        if full:
            self._on_block(block)

    def finish(self, request_id: str) -> None:
        with self._lock:
            block = self._open.pop(request_id, None)
            self._next_index.pop(request_id, None)
        if block is not None:
            self._on_block(block)

    def finish_all(self) -> None:
        for request_id in list(self._open):
            self.finish(request_id)


@dataclass(frozen=True)
class EncodedForward:
    """Top-k SAE features of every token one forward fed: ``values``/``indices`` ``(q, k)``,
    strongest first, on the encoder's device."""

    values: torch.Tensor
    indices: torch.Tensor
    release: str
    layer: int
