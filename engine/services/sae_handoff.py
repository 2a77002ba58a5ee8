"""The SAE hand-off: hidden-state blocks from the generation loop to stored features, whatever
carries them.

The loop reports every forward (:meth:`SAEHandoff.on_forward`) and every request's end
(:meth:`SAEHandoff.finish`). The hand-off cuts each request's forwards into blocks, hands each
block to its :class:`BlockTransport` and settles what the transport reports:

* a stored block counts its rows;
* a failed one is sent again under the one :class:`RetryPolicy` (``sae.retry_attempts`` attempts
  in all, ``sae.retry_backoff_s`` apart, doubling) — the store keys batches by id, so a repeat is
  harmless — and when every attempt failed it is recorded in the store's ``missing_blocks`` table
  with the reason. A gap is always explained and no failure raises into the loop. A retry waits
  out its back-off without holding anyone up: it is parked with the time it is due and sent by
  whichever settling pass comes after that (the loop settles on every hand-off), so a failing
  worker never stalls the step loop;
* at most ``max_pending`` blocks are unsettled (sent or parked for a retry): at the bound the loop
  waits for one to settle (back-pressure: nothing is dropped), counted as ``backlog_waits``.

Transports, chosen by :func:`handoff_mode` from the config for the Engine and the Ray generator:

* ``inline`` (:class:`LocalTransport`): every forward is encoded in the loop before its events, so
  events and streams carry its features; the block is that forward, stored at once;
* ``thread`` (:class:`LocalTransport` with a thread): blocks of ``block_steps`` forwards are
  encoded and stored by one background thread while the loop runs on;
* ``ray-workers``: ``actors.sae_handoff.RayWorkerTransport`` ships each block to SAE worker
  actors (it lives with the actors: the engine never imports Ray).

Every transport answers a send with a :class:`concurrent.futures.Future` of the rows written, so
one bookkeeping serves them all.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import pyarrow as pa

from engine.config import RaylensConfig
from engine.errors import ConfigError
from engine.services.sae_mode import HandoffMode, RetryPolicy, handoff_mode
from engine.model.backend import ForwardRecord
from engine.services.sae import SAEEncoder
from engine.services.sae_blocks import BlockAccumulator, BlockMeta, EncodedForward, HiddenBlock, encode_block

__all__ = ["HandoffMode", "RetryPolicy", "HandoffStats", "BlockTransport", "LocalTransport", "SAEHandoff",
           "handoff_mode", "build_handoff"]

log = logging.getLogger("raylens.handoff")

Writer = Callable[[pa.Table, str, str], int]  # (rows, batch_id, request_id) → rows written
MissingRecorder = Callable[[BlockMeta, str], None]  # (block, reason)


@dataclass
class HandoffStats:
    """Counters of one hand-off since it started (results' ``metadata["sae"]``, the generator's
    ``stats()["sae"]``): blocks handed off, stored, re-sent after a failure (one per retry) and
    recorded missing; rows stored; times the loop waited at the bound; the most blocks unsettled."""

    blocks_submitted: int = 0
    blocks_stored: int = 0
    blocks_retried: int = 0
    blocks_missing: int = 0
    rows_written: int = 0
    backlog_waits: int = 0
    max_backlog: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class BlockTransport(Protocol):
    """Carries blocks to the store. ``prepare`` runs once per block (a host copy, a ledger entry),
    ``send`` once per attempt; a send's future holds the rows written or the attempt's error."""

    mode: HandoffMode
    encoder: SAEEncoder | None  # the local SAE (inline features, steering); None when it runs elsewhere

    def prepare(self, block: HiddenBlock) -> Any: ...

    def send(self, prepared: Any) -> "Future[int]": ...

    def record_missing(self, meta: BlockMeta, reason: str) -> None: ...

    def close(self) -> None: ...


class LocalTransport:
    """Encodes and stores blocks in this process: in the caller's thread (``inline``: the future is
    settled when ``send`` returns) or on one background thread (``thread``)."""

    def __init__(self, encoder: SAEEncoder, write: Writer, record_missing: MissingRecorder, *, model_id: str,
                 threaded: bool) -> None:
        self.mode: HandoffMode = "thread" if threaded else "inline"
        self.encoder: SAEEncoder | None = encoder
        self.model_id = model_id
        self._source_mode = "nearline" if threaded else "inline"  # the rows' source_mode column
        self._write = write
        self._record_missing = record_missing
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="raylens-sae-encoder") if threaded else None

    def prepare(self, block: HiddenBlock) -> HiddenBlock:
        return block

    def send(self, block: HiddenBlock) -> "Future[int]":
        if self._executor is not None:
            return self._executor.submit(self._store, block)
        future: Future[int] = Future()
        try:
            future.set_result(self._store(block))
        except Exception as err:
            future.set_exception(err)
        return future

    def _store(self, block: HiddenBlock) -> int:
        assert self.encoder is not None
        rows = encode_block(self.encoder, block, source_mode=self._source_mode, model_id=self.model_id)
        return self._write(rows, block.batch_id, block.request_id)

    def record_missing(self, meta: BlockMeta, reason: str) -> None:
        self._record_missing(meta, reason)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)


@dataclass
class _Pending:
    meta: BlockMeta
    prepared: Any
    attempts: int = 0  # sends so far
    due: float = 0.0  # parked for a retry: when it may be sent again (time.monotonic)


class SAEHandoff:
    """The loop's hidden-state sink (:class:`engine.core.request.HiddenSink`) for SAE encoding."""

    def __init__(self, transport: BlockTransport, *, layer: int, block_steps: int, max_pending: int,
                 retry: RetryPolicy, skip_first_position: bool = True) -> None:
        self.transport = transport
        self.encoder = transport.encoder
        self.layer = layer
        self.max_pending = max_pending
        self.retry = retry
        self.stats = HandoffStats()
        inline = transport.mode == "inline" and transport.encoder is not None
        self._encode_each_forward = inline
        # inline encodes every forward at once: a block is one forward
        self.blocks = BlockAccumulator(layer, self._hand_off, block_steps=1 if inline else block_steps,
                                       skip_first_position=skip_first_position)
        self._pending: dict[Future[int], _Pending] = {}
        self._encoded: dict[str, tuple[int, Any, Any]] = {}  # request → this forward's (start, values, indices)
        self._settling = 0  # blocks taken out of _pending by a thread that is settling them
        self._parked: list[_Pending] = []  # failed blocks waiting out their back-off before a retry
        self._lock = threading.Condition()  # notified whenever a block is settled

    @property
    def mode(self) -> str:
        """``inline`` or ``nearline``: what results and the rows' ``source_mode`` report."""
        return "inline" if self._encode_each_forward else "nearline"

    @property
    def backlog(self) -> int:
        """Blocks handed off and not yet settled."""
        with self._lock:
            return len(self._pending) + self._settling + len(self._parked)

    def report(self) -> dict[str, Any]:
        """Mode, transport, counters and backlog: the generator's ``stats()["sae"]``."""
        return {"mode": self.mode, "transport": self.transport.mode, **self.stats.as_dict(), "backlog": self.backlog}

    # ---------------------------------------------------------------------------- loop side

    def on_forward(self, request_id: str, step: int, record: ForwardRecord) -> EncodedForward | None:
        """Nearline: gather the forward into its request's block. Inline: encode every fed token
        now, store the rows (position 0 left out as always) and return the top-k of every fed
        token — what the step's events carry, the same numbers as the stored rows."""
        if not self._encode_each_forward:
            self.blocks.on_forward(request_id, step, record)
            return None
        hidden = record.hidden.get(self.layer)
        if hidden is None:
            return None
        assert self.encoder is not None
        try:
            values, indices = self.encoder.encode_topk(hidden)  # (q, k) each
        except Exception:  # the block's own attempts retry and, at worst, record it missing
            log.exception("inline SAE encoding of %s step %d failed; its events carry no features", request_id, step)
            self.blocks.on_forward(request_id, step, record)
            return None
        self._encoded[request_id] = (record.start_position, values, indices)
        try:
            self.blocks.on_forward(request_id, step, record)
        finally:
            self._encoded.pop(request_id, None)
        identity = self.encoder.identity
        return EncodedForward(values, indices, identity.release, identity.layer)

    def finish(self, request_id: str) -> None:
        """Hand off what is left of a request's forwards (called when its generation ends)."""
        self.blocks.finish(request_id)

    def _hand_off(self, block: HiddenBlock) -> None:
        encoded = self._encoded.get(block.request_id)
        if encoded is not None:  # inline: the forward was encoded once, for the events too
            start, values, indices = encoded
            offsets = [p - start for p in block.positions]
            block.topk = (values[offsets], indices[offsets])
        meta = block.meta()
        with self._lock:
            self.stats.blocks_submitted += 1
        try:
            prepared = self.transport.prepare(block)
        except Exception as err:  # nothing could be sent: the block is a gap, explained
            self._give_up(meta, err, attempts=0)
            return
        while self._sent() >= self.max_pending:
            with self._lock:
                self.stats.backlog_waits += 1
            self._settle(wait_for_one=True)
        self._send(_Pending(meta, prepared))
        self._settle(wait_for_one=False)

    # ------------------------------------------------------------------------- settling

    def _sent(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._parked)

    def _send_due(self) -> float | None:
        """Send the parked retries whose back-off is over; the seconds until the next one is due
        (None: nothing parked)."""
        now = time.monotonic()
        with self._lock:
            due = [item for item in self._parked if item.due <= now]
            self._parked = [item for item in self._parked if item.due > now]
            later = min((item.due for item in self._parked), default=None)
        for item in due:
            self._send(item)
        return None if later is None else max(0.0, later - now)

    def _send(self, item: _Pending) -> None:
        item.attempts += 1
        try:
            future = self.transport.send(item.prepared)
        except Exception as err:
            future = Future()
            future.set_exception(err)
        with self._lock:
            self._pending[future] = item
            self.stats.max_backlog = max(self.stats.max_backlog, len(self._pending))

    def _settle(self, *, wait_for_one: bool) -> None:
        """Settle every finished send (waiting for one first if ``wait_for_one``); retries sent now
        and already finished (inline) are settled too."""
        while True:
            next_due = self._send_due()
            with self._lock:
                futures = list(self._pending)
            if not futures:
                if not (wait_for_one and next_due is not None):
                    return
                time.sleep(next_due)  # only parked retries are unsettled and the caller must wait
                continue
            if wait_for_one:
                done = wait(futures, timeout=next_due, return_when=FIRST_COMPLETED).done
                if not done:
                    continue  # a parked retry fell due first: send it, then wait again
                wait_for_one = False
            else:
                done = {f for f in futures if f.done()}
            if not done:
                return
            for future in done:
                with self._lock:
                    item = self._pending.pop(future, None)
                    if item is None:  # another thread is settling it
                        continue
                    self._settling += 1
                try:
                    self._settle_one(future, item)
                finally:
                    with self._lock:
                        self._settling -= 1
                        self._lock.notify_all()

    def _settle_one(self, future: "Future[int]", item: _Pending) -> None:
        try:
            rows = future.result()
        except Exception as err:
            if item.attempts < self.retry.attempts:
                with self._lock:
                    self.stats.blocks_retried += 1
                log.warning("SAE block %s failed (attempt %d of %d: %s: %s); sending it again", item.meta.batch_id,
                            item.attempts, self.retry.attempts, type(err).__name__, err)
                delay = self.retry.delay_s(item.attempts)
                if delay > 0:
                    item.due = time.monotonic() + delay
                    with self._lock:
                        self._parked.append(item)
                else:
                    self._send(item)
            else:
                self._give_up(item.meta, err, attempts=item.attempts)
            return
        with self._lock:
            self.stats.rows_written += rows
            self.stats.blocks_stored += 1

    def _give_up(self, meta: BlockMeta, err: BaseException, *, attempts: int) -> None:
        with self._lock:
            self.stats.blocks_missing += 1
        reason = f"{type(err).__name__}: {err}"
        log.error("SAE block %s failed (%d attempts: %s); recorded in missing_blocks", meta.batch_id, attempts, reason)
        try:
            self.transport.record_missing(meta, reason[:2000])
        except Exception:
            log.exception("could not record missing block %s", meta.batch_id)

    def drain(self) -> None:
        """Wait until every handed-off block is stored or recorded missing (also those another
        thread is settling: a retry it is about to send)."""
        while True:
            with self._lock:
                if not self._pending and not self._parked:
                    if not self._settling:
                        return
                    self._lock.wait()
                    continue
            self._settle(wait_for_one=True)

    def close(self) -> None:
        """Hand off every open block, settle them all, stop the transport."""
        self.blocks.finish_all()
        self.drain()
        self.transport.close()


def build_handoff(config: RaylensConfig, *, ray: bool, local: Callable[[bool], LocalTransport] | None = None,
                  remote: Callable[[], BlockTransport] | None = None) -> SAEHandoff:
    """The one place the hand-off's mode is chosen (:func:`handoff_mode` of ``config.sae``, ``ray``:
    whether this runs in a Ray generator). ``local(threaded)`` builds the in-process transport
    (it loads the SAE), ``remote()`` the SAE workers' one; only the chosen one is called. Blocks
    unsettled at once are bounded by ``sae.max_pending_blocks`` in process and by
    ``ray.max_inflight_blocks`` on SAE workers."""
    sae = config.sae
    mode = handoff_mode(sae, ray=ray)
    if mode == "ray-workers":
        if remote is None:
            raise ConfigError("`remote` must be the SAE workers' transport for sae.mode nearline on Ray, got None; "
                              "start SAE workers or set sae.mode: inline", parameter="remote")
        transport: BlockTransport = remote()
        max_pending = config.ray.max_inflight_blocks
    else:
        if local is None:
            raise ConfigError(f"`local` must build the in-process transport for the {mode} SAE hand-off, got None",
                              parameter="local")
        transport = local(mode == "thread")
        max_pending = sae.max_pending_blocks
    return SAEHandoff(transport, layer=sae.layer, block_steps=sae.block_steps, max_pending=max_pending,
                      retry=RetryPolicy.from_config(sae), skip_first_position=sae.skip_first_position)
