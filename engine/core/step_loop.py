"""The step loop: one thread, one model, many requests — continuous batching with a token budget.

::

    submit ─► wait queue (bounded: back-pressure) ─► admitted between steps, up to max_batch and
           while the KV cache can reserve their tokens (prompt + max_tokens)
    step:  the scheduler gives each running request its tokens for this step (decoding ones one
           each, prompts chunks of the rest of backend.max_step_tokens); a prompt given tokens
           for the first time first reuses its longest cached prefix (keys/values and captured
           internals) and is planned again with only the rest
           → one backend.forward for every scheduled row → each request's on_forward
           → each ready request's step(): ForwardPass → its mods → what to sample
           → one batched sample (one host read) → each one's on_sample(): Sampled → add → Added
           → finished requests leave; their slots go to the next waiting ones

The loop admits, schedules, batches, isolates faults and retires; everything about one request —
its phases, its mods' actions, when it announces — is its state machine's
(:class:`~engine.core.machine.RequestMachine`; the rules are ``docs/generation-rules.md``). The
batch owns only tensors. A fault in one request (a mod's bad action, an input that cannot fit, a
failed forward of its own rows) ends that request alone with finish reason ``error``; a cancelled
one leaves at the next step, mid-prefill too. Results are built off the loop thread (decoding,
payloads, ingest delivery), so a slow ingest backend never stalls the batch.

On a GPU the device idles from the sampled ids' host read until the next forward is launched, so
that gap holds only what the next forward depends on: a machine may hold its step's announcements
(``on_sample`` returns True) and the loop flushes them right after the next launch. On a CPU the
forward runs in the loop's thread, so there is nothing to overlap and nothing is held.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from engine.core.machine import RequestMachine
from engine.core.request import RequestState
from engine.core.scheduler import Scheduler
from engine.core.stream import RequestHandle
from engine.errors import EngineClosedError, QueueFullError
from engine.model.backend import Backend, ForwardRow, RowOutput
from engine.model.sampling import SampleResult, SampleRow, sample_rows

__all__ = ["StepLoop", "Entry", "LoopStats"]

log = logging.getLogger("raylens.step_loop")


@dataclass
class Entry:
    """One submitted request as the loop holds it; ``finalize`` builds its result once it left the
    batch (each Engine sharing the loop brings its own: its store, SAE recorder and ingest)."""

    state: RequestState
    machine: RequestMachine
    handle: RequestHandle
    finalize: Callable[["Entry"], Any]
    prefix_checked: bool = False  # the prefix cache was asked (once, just before its first forward)


@dataclass
class LoopStats:
    steps: int = 0
    forwards: int = 0
    tokens_fed: int = 0  # tokens every forward fed, prompts' included
    prefill_chunks: int = 0  # forwards that fed part of a feed too long for one step's budget
    max_active: int = 0
    waits_for_room: int = 0  # submits that waited for a free place (back-pressure)
    waits_for_blocks: int = 0  # admissions and feeds deferred until the KV cache had room
    deferred_announcements: int = 0  # steps announced after the next forward's launch
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
        self.scheduler = Scheduler(max_batch=backend.max_batch,
                                   max_step_tokens=backend.config.max_step_tokens)
        self._waiting: collections.deque[Entry] = collections.deque()
        self._active: list[Entry] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._finisher = ThreadPoolExecutor(max_workers=finisher_threads, thread_name_prefix="raylens-finish")
        self.stats = LoopStats()
        self._held: list[Entry] = []  # requests whose last step's announcements wait for the next launch
        self._sampled_at: float | None = None
        # only a device that runs the forward asynchronously has anything to overlap; on a CPU the
        # forward runs in this thread, so holding would only delay each streamed token by a step
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

    @contextlib.contextmanager
    def admission_held(self) -> Iterator[None]:
        """Requests submitted inside this block wait and are admitted together, in one step, when it
        ends: the same batches every time, so two runs can be compared number for number (a
        left-padded batch of other prompts rounds float32 differently) and benchmarks start their
        requests at once. Submitting with ``block=True`` past the queue's room inside it would
        wait forever: keep what it holds within ``max_waiting``."""
        with self._cond:
            yield

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

    @property
    def waiting(self) -> int:
        """Requests queued and not yet admitted (the metrics' ``num_requests_waiting``)."""
        return len(self._waiting)

    # ------------------------------------------------------------------------------- the loop

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._waiting and not self._closing:
                    self._sampled_at = None  # idle time is no launch gap
                    self._cond.wait()
                if self._closing and not self._active:
                    return
                new = self.scheduler.admit(self._waiting, len(self._active), self._fits)
                if new:
                    self._cond.notify_all()  # room in the queue for blocked submitters
            try:
                self._step(new)
            except Exception as err:  # a bug in the loop itself: fail what it held, keep serving
                log.exception("step failed; ending the requests it held")
                self._flush_held()
                for entry in self._active + [e for e in new if e not in self._active]:
                    entry.machine.fail(f"internal error in the step loop: {type(err).__name__}: {err}")
                self._retire()

    def _guard(self, entry: Entry, fn: Callable[[], Any]) -> Any:
        """Run one request's part of the step; a fault ends that request alone."""
        try:
            return fn()
        except Exception as err:
            log.warning("request %s failed: %s: %s", entry.machine.request_id, type(err).__name__, err)
            entry.machine.fail(f"{type(err).__name__}: {err}")
            return None

    def _fits(self, entry: Entry, alone: bool) -> bool:
        """Admission: the request gets its block table and reserves the tokens it may use
        (``prompt + max_tokens``); False leaves it waiting. Alone it is admitted anyway: it
        reserves more as it grows (:meth:`_forward`)."""
        backend, machine = self.backend, entry.machine
        if self._guard(entry, lambda: backend.acquire(machine.request_id) or True) is None:
            return True  # failed: admitted only to leave with its error
        reserve = getattr(backend, "reserve", None)
        state = machine.state
        want = min(len(state.prompt_ids) + state.max_tokens, backend.max_sequence)
        if reserve is None or reserve(machine.request_id, want):
            return True
        if alone:  # more than the whole pool: it reserves its prompt now and the rest as it grows
            reserve(machine.request_id, len(state.prompt_ids) + 1)
            return True
        backend.release(machine.request_id)
        self.stats.waits_for_blocks += 1
        return False

    def _reuse_prefix(self, entry: Entry) -> None:
        """A request about to feed for the first time starts from the longest cached prefix of its
        prompt, when its flag (else ``backend.prefix_caching``) allows and no steer changes its
        keys/values. Asked this late — not at admission — so a prompt queued behind another
        one's chunked prefill of the same prefix finds the blocks that one has finished."""
        entry.prefix_checked = True
        reuse = getattr(self.backend, "reuse_prefix", None)
        state = entry.machine.state
        if reuse is None or state.finish is not None or state.steer_delta is not None:
            return
        flag = getattr(state.request.source, "prefix_cache", None)
        if not (flag if flag is not None else getattr(self.backend.config, "prefix_caching", False)):
            return
        hit = reuse(state.request_id, state.prompt_ids, state.plan.with_all_query_rows(True))
        if hit is not None:
            entry.machine.reuse_prefix(*hit)

    def _step(self, new: list[Entry]) -> None:
        for entry in new:
            entry.machine.start(max_sequence=self.backend.max_sequence, overlap=self.defer_announcements)
            self._active.append(entry)
        for entry in self._active:
            if entry.handle.cancel_requested:
                entry.machine.cancel()
        running = [e for e in self._active if not e.machine.finished]
        self._forward(running)
        self._flush_held()  # when no forward ran
        sampling: list[tuple[Entry, SampleRow]] = []
        for entry in running:
            if entry.machine.ready:
                row = self._guard(entry, entry.machine.step)
                if row is not None and not entry.machine.finished:
                    sampling.append((entry, row))
        samples = self._sample(sampling)
        self._sampled_at = time.perf_counter() if sampling else None
        for (entry, _), sample in zip(sampling, samples):
            if self._guard(entry, lambda m=entry.machine, s=sample: m.on_sample(s)):
                self._held.append(entry)
        self.stats.steps += 1
        self.stats.max_active = max(self.stats.max_active, len(self._active))
        self._retire()

    # --------------------------------------------------------------------------- step parts

    def _forward(self, running: list[Entry]) -> None:
        """One forward for every running request the scheduler gives tokens this step."""
        owners, rows, starved = [], [], []
        reserve = getattr(self.backend, "reserve", None)
        machines = [e.machine for e in running]
        plan = self.scheduler.schedule(machines)
        while fresh := [running[i] for i, _ in plan if not running[i].prefix_checked]:
            for entry in fresh:  # reused prefixes shrink what these need: plan the budget again
                self._guard(entry, lambda e=entry: self._reuse_prefix(e))
            plan = self.scheduler.schedule(machines)
        for i, allowance in plan:
            entry = running[i]
            row = self._guard(entry, lambda m=entry.machine, n=allowance: m.next_forward(n))
            if row is None:
                continue
            if reserve is not None and not reserve(row.request_id, row.start + len(row.tokens)):
                starved.append(entry)  # outgrew its reservation: waits for blocks to free
                continue
            owners.append(entry)
            rows.append(row)
        self.stats.waits_for_blocks += len(starved)
        if starved and not rows:  # nothing runs that could free a block: the newest gives way
            starved[-1].machine.fail("the KV cache cannot hold this request next to the running ones (it outgrew "
                                     "its reserved prompt + max_tokens); raise backend.kv_cache_tokens")
        if not rows:
            return
        started = time.perf_counter()
        if self._sampled_at is not None:
            self.stats.launch_gaps += 1
            self.stats.launch_gap_s += started - self._sampled_at
            self._sampled_at = None
        outputs = self._forward_isolated(rows)
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        # the forward is launched (on a GPU it runs now): announce what the last step held while
        # it does — before the outputs below replace each request's newest forward
        self._flush_held()
        self.stats.forwards += 1
        for entry, row, out in zip(owners, rows, outputs):
            if isinstance(out, Exception):
                entry.machine.fail(f"the forward pass failed: {type(out).__name__}: {out}")
                continue
            if self._guard(entry, lambda m=entry.machine, r=row, o=out: m.on_forward(r, o, elapsed_ms)) is False:
                self.stats.prefill_chunks += 1
            self.stats.tokens_fed += len(row.tokens)

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

    def _sample(self, sampling: list[tuple[Entry, SampleRow]]) -> list[SampleResult | None]:
        """One batched draw for every row that samples; a row whose draw fails fails its request."""
        if not sampling:
            return []
        try:
            return list(sample_rows([row for _, row in sampling]))
        except Exception:  # one row's logits are unusable: sample row by row to find it
            results: list[SampleResult | None] = []
            for entry, row in sampling:
                try:
                    results.append(sample_rows([row])[0])
                except Exception as err:
                    entry.machine.fail(f"sampling failed: {type(err).__name__}: {err}")
                    results.append(None)
            return results

    def _flush_held(self) -> None:
        held, self._held = self._held, []
        for entry in held:
            if self._guard(entry, entry.machine.flush):
                self.stats.deferred_announcements += 1

    def _retire(self) -> None:
        """Finished requests leave the batch; their results are built off the loop thread."""
        done = [e for e in self._active if e.machine.finished]
        if not done:
            return
        self._active = [e for e in self._active if not e.machine.finished]
        for entry in done:
            try:
                self.backend.release(entry.machine.request_id)
            except Exception:
                log.exception("could not release the slot of %s", entry.machine.request_id)
            self._guard(entry, entry.machine.retire)
            entry.handle.end()
            self._finisher.submit(self._complete, entry)
        with self._cond:
            self._cond.notify_all()

    def _complete(self, entry: Entry) -> None:
        try:
            entry.handle.set_result(entry.finalize(entry))
        except BaseException as err:  # the caller gets the error instead of a result
            log.exception("could not build the result of %s", entry.machine.request_id)
            entry.handle.set_exception(err)

