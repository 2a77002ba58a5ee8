"""The step loop: one thread, one model, many requests — continuous batching with a token budget.

::

    submit ─► the scheduler's wait queue (bounded: back-pressure)
    step:  scheduler.schedule()   which requests feed which tokens, over which KV blocks
           → runner.execute()     one batched forward (a fault is traced to its row)
           → scheduler.update()   KV and prefix index recorded; each request takes its row
           → each ready request's forward_calls(): ForwardPass, its mods' calls (one round for all)
             → after_forward(): their actions, what to sample
             (a row of logits a mod handed back is checked once every request's ForwardPass
             actions are applied, just before the draw: settle())
           → one batched sample (one host read) → each one's on_sample(): Sampled → add → Added
             (the mods of every request see a phase's events together, a round at a time, their
             calls made on this thread; a request whose Sampled and Added nobody hears ends its
             step with on_sample_now(), no phase)
           → scheduler.retire()   finished requests leave; their results are built off this thread

The loop only calls those, in that order; it reads no request's state. What one request does —
its phases, its mods' actions, when it announces — is its state machine's
(:class:`~engine.core.machine.RequestMachine`; the rules are ``docs/generation-rules.md``); what
runs when and over which blocks is the scheduler's (:mod:`engine.core.scheduler`). A fault in one
request (a mod's bad action, an input that cannot fit, a failed forward of its own rows) ends that
request alone with finish reason ``error``; a cancelled one leaves at the next step, mid-prefill
too. A mod call past its time limit is abandoned with the thread it runs on, and a new loop thread
drives the step on (:mod:`engine.core.loop_calls`). Results are built off the loop thread
(decoding, payloads, ingest delivery), so a slow ingest backend never stalls the batch.

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
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Generator, Iterator, Sequence

from engine.core.jobs import Job, JobHandle
from engine.core.kv_manager import KVManager
from engine.core.loop_calls import LoopAbandoned, LoopCalls
from engine.core.machine import RequestMachine, Unsettled
from engine.core.phases import Round, drive, run_guarded
from engine.core.scheduler import Entry, LoopStats, Scheduler, SchedulerOutput
from engine.errors import EngineClosedError, QueueFullError
from engine.model.backend import Backend, ForwardBatch, ForwardRow, RowOutput
from engine.model.capture import CapturePlan
from engine.model.openmp import release_thread_team
from engine.model.sampling import SampleResult, SampleRow, sample_rows
from mods.event_guard import forget_decisions
from mods.manager import PendingCall

__all__ = ["StepLoop", "Entry", "LoopStats"]

log = logging.getLogger("raylens.step_loop")

Step = Generator[Round, None, None]  # a step: yields each round of mod calls, resumed once they are made

# one loop per backend: its KV pool and its forward belong to one thread. A plain dict: the loop holds
# its backend, so a weak key would never die; a loop leaves it when it closes
_LOOPS: dict[Any, "StepLoop"] = {}
_LOOPS_LOCK = threading.Lock()


class StepLoop:
    """One per backend (:meth:`for_backend`): every Engine over the same model shares it."""

    def __init__(self, backend: Backend, *, max_waiting: int, finisher_threads: int = 4) -> None:
        self.runner = backend
        self.max_waiting = max_waiting
        self.stats = LoopStats()
        config = backend.config
        rows_mb = getattr(config, "prefix_cache_rows_mb", None)
        kv = KVManager(backend.kv_layout, rows_budget=None if rows_mb is None else rows_mb * 2**20)
        device = getattr(backend, "device", None)
        # only a device that runs the forward asynchronously has anything to overlap; on a CPU the
        # forward runs in this thread, so holding would only delay each streamed token by a step
        self.scheduler = Scheduler(kv, max_batch=backend.max_batch, max_step_tokens=config.max_step_tokens,
                                   max_sequence=backend.max_sequence, stats=self.stats,
                                   overlap=getattr(device, "type", None) == "cuda")
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._finisher = ThreadPoolExecutor(max_workers=finisher_threads, thread_name_prefix="raylens-finish")
        self._held: list[Entry] = []  # requests whose last step's announcements wait for the next launch
        self._calls: list[tuple[Callable[["StepLoop"], Any], Future]] = []  # work run between steps
        self._jobs: collections.deque[Job] = collections.deque()  # embeddings, scoring, captures: a unit a step
        self._sampled_at: float | None = None
        # every request's mod calls, a round of a step's phase at a time, made on the loop's thread
        self.mod_calls = LoopCalls(self._take_over)
        self.scheduler.mod_calls = self.mod_calls
        self._stepping: Step | None = None  # the step being driven (a new loop thread drives it on)

    @classmethod
    def for_backend(cls, backend: Backend) -> "StepLoop":
        """The backend's loop, created on first use (or again after it was closed)."""
        with _LOOPS_LOCK:
            loop = _LOOPS.get(backend)
            if loop is None or loop._closing:
                loop = _LOOPS[backend] = cls(backend, max_waiting=backend.config.max_waiting)
            return loop

    @property
    def backend(self) -> Backend:
        return self.runner

    @property
    def defer_announcements(self) -> bool:
        """Whether requests admitted from now on may hold their announcements for the next launch."""
        return self.scheduler.overlap

    @defer_announcements.setter
    def defer_announcements(self, value: bool) -> None:
        self.scheduler.overlap = value

    # ---------------------------------------------------------------------------- callers' side

    def submit(self, entry: Entry, *, block: bool = True, timeout: float | None = None) -> None:
        """Queue ``entry``; with no room, wait (``block``) or raise :class:`QueueFullError`."""
        self._hand_over_cpu()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closing:
                    raise EngineClosedError("the engine is closed; create a new one")
                if self.scheduler.room(self.max_waiting) > 0:
                    break
                if not block:
                    raise QueueFullError(f"{len(self.scheduler.running)} requests are running and "
                                         f"{len(self.scheduler.waiting)} waiting (backend.max_waiting = "
                                         f"{self.max_waiting}); retry later")
                self.stats.waits_for_room += 1
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise QueueFullError("no room in the request queue within the timeout; retry later")
                self._cond.wait(left)
            self.scheduler.add(entry)
            self._ensure_thread()
            self._cond.notify_all()

    def submit_job(self, job: Job) -> JobHandle:
        """Queue a job (:mod:`engine.core.jobs`): the loop runs one unit of it per step, between
        its forwards, until it ends, is cancelled or passes its deadline."""
        self._hand_over_cpu()
        with self._cond:
            if self._closing:
                raise EngineClosedError("the engine is closed; create a new one")
            self._jobs.append(job)
            self._ensure_thread()
            self._cond.notify_all()
        return job.handle

    def call(self, fn: Callable[["StepLoop"], Any], timeout: float | None = None) -> Any:
        """Run ``fn(loop)`` on the loop's thread between two steps and return what it returns
        (one-off forwards share the KV pool with the running requests, so they run where the
        pool's blocks are handed out)."""
        if threading.current_thread() is self._thread:
            return fn(self)
        self._hand_over_cpu()
        future: Future = Future()
        with self._cond:
            if self._closing:
                raise EngineClosedError("the engine is closed; create a new one")
            self._calls.append((fn, future))
            self._ensure_thread()
            self._cond.notify_all()
        return future.result(timeout)

    def _hand_over_cpu(self) -> None:
        """A thread handing work to the loop gives back the OpenMP workers it kept from its own
        torch work (loading the model, a warm-up, a baseline run): while they live, libgomp makes
        every parallel op of the loop's forward wake its workers from sleep (engine/model/openmp.py)."""
        if threading.current_thread() is not self._thread:
            release_thread_team()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="raylens-step-loop", daemon=True)
            self.mod_calls.own(self._thread)
            self._thread.start()

    def _take_over(self, calls: Sequence[PendingCall], start: int) -> threading.Thread:
        """A new loop thread, started: the one driving the loop was abandoned in ``calls[start - 1]``
        (past its time limit); this one makes ``calls[start:]``, drives the step they belong to on,
        then serves as the loop (:mod:`engine.core.loop_calls`)."""
        step = self._stepping
        assert step is not None  # internal invariant: calls run only while a step is driven
        thread = threading.Thread(target=self._run, args=((step, calls, start),), name="raylens-step-loop",
                                  daemon=True)
        self._thread = thread
        thread.start()
        return thread

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
            waiting = self.scheduler.take_waiting()
            calls, self._calls = self._calls, []
            jobs, self._jobs = list(self._jobs), collections.deque()
            for entry in self.scheduler.running:
                entry.handle.cancel()
            self._cond.notify_all()
        for entry in waiting:
            entry.handle.set_exception(EngineClosedError("the engine was closed before this request started"))
        for _, future in calls:
            future.set_exception(EngineClosedError("the engine was closed before this call ran"))
        for job in jobs:  # the loop thread runs no more units: stop each where it is
            job.close()
            job.handle.future.set_exception(EngineClosedError(f"the engine was closed before the {job.handle.kind} "
                                                              "finished"))
        # the loop's thread, or the one that took over from it if a mod call of its got stuck
        deadline = time.monotonic() + timeout
        while (thread := self._thread) is not None and thread.is_alive() and time.monotonic() < deadline:
            thread.join(min(0.1, max(0.0, deadline - time.monotonic())))
        self._finisher.shutdown(wait=True)
        self.mod_calls.close()
        # an entry left behind would keep the backend, its KV pool and this loop alive for good
        with _LOOPS_LOCK:
            if _LOOPS.get(self.runner) is self:
                del _LOOPS[self.runner]

    def forward_prompt(self, input_ids: Sequence[int], plan: CapturePlan, timeout: float | None = None) -> RowOutput:
        """One prefill-shaped forward of ``input_ids`` over blocks of its own (freed afterwards),
        capturing what ``plan`` asks for every position; run between two steps."""
        def run(loop: "StepLoop") -> RowOutput:
            kv = loop.scheduler.kv
            request_id = f"raylens-probe-{uuid.uuid4().hex[:12]}"
            kv.add(request_id)
            try:
                if not kv.reserve(request_id, len(input_ids)):
                    raise QueueFullError("the KV cache's blocks are all reserved by running requests; retry later, "
                                         "or raise backend.kv_cache_tokens")
                table = kv.prepare(request_id, 0, len(input_ids))
                row = ForwardRow(request_id, 0, tuple(input_ids), plan, table=table)
                return loop.runner.execute(ForwardBatch((row,), kv.num_blocks, kv.take_copies())).rows()[0]
            finally:
                kv.remove(request_id)
        return self.call(run, timeout)

    @property
    def waiting(self) -> int:
        """Requests queued and not yet admitted (the metrics' ``num_requests_waiting``)."""
        return len(self.scheduler.waiting)

    @property
    def jobs_waiting(self) -> int:
        """Scheduled jobs not finished yet."""
        return len(self._jobs)

    @property
    def active(self) -> int:
        return len(self.scheduler.running)

    def cache_stats(self) -> dict[str, Any]:
        """The KV cache's blocks used and free and the prefix cache's hit rate."""
        return self.scheduler.cache_stats()

    # ------------------------------------------------------------------------------- the loop

    def _run(self, resumed: tuple[Step, Sequence[PendingCall], int] | None = None) -> None:
        """The loop thread's body. ``resumed``: the step an abandoned loop thread left in the middle
        of a round of calls (:meth:`_take_over`), driven on first."""
        try:
            if resumed is not None:
                self._guarded(*resumed)
            self._serve()
        except LoopAbandoned:  # a call made on this thread overran its limit: another thread is the loop now
            return

    def _serve(self) -> None:
        holds_team = False  # this thread's torch work since it last gave back its OpenMP workers
        while True:
            with self._cond:
                while not self.scheduler.has_work and not self._calls and not self._jobs and not self._closing:
                    self._sampled_at = None  # idle time is no launch gap
                    if holds_team:
                        # an idle loop keeps no team: while it did, libgomp made every parallel op of
                        # the process's other threads (another engine's loop, the caller's own torch
                        # work) wake its workers from sleep, small ones ~8x slower on two cores
                        # (engine/model/openmp.py); the next step makes a new team
                        holds_team = False
                        self._cond.release()  # submitters need not wait for the workers to stop
                        try:
                            release_thread_team()
                        finally:
                            self._cond.acquire()
                        continue
                    self._cond.wait()
                if self._closing and not self.scheduler.running and not self._calls:
                    return
                job = self._jobs[0] if self._jobs else None
                calls, self._calls = self._calls, []
                if self.scheduler.admit():
                    self._cond.notify_all()  # room in the queue for blocked submitters
            holds_team = True
            for fn, future in calls:
                try:
                    future.set_result(fn(self))
                except BaseException as err:  # the caller gets it
                    future.set_exception(err)
            if job is not None:
                self._run_job(job)
            if self.scheduler.has_work:
                self._guarded(self._step())

    def _guarded(self, step: Step, calls: Sequence[PendingCall] | None = None, start: int = 0) -> None:
        """Drive ``step`` to its end (from ``calls[start:]``, a round left unfinished); a bug in the
        loop itself fails what the loop held, and the loop goes on serving."""
        try:
            self._drive(step, calls, start)
        except Exception as err:
            log.exception("step failed; ending the requests it held")
            self._flush_held()
            for entry in self.scheduler.running:
                entry.machine.fail(f"internal error in the step loop: {type(err).__name__}: {err}")
            self._retire()

    def _drive(self, step: Step, calls: Sequence[PendingCall] | None, start: int) -> None:
        """Run ``step``, making each round's mod calls on this thread as it yields them."""
        self._stepping = step  # (left as it is when this thread is abandoned: the new one set its own)
        try:
            if calls is not None:
                self.mod_calls.run(calls, start)
                batch = step.send(None)
            else:
                batch = next(step)
            while True:
                self.mod_calls.run([pending for _, pendings in batch for pending in pendings])
                batch = step.send(None)
        except StopIteration:
            pass
        self._stepping = None

    def _run_job(self, job: Job) -> None:
        """One unit of the oldest job; jobs take turns (a long one goes to the back after each)."""
        stopped, before = job.stop_reason() is not None, job.units
        ended = job.run_unit(self)
        self.stats.jobs_stopped += stopped
        self.stats.job_units += job.units - before
        with self._cond:
            if self._jobs and self._jobs[0] is job:
                self._jobs.popleft()
                if not ended:
                    self._jobs.append(job)

    def _step(self) -> Step:
        """One step; a generator that yields each round of mod calls its phases wait on (made by
        :meth:`_drive`, whichever thread that is)."""
        forget_decisions()  # each step reads the mods' guards afresh (a caller may have rebound their names)
        output = self.scheduler.schedule()
        if output:
            self._forward(output)
        self._flush_held()  # when no forward ran
        due = [e.machine for e in self.scheduler.running if e.machine.prefilled_due]
        if due:  # every prompt that came in this step: Prefilled in one round, before any ForwardPass
            yield from drive([(m, m.prefilled()) for m in due])
        now = time.time()  # the step's events' time
        ready = [e for e in self.scheduler.running if e.machine.ready]
        fast = [e for e in ready if e.machine.fast]  # nobody watches them step by step
        watched = [e for e in ready if not e.machine.fast]
        rows = [run_guarded(e.machine, e.machine.fast_step, now) for e in fast]
        rows += yield from self._forward_pass([e.machine for e in watched])
        # a row whose mod handed its logits back is checked now, every phase applied
        rows = [run_guarded(e.machine, e.machine.settle, row) if type(row) is Unsettled else row
                for e, row in zip(fast + watched, rows)]
        sampling = [(e, row) for e, row in zip(fast + watched, rows) if row is not None and not e.machine.finished]
        samples = self._sample(sampling)
        self._sampled_at = time.perf_counter() if sampling else None
        split = sum(1 for e, _ in sampling if e.machine.fast)  # the fast ones come first
        for (entry, _), sample in zip(sampling[:split], samples[:split]):
            if run_guarded(entry.machine, entry.machine.fast_sample, sample, now):
                self._held.append(entry)
        driven = []  # those whose Sampled or Added someone hears: a phase each, driven together
        for (entry, _), sample in zip(sampling[split:], samples[split:]):
            machine = entry.machine
            hold = run_guarded(machine, machine.on_sample_now, sample) if sample is not None else None
            if sample is None or (hold is None and not machine.finished):  # (a fault there failed it)
                driven.append((entry, sample))
            elif hold:
                self._held.append(entry)
        held = yield from drive([(e.machine, e.machine.on_sample(s)) for e, s in driven])
        self._held += [e for (e, _), hold in zip(driven, held) if hold]
        self.stats.steps += 1
        self._retire()

    # --------------------------------------------------------------------------- step parts

    def _forward_pass(self, machines: list[RequestMachine]) -> Generator[Round, None, list[Any]]:
        """The ForwardPass of every watched request: each makes and records its event, their mods'
        calls go out in one round, and each applies what its own did; the rows to sample (None for
        a request that samples nothing this step: it ended, or it adds forced or reinjected tokens,
        driven as a phase here)."""
        pending = [run_guarded(m, m.forward_calls) for m in machines]
        round_ = [(m.manager, calls) for m, calls in zip(machines, pending) if calls]
        if round_:
            yield round_
        rows = [run_guarded(m, m.after_forward, calls) if calls is not None else None
                for m, calls in zip(machines, pending)]
        adding = [m for m, row in zip(machines, rows) if row is None and m.adds_without_sample]
        if adding:
            yield from drive([(m, m.add_without_sample()) for m in adding])
        return rows

    def _forward(self, output: SchedulerOutput) -> None:
        """One forward for every row the scheduler planned; each request takes its row."""
        started = time.perf_counter()
        if self._sampled_at is not None:
            self.stats.launch_gaps += 1
            self.stats.launch_gap_s += started - self._sampled_at
            self._sampled_at = None
        results = self._execute_isolated(output)
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        # the forward is launched (on a GPU it runs now): announce what the last step held while
        # it does — before the outputs below replace each request's newest forward
        self._flush_held()
        self.scheduler.update(output, results, elapsed_ms)

    def _execute_isolated(self, output: SchedulerOutput) -> Sequence[RowOutput | Exception]:
        batch = output.batch
        try:
            return self.runner.execute(batch).rows()
        except Exception as err:
            if len(batch.rows) == 1:
                return [err]
        results: list[RowOutput | Exception] = []
        for i in range(len(batch.rows)):  # find the row at fault; the others go on
            try:
                results.append(self.runner.execute(batch.only(i)).rows()[0])
            except Exception as err:
                results.append(err)
        return results

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
            if run_guarded(entry.machine, entry.machine.flush):
                self.stats.deferred_announcements += 1

    def _retire(self) -> None:
        """Finished requests leave the batch; their results are built off the loop thread."""
        done = self.scheduler.retire()
        if not done:
            return
        for entry in done:
            run_guarded(entry.machine, entry.machine.retire)
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
