"""From hidden states to stored SAE features: the generation loop's hidden-state sink.

The loop reports every forward pass (:meth:`ActivationRecorder.on_forward`): the tokens it read,
their positions and their hidden states at the SAE's layer. The recorder gathers them per request
into blocks of ``block_steps`` forwards and turns each block into Arrow rows of top-k features:

* ``inline``: every forward is encoded at once, inside the token loop;
* ``nearline``: full blocks go to a background encoder thread through a bounded queue. The token
  loop only appends to a list and, every ``block_steps`` forwards, enqueues; it waits only when
  ``max_pending_blocks`` blocks are already queued (explicit back-pressure: nothing is dropped).

Both modes feed the same encoder with the same rows, so they store the same features (up to
float reassociation between batch shapes). A block that fails twice is recorded in the store's
``missing_blocks`` table — a gap is always explained. The Ray SAE workers reuse
:func:`encode_block`.

Position 0 is not encoded by default: its residual norm is ~100× every other position's (an
attention sink), SAEs are trained without it, and its "features" would top every query.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np
import pyarrow as pa
import torch

from engine.model.backend import ForwardRecord
from engine.services.sae import SAEEncoder, SAEIdentity
from engine.services.store_schema import ACTIVATION_SCHEMA

__all__ = ["EncodedForward", "BlockMeta", "HiddenBlock", "BlockAccumulator", "ActivationRecorder", "RecorderStats", "encode_block",
           "rows_from_topk"]

log = logging.getLogger("raylens.activations")

Writer = Callable[[pa.Table, str, str], int]  # (rows, batch_id, request_id) → rows written
MissingRecorder = Callable[["HiddenBlock", str], None]


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
    values, indices = encoder.encode_topk(block.hidden())
    return rows_from_topk(block, values.cpu().numpy(), indices.cpu().numpy(), encoder.identity,
                          source_mode=source_mode, model_id=model_id)


@dataclass
class RecorderStats:
    blocks_submitted: int = 0
    blocks_written: int = 0
    blocks_missing: int = 0
    rows_written: int = 0
    backlog_waits: int = 0  # times the token loop waited for a free queue slot
    max_backlog: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


_STOP = object()


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


class ActivationRecorder:
    """The in-process hidden-state sink (each request's :class:`engine.core.machine.RequestMachine`
    hands it every forward): inline, or nearline on one background encoder thread."""

    def __init__(self, encoder: SAEEncoder, write: Writer, record_missing: MissingRecorder, *,
                 mode: Literal["nearline", "inline"], block_steps: int, max_pending_blocks: int,
                 model_id: str, skip_first_position: bool = True) -> None:
        self.encoder = encoder
        self.mode = mode
        self.model_id = model_id
        self._write = write
        self._record_missing = record_missing
        self.stats = RecorderStats()
        # inline encodes every forward at once: a block is one forward
        self.blocks = BlockAccumulator(encoder.identity.layer, self._submit,
                                       block_steps=1 if mode == "inline" else block_steps,
                                       skip_first_position=skip_first_position)
        self._queue: queue.Queue[Any] | None = None
        self._worker: threading.Thread | None = None
        self._inline: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}  # this forward's encoding
        if mode == "nearline":
            self._queue = queue.Queue(maxsize=max_pending_blocks)
            self._worker = threading.Thread(target=self._run_worker, name="raylens-sae-encoder", daemon=True)
            self._worker.start()

    # ---------------------------------------------------------------------------- loop side

    def on_forward(self, request_id: str, step: int, record: ForwardRecord) -> "EncodedForward | None":
        """Nearline: queue the rows. Inline: encode every fed token now, store the rows (position 0
        left out as always) and return the top-k of every fed token — what the step's events carry,
        the same numbers as the stored rows."""
        if self.mode != "inline":
            self.blocks.on_forward(request_id, step, record)
            return None
        hidden = record.hidden.get(self.encoder.identity.layer)
        if hidden is None:
            return None
        values, indices = self.encoder.encode_topk(hidden)  # (q, k) each
        self._inline[request_id] = (record.start_position, values, indices)
        try:
            self.blocks.on_forward(request_id, step, record)
        finally:
            self._inline.pop(request_id, None)
        identity = self.encoder.identity
        return EncodedForward(values, indices, identity.release, identity.layer)

    def finish(self, request_id: str) -> None:
        """Hand off what is left of a request's rows (called when its generation ends)."""
        self.blocks.finish(request_id)

    def _submit(self, block: HiddenBlock) -> None:
        self.stats.blocks_submitted += 1
        if self._queue is None:
            self._process(block)
            return
        try:
            self._queue.put_nowait(block)
        except queue.Full:
            self.stats.backlog_waits += 1
            self._queue.put(block)  # back-pressure: wait for the encoder rather than drop
        self.stats.max_backlog = max(self.stats.max_backlog, self._queue.qsize())

    # -------------------------------------------------------------------------- encoder side

    def _process(self, block: HiddenBlock) -> None:
        error: BaseException | None = None
        for _attempt in range(2):
            try:
                pre = self._inline.get(block.request_id)
                if pre is not None:  # inline: the forward was encoded once, for the events too
                    start, values, indices = pre
                    offsets = [p - start for p in block.positions]
                    rows = rows_from_topk(block, values[offsets].cpu().numpy(), indices[offsets].cpu().numpy(),
                                          self.encoder.identity, source_mode=self.mode, model_id=self.model_id)
                else:
                    rows = encode_block(self.encoder, block, source_mode=self.mode, model_id=self.model_id)
                self.stats.rows_written += self._write(rows, block.batch_id, block.request_id)
                self.stats.blocks_written += 1
                return
            except Exception as err:  # retried once, then recorded as missing
                error = err
        self.stats.blocks_missing += 1
        reason = f"{type(error).__name__}: {error}"
        log.error("SAE block %s failed twice (%s); recorded in missing_blocks", block.batch_id, reason)
        try:
            self._record_missing(block, reason)
        except Exception:
            log.exception("could not record missing block %s", block.batch_id)

    def _run_worker(self) -> None:
        assert self._queue is not None
        while True:
            block = self._queue.get()
            try:
                if block is _STOP:
                    return
                self._process(block)
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every handed-off block is written (or recorded missing)."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        self.blocks.finish_all()
        if self._queue is not None and self._worker is not None:
            self._queue.put(_STOP)
            self._worker.join()
            self._queue = None
