"""The scheduler: it owns the waiting and running requests and the KV manager, and decides what
each step runs.

::

    add(entry) ─► waiting (arrival order)
    schedule():
        admit     free batch places (``max_batch``) are filled from the front of ``waiting`` while
                  the KV manager can reserve the tokens each may use (``prompt + max_tokens``);
                  the first that does not fit waits, and so does everyone behind it
        cancel    a request whose caller cancelled ends here, mid-prefill too
        budget    decoding requests first, one token each; a decoding request with more to feed
                  (forced tokens, a new prompt after AdjustedPrefill) takes what that left; prompts
                  being prefilled, in arrival order, take chunks of the rest of
                  ``max_step_tokens`` — a stream never waits for a prefill
        prefix    a prompt about to feed for the first time starts from its longest cached prefix
                  (asked this late, not at admission, so a prompt queued behind another one's
                  chunked prefill of the same prefix finds the blocks that one finished); the
                  budget is planned again with what the hits saved
        blocks    each row's table gets blocks up to its last position (copy-on-write, growth)
        ─► SchedulerOutput: the rows' requests and the runner's ForwardBatch
    update(output, row outputs): the KV manager records what each forward filled (the prefix
        index), each request takes its row (:meth:`RequestMachine.on_forward`)
    retire(): finished requests leave; their blocks go back to the pool

What the scheduler reads of a request is its machine's small scheduling interface
(``pending_tokens``, ``decoding``, ``finished``, ``next_forward``, ``reservation``,
``prefix_lookup``); everything else about a request is its machine's
(:class:`~engine.core.machine.RequestMachine`).
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from engine.core.kv_manager import KVManager
from engine.core.machine import RequestMachine
from engine.core.phases import run_guarded
from engine.core.stream import RequestHandle
from engine.errors import ConfigError
from engine.model.backend import ForwardBatch, RowOutput

__all__ = ["Scheduler", "SchedulerOutput", "Entry", "LoopStats", "plan_tokens"]

log = logging.getLogger("raylens.scheduler")


@dataclass(eq=False)
class Entry:
    """One submitted request as the step loop holds it: its machine, its handle, and
    ``finalize`` to build its result once it left the batch (each Engine sharing the loop brings
    its own: its store, SAE recorder and ingest)."""

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
    job_units: int = 0  # units of scheduled jobs (embeddings, scoring, captures) run
    jobs_stopped: int = 0  # jobs ended by their caller's cancel or their deadline before their last unit
    # host time from a step's sampled ids to the next forward's launch (the device idles then)
    launch_gaps: int = 0
    launch_gap_s: float = 0.0

    @property
    def mean_launch_gap_ms(self) -> float:
        return 1000.0 * self.launch_gap_s / self.launch_gaps if self.launch_gaps else 0.0


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: ``entries[i]`` owns ``batch.rows[i]``."""

    entries: tuple[Entry, ...]
    batch: ForwardBatch = field(default_factory=lambda: ForwardBatch(()))

    def __bool__(self) -> bool:
        return bool(self.entries)


def plan_tokens(needs: Sequence[tuple[bool, int]], max_step_tokens: int) -> list[tuple[int, int]]:
    """``(index, tokens it may feed now)`` for every ``(decoding, pending tokens)`` with something
    to feed, decoding ones first (one token each reserved, then what the budget leaves), then
    prompts in order, within ``max_step_tokens``."""
    decoding: list[tuple[int, int]] = []
    prefilling: list[tuple[int, int]] = []
    for i, (is_decoding, need) in enumerate(needs):
        if need:
            (decoding if is_decoding else prefilling).append((i, need))
    left = max_step_tokens - len(decoding)  # one token reserved for each decoding row
    out: list[tuple[int, int]] = []
    for i, need in decoding:
        extra = min(need - 1, max(0, left))
        left -= extra
        out.append((i, 1 + extra))
    for i, need in prefilling:
        if left <= 0:
            break
        take = min(need, left)
        left -= take
        out.append((i, take))
    return out


class Scheduler:
    def __init__(self, kv: KVManager, *, max_batch: int, max_step_tokens: int, max_sequence: int,
                 stats: LoopStats | None = None, overlap: bool = False) -> None:
        """``overlap``: the device runs forwards asynchronously, so a request's announcements
        may wait for the next launch (:meth:`RequestMachine.flush`)."""
        if max_step_tokens < max_batch:
            raise ConfigError(f"`max_step_tokens` must be >= max_batch ({max_batch}), got {max_step_tokens}; "
                              f"raise backend.max_step_tokens or lower backend.max_batch",
                              parameter="backend.max_step_tokens", value=max_step_tokens)
        self.kv = kv
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens
        self.max_sequence = max_sequence
        self.stats = stats if stats is not None else LoopStats()
        self.overlap = overlap
        self.mod_calls: Any = None  # the loop's LoopCalls: admitted requests' Prefilled is then the loop's to drive
        self.waiting: collections.deque[Entry] = collections.deque()
        self.running: list[Entry] = []

    # ------------------------------------------------------------------------------ queues

    def add(self, entry: Entry) -> None:
        self.waiting.append(entry)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def room(self, max_waiting: int) -> int:
        """How many more requests may queue: free batch places plus ``max_waiting``."""
        return max_waiting + max(0, self.max_batch - len(self.running)) - len(self.waiting)

    def take_waiting(self) -> list[Entry]:
        waiting, self.waiting = list(self.waiting), collections.deque()
        return waiting

    # ------------------------------------------------------------------------------- a step

    def admit(self) -> list[Entry]:
        """Move requests from the front of the queue into the batch while places and KV
        reservations allow; the first that does not fit waits, and so does everyone behind it."""
        new: list[Entry] = []
        while self.waiting and len(self.running) < self.max_batch:
            entry = self.waiting[0]
            if not self._reserve(entry, alone=not self.running):
                break
            self.waiting.popleft()
            entry.machine.start(max_sequence=self.max_sequence, overlap=self.overlap, calls=self.mod_calls)
            self.running.append(entry)
            new.append(entry)
        self.stats.max_active = max(self.stats.max_active, len(self.running))
        return new

    def _reserve(self, entry: Entry, alone: bool) -> bool:
        """Admission: the request gets its block table and reserves the tokens it may use
        (``prompt + max_tokens``); False leaves it waiting. Alone it is admitted anyway: it
        reserves its prompt now and more as it grows (:meth:`schedule`)."""
        machine, kv = entry.machine, self.kv
        kv.add(machine.request_id)
        want, least = machine.reservation(self.max_sequence)
        if kv.reserve(machine.request_id, want):
            return True
        if alone:  # more than the whole pool: it reserves its prompt now and the rest as it grows
            kv.reserve(machine.request_id, least)
            return True
        kv.remove(machine.request_id)
        self.stats.waits_for_blocks += 1
        return False

    def schedule(self) -> SchedulerOutput:
        """The rows of this step's forward (see the module docstring)."""
        self.admit()
        for entry in self.running:
            if entry.handle.cancel_requested:
                entry.machine.cancel()
        live = [e for e in self.running if not e.machine.finished]
        plan = self._budget(live)
        while fresh := [live[i] for i, _ in plan if not live[i].prefix_checked]:
            for entry in fresh:  # reused prefixes shrink what these need: plan the budget again
                run_guarded(entry.machine, self._reuse_prefix, entry)
            plan = self._budget(live)
        entries, rows, starved = [], [], []
        kv = self.kv
        for i, allowance in plan:
            entry = live[i]
            machine = entry.machine
            feed = run_guarded(machine, machine.next_feed, allowance)
            if feed is None:
                continue
            start, tokens = feed
            if not kv.reserve(machine.request_id, start + len(tokens)):
                starved.append(entry)  # outgrew its reservation: waits for blocks to free
                continue
            table = run_guarded(machine, kv.prepare, machine.request_id, start, len(tokens))
            if table is None:
                continue
            entries.append(entry)
            rows.append(machine.forward_row(start, tokens, table))
        self.stats.waits_for_blocks += len(starved)
        if starved and not rows:  # nothing runs that could free a block: the newest gives way
            starved[-1].machine.fail("the KV cache cannot hold this request next to the running ones (it outgrew "
                                     "its reserved prompt + max_tokens); raise backend.kv_cache_tokens")
        return SchedulerOutput(tuple(entries), ForwardBatch(tuple(rows), kv.num_blocks, kv.take_copies()))

    def _budget(self, live: list[Entry]) -> list[tuple[int, int]]:
        return plan_tokens([(e.machine.decoding, e.machine.pending_tokens) for e in live], self.max_step_tokens)

    def _reuse_prefix(self, entry: Entry) -> None:
        entry.prefix_checked = True
        lookup = entry.machine.prefix_lookup()
        if lookup is None:
            return
        prompt, plan = lookup
        hit = self.kv.lookup(entry.machine.request_id, prompt, plan)
        if hit is not None:
            entry.machine.reuse_prefix(*hit)

    def update(self, output: SchedulerOutput, results: Sequence[RowOutput | Exception], forward_ms: float) -> None:
        """Each row's result: the KV manager records what its forward filled (and the prefix
        index what it captured), and its request takes it; a row whose forward failed fails its
        request alone."""
        stats, kv = self.stats, self.kv
        stats.forwards += 1
        for entry, row, out in zip(output.entries, output.batch.rows, results):
            machine = entry.machine
            if isinstance(out, Exception):
                machine.fail(f"the forward pass failed: {type(out).__name__}: {out}")
                continue
            kv.record(row.request_id, row.start, row.tokens, out.captured, row.steer is not None)
            if run_guarded(machine, machine.on_forward, row, out, forward_ms) is False:
                stats.prefill_chunks += 1
            stats.tokens_fed += len(row.tokens)

    def retire(self) -> list[Entry]:
        """Finished requests leave the batch; their blocks go back to the pool."""
        done = [e for e in self.running if e.machine.finished]
        if done:
            self.running = [e for e in self.running if not e.machine.finished]
            for entry in done:
                self.kv.remove(entry.machine.request_id)
        return done

    def cache_stats(self) -> dict[str, Any]:
        """Blocks used and free, and the prefix cache's hit rate (tokens reused / prompt tokens)."""
        return self.kv.as_dict()
