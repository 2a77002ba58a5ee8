"""The step loop: one thread, one model, many requests — continuous batching.

::

    submit ─► wait queue (bounded: back-pressure) ─► admitted between steps, up to max_batch
    step:  one backend.forward for every request that needs one (new prompts and forced chunks as
           prefill-shaped rows, every other row in one batched decode forward)
           → per request: Prefilled (new ones) / ForwardPass → its mods → its plan
           → one batched sample for every request that samples (one host read)
           → per request: Sampled → its mods → add → Added → its mods → stop checks
           → finished requests leave; their slots go to the next waiting ones

On a GPU the device idles from the sampled ids' host read until the next forward is launched, so
that gap holds only what the next forward depends on. A request with no mods (and nothing to read
from the device for its announcements) takes its sample and runs its stop checks at once; its
Sampled, stream token and Added are announced right after the next forward is launched — before
that step's ForwardPass, so events, payload records and the stream keep their order. A request
that finishes on the step, or whose mods could act on Sampled/Added, is announced in place. On a
CPU the forward runs in the loop's thread, so there is nothing to overlap and every step is
announced in place.

Each request owns its mods, forced queue, generator, payload, capture plan and stream
(:class:`~engine.core.request.RequestState`); the batch owns only tensors. A request's mods see
only its own row. A fault in one request (a mod's bad action, an input that cannot fit, a failed
forward of its own rows) ends that request alone with finish reason ``error``; a cancelled one
ends at the next step boundary. Results are built off the loop thread (decoding, payloads,
ingest delivery), so a slow ingest backend never stalls the batch.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from engine.core.request import RequestState
from engine.core.result import FinishReason
from engine.core.rules import Rules, StepPlan
from engine.core.stream import RequestHandle
from engine.errors import EngineClosedError, QueueFullError
from engine.model.backend import Backend, ForwardRow, RowOutput
from engine.model.sampling import SampleResult, SampleRow, sample_rows
from mods.types import Sampled

__all__ = ["StepLoop", "Entry", "LoopStats"]

log = logging.getLogger("raylens.step_loop")


@dataclass
class Entry:
    """One submitted request as the loop holds it; ``finalize`` builds its result once it left the
    batch (each Engine sharing the loop brings its own: its store, SAE recorder and ingest)."""

    state: RequestState
    rules: Rules
    handle: RequestHandle
    finalize: Callable[["Entry"], Any]


@dataclass
class LoopStats:
    steps: int = 0
    forwards: int = 0
    max_active: int = 0
    waits_for_room: int = 0  # submits that waited for a free place (back-pressure)
    deferred_announcements: int = 0  # mod-free steps announced after the next forward's launch
    # host time from a step's sampled ids to the next forward's launch (the device idles then)
    launch_gaps: int = 0
    launch_gap_s: float = 0.0

    @property
    def mean_launch_gap_ms(self) -> float:
        return 1000.0 * self.launch_gap_s / self.launch_gaps if self.launch_gaps else 0.0


class StepLoop:
    """One per backend (:meth:`for_backend`): the KV cache's slots and the forward belong to one
    thread, so every Engine over the same model shares its loop."""

    def __init__(self, backend: Backend, *, max_waiting: int, finisher_threads: int = 4) -> None:
        self.backend = backend
        self.max_waiting = max_waiting
        self._waiting: collections.deque[Entry] = collections.deque()
        self._active: list[Entry] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._finisher = ThreadPoolExecutor(max_workers=finisher_threads, thread_name_prefix="raylens-finish")
        self.stats = LoopStats()
        # mod-free steps whose Sampled/stream/Added wait for the next launch: (entry, step, sample)
        self._deferred: list[tuple[Entry, int, SampleResult]] = []
        self._sampled_at: float | None = None
        # only a device that runs the forward asynchronously has anything to overlap; on a CPU the
        # forward runs in this thread, so deferring would only hold each streamed token back a step
        device = getattr(backend, "device", None)
        self.defer_announcements = getattr(device, "type", None) == "cuda"

    @classmethod
    def for_backend(cls, backend: Backend) -> "StepLoop":
        """The backend's loop, created on first use (or again after it was closed)."""
        loop = getattr(backend, "_raylens_step_loop", None)
        if loop is None or loop._closing:
            loop = cls(backend, max_waiting=backend.config.max_waiting)
            backend._raylens_step_loop = loop  # type: ignore[attr-defined]
        return loop

    # ---------------------------------------------------------------------------- callers' side

    def submit(self, entry: Entry, *, block: bool = True, timeout: float | None = None) -> None:
        """Queue ``entry``; with no room, wait (``block``) or raise :class:`QueueFullError`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closing:
                    raise EngineClosedError("the engine is closed; create a new one")
                room = self.max_waiting + max(0, self.backend.max_batch - len(self._active)) - len(self._waiting)
                if room > 0:
                    break
                if not block:
                    raise QueueFullError(f"{len(self._active)} requests are running and {len(self._waiting)} waiting "
                                         f"(backend.max_waiting = {self.max_waiting}); retry later")
                self.stats.waits_for_room += 1
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QueueFullError("no room in the request queue within the timeout; retry later")
                self._cond.wait(left)
            self._waiting.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="raylens-step-loop", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def close(self, timeout: float = 60.0) -> None:
        """Cancel what is still queued or running, stop the loop and finish every result."""
        with self._cond:
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            for entry in self._active:
                entry.handle.cancel()
            self._cond.notify_all()
        for entry in waiting:
            entry.handle.set_exception(EngineClosedError("the engine was closed before this request started"))
        if self._thread is not None:
            self._thread.join(timeout)
        self._finisher.shutdown(wait=True)

    @property
    def active(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------------------------- the loop

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._waiting and not self._closing:
                    self._sampled_at = None  # idle time is no launch gap
                    self._cond.wait()
                if self._closing and not self._active:
                    return
                new: list[Entry] = []
                while self._waiting and len(self._active) + len(new) < self.backend.max_batch:
                    new.append(self._waiting.popleft())
                if new:
                    self._cond.notify_all()  # room in the queue for blocked submitters
            try:
                self._step(new)
            except Exception as err:  # a bug in the loop itself: fail what it held, keep serving
                log.exception("step failed; ending the requests it held")
                self._announce_deferred()
                for entry in self._active + [e for e in new if e not in self._active]:
                    entry.state.fail(f"internal error in the step loop: {type(err).__name__}: {err}")
                self._retire()

    def _guard(self, entry: Entry, fn: Callable[[], Any]) -> Any:
        """Run one request's part of the step; a fault ends that request alone."""
        try:
            return fn()
        except Exception as err:
            log.warning("request %s failed: %s: %s", entry.state.request_id, type(err).__name__, err)
            entry.state.fail(f"{type(err).__name__}: {err}")
            return None

    def _step(self, new: list[Entry]) -> None:
        for entry in new:
            self._guard(entry, lambda e=entry: self.backend.acquire(e.state.request_id))
            self._active.append(entry)
        for entry in self._active:
            if entry.handle.cancel_requested and entry.state.finish is None:
                entry.state.finish = FinishReason.CANCELLED
        running = [e for e in self._active if e.state.finish is None]
        self._forward(running)
        self._announce_deferred()  # when no forward ran
        for entry in running:
            if not entry.state.prefilled and entry.state.output is not None and entry.state.finish is None:
                entry.state.prefilled = True
                rules = entry.rules
                self._guard(entry, lambda r=rules: r.apply_prefilled(r.dispatch(r.prefilled_event())))
        stepping = [e for e in running if e.state.finish is None and e.state.prefilled and e.state.output is not None]
        plans: dict[int, StepPlan] = {}
        for entry in stepping:
            plan = self._guard(entry, lambda e=entry: self._forward_pass(e))
            if plan is not None and entry.state.finish is None:
                plans[id(entry)] = plan
        to_sample = [e for e in stepping if id(e) in plans and e.rules.sampling_needed(plans[id(e)])]
        samples = self._sample(to_sample, plans)
        self._sampled_at = time.perf_counter() if samples else None
        for entry in stepping:
            if id(entry) in plans:
                self._guard(entry, lambda e=entry: self._finish_step(e, plans[id(e)], samples.get(id(e))))
            elif entry.state.finish is None:
                self._guard(entry, lambda e=entry: e.rules.end_step(self.backend.max_sequence))
        self.stats.steps += 1
        self.stats.max_active = max(self.stats.max_active, len(self._active))
        self._retire()

    # --------------------------------------------------------------------------- step parts

    def _forward(self, running: list[Entry]) -> None:
        """One forward for every running request that needs one: new prompts feed every row's
        internals (Prefilled carries the whole prompt's), the rest the newest row's."""
        owners, rows = [], []
        for entry in running:
            state = entry.state
            if not state.needs_forward:
                continue
            tokens = state.tokens[state.cached:]
            if not tokens:  # an erased position is re-fed from the last kept token
                state.cached = max(0, state.length - 1)
                tokens = state.tokens[state.cached:]
            plan = state.plan.with_all_query_rows(not state.prefilled)
            owners.append(entry)
            steering = entry.rules.steering
            rows.append(ForwardRow(state.request_id, state.cached, tuple(tokens), plan, state.steer_delta,
                                   steering.layer if steering is not None and state.steer_delta is not None else None))
        if not rows:
            return
        started = time.perf_counter()
        if self._sampled_at is not None:
            self.stats.launch_gaps += 1
            self.stats.launch_gap_s += started - self._sampled_at
            self._sampled_at = None
        outputs = self._forward_isolated(rows)
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        # the forward is launched (on a GPU it runs now): announce the last step's mod-free samples
        # while it does — before the outputs below replace each request's newest forward
        self._announce_deferred()
        self.stats.forwards += 1
        for entry, row, out in zip(owners, rows, outputs):
            state = entry.state
            if isinstance(out, Exception):
                state.fail(f"the forward pass failed: {type(out).__name__}: {out}")
                continue
            state.output = out
            state.cached = row.start + len(row.tokens)
            if not state.prefilled:
                state.prefill_ms = elapsed_ms
            self._guard(entry, lambda e=entry, r=row: e.rules.report_forward(r.start, r.tokens))

    def _forward_isolated(self, rows: list[ForwardRow]) -> list[RowOutput | Exception]:
        try:
            return list(self.backend.forward(rows))
        except Exception as err:
            if len(rows) == 1:
                return [err]
        outputs: list[RowOutput | Exception] = []
        for row in rows:  # find the row at fault; the others go on
            try:
                outputs.append(self.backend.forward([row])[0])
            except Exception as err:
                outputs.append(err)
        return outputs

    def _forward_pass(self, entry: Entry) -> StepPlan:
        rules = entry.rules
        rules.begin_step()
        return rules.apply_forward_pass(rules.dispatch(rules.forward_event()))

    def _sample(self, entries: list[Entry], plans: dict[int, StepPlan]) -> dict[int, SampleResult]:
        if not entries:
            return {}
        rows = []
        for entry in entries:
            state, plan = entry.state, plans[id(entry)]
            params = plan.sampling or state.request.sampling
            rows.append(SampleRow(plan.logits if plan.logits is not None else state.output.logits,  # type: ignore
                                  params, state.generator, state.tokens if params.needs_history else None,
                                  state.request.logprobs))
        try:
            results = sample_rows(rows)
        except Exception:  # one row's logits are unusable: sample row by row to find it
            results = []
            for entry, row in zip(entries, rows):
                try:
                    results.append(sample_rows([row])[0])
                except Exception as err:
                    entry.state.fail(f"sampling failed: {type(err).__name__}: {err}")
                    results.append(None)  # type: ignore[arg-type]
        return {id(e): r for e, r in zip(entries, results) if r is not None}

    def _finish_step(self, entry: Entry, plan: StepPlan, sampled: SampleResult | None) -> None:
        state, rules = entry.state, entry.rules
        if sampled is not None and state.finish is None and self.defer_announcements \
                and rules.can_defer_announcements():
            step = state.step
            rules.take_sample(sampled)
            rules.end_step(self.backend.max_sequence)
            if state.finish is None:
                self._deferred.append((entry, step, sampled))
            else:  # it leaves the batch now: nothing to overlap
                rules.announce_sample(step, sampled)
            return
        attention = None
        if sampled is not None:
            if state.finish is not None:
                return
            plan = rules.apply_sampled(rules.dispatch(Sampled(state.request_id, state.step, sampled.token)))
            if state.request.attention_all_layers:
                attention = _attention_rows(state)
        if state.finish is None:
            rules.add_step_tokens(plan, sampled, attention)
        rules.end_step(self.backend.max_sequence)

    def _announce_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for entry, step, sampled in deferred:
            self._guard(entry, lambda e=entry, s=step, t=sampled: e.rules.announce_sample(s, t))
        self.stats.deferred_announcements += len(deferred)

    def _retire(self) -> None:
        """Finished requests leave the batch; their results are built off the loop thread."""
        done = [e for e in self._active if e.state.finish is not None]
        if not done:
            return
        self._active = [e for e in self._active if e.state.finish is None]
        for entry in done:
            try:
                self.backend.release(entry.state.request_id)
            except Exception:
                log.exception("could not release the slot of %s", entry.state.request_id)
            if entry.state.hidden_sink is not None:
                self._guard(entry, lambda e=entry: e.state.hidden_sink.finish(e.state.request_id))
            entry.handle.end()
            self._finisher.submit(self._complete, entry)
        with self._cond:
            self._cond.notify_all()

    def _complete(self, entry: Entry) -> None:
        try:
            entry.handle.set_result(entry.finalize(entry))
        except BaseException as err:  # the caller gets the error instead of a result
            log.exception("could not build the result of %s", entry.state.request_id)
            entry.handle.set_exception(err)


def _attention_rows(state: RequestState) -> np.ndarray:
    """``(layers, heads, context)`` float32 host copy of the newest attention row of every layer."""
    attention = state.output.captured.attention  # type: ignore[union-attr]
    rows = [attention[layer][:, -1, :] for layer in sorted(attention)]
    return torch.stack(rows).float().cpu().numpy()
