"""ModManager: calls every registered mod for an event and records what each call did.

Legacy code imports this module as ``quote.mods.manager``. Contract:

* every mod is called, in registration order, for every event — no short-circuit here; the
  generation loop decides which returned actions it processes. The one exception is a *fatal*
  call (below): its request cannot go on, so the mods after it are not called for that event.
  The engine's own step (:meth:`ModManager.calls_for`) leaves out, besides, a call that would
  return a Noop having done nothing: a mod whose handler begins with an ``isinstance`` guard that
  sends the event straight to ``return None`` (:mod:`mods.event_guard`);
* a mod's prints and log records are captured per call (see :mod:`mods.capture`);
* a mod exception, or a result the event does not allow, is recorded and becomes ``Noop`` —
  the one place an error is swallowed, and never without a record;
* ``dispatch`` returns one action per mod called, each tagged with ``_source`` (the mod's name)
  and, when it printed, ``_mod_logs``.

``dispatch_traced`` returns the full :class:`ModCall` records (timing, logs, exception) that
the ingest payload is built from. Unlike the original, which wrote per-request debug files to
``/tmp`` on every dispatch, nothing is written to disk.

Fatal calls. Many requests share the process (a generator serves a batch), so no mod may stop or
hang it:

* a call that does not return within ``call_timeout_s`` is abandoned and recorded as a
  :class:`ModCallTimeout` (``ModCall.timed_out``). Calls the manager makes itself run on a worker
  thread of its own, which waits with that limit (the engine's step loop makes its calls on its
  own thread, watched the same way: ``engine/core/loop_calls.py``); a thread stuck in a mod cannot
  be killed, so it is left running, renamed (:func:`abandoned_mod_threads` lists them) and
  replaced by a fresh one;
* a ``BaseException`` that is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``,
  ``GeneratorExit``) is recorded as the mod's exception like any other, never propagated.

Both set ``ModCall.fatal``: the engine ends that request with finish reason ``error``. With
``call_timeout_s`` None or 0 mods are called inline, on the caller's thread, with no limit; a real
Ctrl-C that lands inside a mod is then indistinguishable from the mod raising it, and is recorded.
"""

from __future__ import annotations

import contextvars
import logging
import math
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from .capture import CaptureBuffer, CapturedLog, _active, ensure_capture_installed
from .conversation import pop_request_context, push_request_context
from .event_guard import forget_decisions, turns_away, turns_away_all
from .types import ModAction, ModEvent, Noop
from .validation import InvalidActionError, validate_action

__all__ = ["ModManager", "ModCall", "ModCallTimeout", "ModException", "ModCallStats", "CallRunner",
           "PendingCall", "abandoned_mod_threads", "mod_name", "stack_of",
           "ABANDONED_THREAD_NAME"]

log = logging.getLogger("raylens.mods")

#: Name given to a worker thread once a call on it was abandoned.
ABANDONED_THREAD_NAME = "raylens-abandoned-mod-call"


class ModCallTimeout(TimeoutError):
    """A mod call did not return within the manager's limit. Unrecoverable for its request (the
    mod may be stuck for good, holding its state); the process and other requests are unaffected."""

    def __init__(self, mod: str, limit_s: float, event_type: str, step: int) -> None:
        super().__init__(f"mod {mod} did not return within {limit_s:g} s on {event_type} step {step}")
        self.mod = mod
        self.limit_s = limit_s
        self.event_type = event_type
        self.step = step


@dataclass(frozen=True)
class ModException:
    type: str
    message: str
    traceback: str


@dataclass(slots=True)
class ModCall:
    """What one mod did for one event (a record: read it, never change it). One is made per mod
    call, three a step per request, so it is a plain slotted dataclass: a frozen one's ``__init__``
    costs five times as much (1.3 µs against 0.25).

    ``fatal``: the request cannot go on; end it with finish reason ``error`` naming the mod and
    ``exception``. Set when the call timed out (``timed_out``) or raised a ``BaseException`` that is
    not an ``Exception``.
    """

    mod_name: str
    event_type: str
    step: int
    action: ModAction
    logs: tuple[CapturedLog, ...]
    started_at: float  # epoch seconds
    elapsed_ms: float
    exception: ModException | None = None
    rejected: ModAction | None = None  # what a raw mod returned that the event does not allow
    timed_out: bool = False
    fatal: bool = False

    @property
    def noteworthy(self) -> bool:
        """Worth a ``mod_calls`` row in the payload: it acted, printed, or failed."""
        return not isinstance(self.action, Noop) or bool(self.logs) or self.exception is not None


@dataclass
class ModCallStats:
    """Every call one manager made: how many, how many raised or timed out, and their seconds
    (what the engine's mod metrics add up)."""

    calls: int = 0
    errors: int = 0
    seconds: float = 0.0

    def count(self, elapsed_ms: float, *, failed: bool = False) -> None:
        """One call of ``elapsed_ms``, recorded or not (:meth:`ModManager.records`); ``failed``: it raised."""
        self.calls += 1
        self.errors += failed
        self.seconds += elapsed_ms / 1000.0


def mod_name(mod: Callable[..., Any]) -> str:
    return getattr(mod, "__name__", None) or type(mod).__name__


def abandoned_mod_threads() -> list[threading.Thread]:
    """Threads still running a mod call that was abandoned after its time limit. Each costs what
    its mod does (a spinning one takes CPU and GIL time), so a server may report them in its
    health check and restart when they pile up."""
    return [t for t in threading.enumerate() if t.name.startswith(ABANDONED_THREAD_NAME)]


def _safe_str(err: BaseException) -> str:
    try:
        return str(err)
    except Exception:
        return f"<{type(err).__name__} with an unprintable message>"


class _Pending:
    """One mod call: its inputs, and what it produced once it returned. ``after``: the call before
    it on the same event (a fatal one means this one is not made)."""

    __slots__ = ("mod", "event", "tokenizer", "buffer", "outcome", "after", "skipped", "timeout",
                 "started_at", "elapsed_ms", "stack")

    def __init__(self, mod: Callable[..., Any], event: ModEvent, tokenizer: Any, after: "_Pending | None" = None,
                 timeout: float | None = None) -> None:
        self.mod, self.event, self.tokenizer = mod, event, tokenizer
        self.buffer: CaptureBuffer | None = None
        self.outcome: tuple[ModAction, ModException | None, ModAction | None, bool] | None = None
        self.after, self.timeout, self.skipped = after, timeout, False
        self.started_at, self.elapsed_ms, self.stack = 0.0, 0.0, ""

    @property
    def name(self) -> str:
        """The mod's name (read only for a call that is recorded or abandoned: most are neither)."""
        return mod_name(self.mod)

    @property
    def action(self) -> ModAction | None:
        """What the call returned (None while it has not returned)."""
        return None if self.outcome is None else self.outcome[0]

    @property
    def quiet(self) -> bool:
        """It returned a Noop and printed, logged and raised nothing (an abandoned call is not)."""
        outcome = self.outcome
        return (outcome is not None and outcome[1] is None and isinstance(outcome[0], Noop)
                and self.buffer.empty)  # type: ignore[union-attr]

    def run(self) -> None:
        """Call the mod with its output captured; never raises (everything is recorded). Skipped
        when an earlier call on the same event was fatal."""
        ensure_capture_installed()
        try:
            self.call()
        finally:
            # the mod's code may have rebound what guards read: they are read afresh after it
            forget_decisions()

    def call(self) -> None:
        """:meth:`run` less what a round of calls needs only once: the check that the output
        capture is installed, before the round's first call, and the guards' reset after its last
        (its caller's). For a caller that makes a round of calls and reads no guard between them
        (the step loop's, engine/core/loop_calls.py): ~1.5 µs a call less at 64 concurrent
        requests with a logits mod."""
        after = self.after
        if after is not None and (after.skipped or after.outcome is None or after.outcome[3]):
            self.skipped = True
            return
        event = self.event
        exception: ModException | None = None
        rejected: ModAction | None = None
        fatal = False
        request_id = getattr(event, "request_id", None)
        buffer = self.buffer = CaptureBuffer()
        token = _active.set(buffer)
        context = push_request_context(request_id if isinstance(request_id, str) else None)
        self.started_at = time.time()
        t0 = time.perf_counter()
        try:
            result = self.mod(event, self.tokenizer)
            try:
                action = validate_action(event, result)
            except InvalidActionError:
                rejected = result if isinstance(result, ModAction) else None
                raise
        except BaseException as err:  # SystemExit & co. included: a mod never ends the process
            fatal = not isinstance(err, Exception)
            exception = ModException(type(err).__name__, _safe_str(err), traceback.format_exc())
            print(f"[mods] Mod raised exception on {type(event).__name__}: {exception.message}")
            action = Noop()
        finally:
            pop_request_context(context)
            _active.reset(token)
        self.elapsed_ms = (time.perf_counter() - t0) * 1000.0
        self.outcome = (action, exception, rejected, fatal)


#: The longest :meth:`CallRunner.close` waits for its worker to end (a call still running past that
#: is left to its time limit's abandonment).
CLOSE_WAIT_S = 1.0


class _Worker:
    """A daemon thread that runs the calls handed to it, in order, one at a time.

    Two raw locks are the hand-off (cheaper than a Queue or an Event): ``_go`` is released to
    start a batch of calls, ``_finished`` when the whole batch has returned. The caller sleeps
    until then (one wake-up per batch, not one per call, so the worker runs its calls without the
    caller taking the GIL back after each), waking earlier only to check a call's time limit:
    :attr:`running` says which call runs and since when. :meth:`stop` ends the thread after its
    current call, or at once when idle.
    """

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._finished = threading.Lock()
        self._batch: list[_Pending] = []
        self._context: contextvars.Context | None = None
        self._stopped = False
        self.running: tuple[int, float] = (-1, 0.0)  # (index in the batch, perf_counter at its start)
        self.thread = threading.Thread(target=self._loop, name="raylens-mod-call", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            if self._stopped:
                return
            batch, self._batch = self._batch, []
            context = self._context
            assert context is not None  # internal invariant: submit() sets it before releasing _go
            for k, pending in enumerate(batch):
                if self._stopped:
                    return
                self.running = (k, time.perf_counter())  # one assignment: the caller reads it whole
                context.run(pending.run)
            if self._stopped:
                return
            self.running = (-1, time.perf_counter())
            self._finished.release()

    def submit(self, batch: list[_Pending], context: contextvars.Context) -> None:
        """Run ``batch`` in order in ``context`` (a copy of the caller's: the capture buffer and
        request it sets there are the ones each mod sees)."""
        self._finished.acquire(blocking=False)  # held from now until the batch has returned
        self.running = (-1, time.perf_counter())
        self._batch, self._context = batch, context
        self._go.release()

    def wait(self, batch: list[_Pending]) -> int | None:
        """Sleep until ``batch`` (just submitted) has returned: None; or the index of a call that
        overran its ``timeout``. A wait never outlasts the running call's deadline nor the
        shortest limit in the batch (a later call starts no earlier than now, so its deadline is at
        least that far away)."""
        limits = [p.timeout for p in batch if p.timeout]
        shortest = min(limits) if limits else -1.0  # -1: no limit anywhere, sleep until done
        while True:
            index, since = self.running
            limit = batch[index].timeout if index >= 0 else None
            wait = shortest
            if limit:
                left = since + limit - time.perf_counter()
                if left <= 0:
                    if self._finished.acquire(blocking=False):
                        return None  # the batch returned just now
                    if self.running == (index, since):
                        return index  # still on it, past its limit
                    continue  # it returned and the next call started: look again
                wait = min(left, wait)
            if self._finished.acquire(timeout=wait):
                return None

    def stop(self) -> None:
        self._stopped = True
        try:
            self._go.release()
        except RuntimeError:  # already released: the thread will see the flag when it takes it
            pass


PendingCall = _Pending  # one call to make (what a step's phases hand the loop's LoopCalls)


class CallRunner:
    """Where mod calls run with a time limit when no step loop makes them (a manager's own
    :meth:`~ModManager.dispatch`): one worker thread, replaced when a call on it must be abandoned;
    one thread hand-off for all the calls :meth:`run` is given, not one per call. (The engine's
    step loop makes its calls on its own thread: engine/core/loop_calls.py.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._worker: _Worker | None = None

    def run(self, calls: list[_Pending]) -> None:
        """Run ``calls`` in order; each gets its own ``timeout``. A call that does not return in
        time is abandoned (``outcome`` stays None), its thread renamed and replaced, the calls
        after it on the same event skipped, and the rest run on the fresh worker."""
        with self._lock:
            while calls:
                worker = self._worker
                if worker is None:
                    worker = self._worker = _Worker()
                # a fresh copy each time: an abandoned call may still be running in the last one
                worker.submit(calls, contextvars.copy_context())
                try:
                    stuck = worker.wait(calls)
                except BaseException:  # e.g. Ctrl-C while waiting: the running call is abandoned, the signal goes on
                    self._abandon(worker, calls[max(worker.running[0], 0)].name)
                    raise
                if stuck is None:
                    return
                calls[stuck].stack = stack_of(worker.thread)
                self._abandon(worker, calls[stuck].name)
                calls = calls[stuck + 1:]  # those after it on its event find it without an outcome: skipped

    def _abandon(self, worker: _Worker, name: str) -> None:
        worker.stop()
        worker.thread.name = f"{ABANDONED_THREAD_NAME} ({name})"
        self._worker = None

    def close(self) -> None:
        """Stop the worker, and wait (at most :data:`CLOSE_WAIT_S`) for what it is doing: a daemon
        thread inside native code when the interpreter exits can abort the process."""
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()
            if worker.thread is not threading.current_thread():
                worker.thread.join(CLOSE_WAIT_S)


class ModManager:
    """Calls mods for events; see the module docstring.

    ``call_timeout_s``: the most a single mod call may take before it is abandoned (None or 0:
    call inline with no limit). Not thread-safe per call: concurrent dispatches on one manager
    are serialised.
    """

    def __init__(self, mods: Iterable[Callable[..., Any]] | None = None, *, tokenizer: Any = None,
                 call_timeout_s: float | None = 30.0) -> None:
        if call_timeout_s is not None and (isinstance(call_timeout_s, bool)
                                           or not isinstance(call_timeout_s, (int, float))
                                           or not math.isfinite(call_timeout_s) or call_timeout_s < 0):
            raise ValueError(f"`call_timeout_s` must be a finite number of seconds >= 0 or None, got {call_timeout_s!r}")
        self.mods: list[Callable[..., Any]] = list(mods or [])
        self.forced_queues: dict[str, list[int]] = {}
        self.forced_reason_queues: dict[str, list[str]] = {}
        self._tokenizer = tokenizer
        self._timeout = float(call_timeout_s) if call_timeout_s else None
        self._lock = threading.Lock()
        self._runner: CallRunner | None = None
        self._finalizer: weakref.finalize | None = None
        self.call_stats = ModCallStats()

    @property
    def call_timeout_s(self) -> float | None:
        return self._timeout

    def register(self, mod: Callable[..., Any]) -> None:
        self.mods.append(mod)

    def set_tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def close(self) -> None:
        """End the worker thread now (it also ends when the manager is garbage collected)."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._runner = self._finalizer = None

    def dispatch(self, event: ModEvent) -> list[ModAction]:
        return [call.action for call in self.dispatch_traced(event)]

    def dispatch_traced(self, event: ModEvent, mods: Sequence[Callable[..., Any]] | None = None) -> list[ModCall]:
        return self.run_traced(self.pending_calls(event, mods))

    def run_traced(self, pendings: list[_Pending]) -> list[ModCall]:
        """Make ``pendings`` (this manager's calls for one event) on this manager's worker, or
        inline without a time limit; what each did."""
        if self._timeout is None:
            for pending in pendings:
                pending.run()
        else:
            with self._lock:
                if self._runner is None:
                    self._runner = CallRunner()
                    self._finalizer = weakref.finalize(self, self._runner.close)
                    self._finalizer.atexit = False
                runner = self._runner
            runner.run(pendings)
        return self.records(pendings)

    # ---------------------------------------------------------------------------------- calls

    def pending_calls(self, event: ModEvent, mods: Sequence[Callable[..., Any]] | None = None) -> list[_Pending]:
        """One call per mod for ``event``, chained so that a fatal call stops the ones after it."""
        out: list[_Pending] = []
        previous = None
        for m in self.mods if mods is None else mods:
            previous = _Pending(m, event, self._tokenizer, previous, self._timeout)
            out.append(previous)
        return out

    def calls_for(self, event: ModEvent) -> list[_Pending]:
        """:meth:`pending_calls` less the mods whose handler's leading guard turns ``event`` away
        (:func:`mods.event_guard.turns_away`: the call would return a Noop having done nothing).
        Such a call is not made, so it is not counted in :attr:`call_stats` either; what the step
        records is what it would have been (a silent Noop has no record)."""
        mods = self.mods
        kept = [m for m in mods if not turns_away(m, event)]
        return self.pending_calls(event, kept if len(kept) != len(mods) else None) if kept else []

    def turns_away_all(self, kind: type[ModEvent] | tuple[type[ModEvent], ...]) -> bool:
        """Whether every mod's guard turns every event of class ``kind`` (or of each class of it) away
        (:func:`mods.event_guard.turns_away_all`): :meth:`calls_for` would make no call for one,
        so the engine need not make the event while the step runs."""
        return turns_away_all(self.mods, kind)

    def records(self, pendings: Sequence[_Pending], *, keep_silent: bool = True) -> list[ModCall]:
        """What each call did (calls skipped after a fatal one are left out); counted in
        :attr:`call_stats`. ``keep_silent`` False: a call that returned a Noop and printed, logged and
        raised nothing gets no record (it is only counted): a caller that applies and records what
        mods did has nothing to do for one, and most calls are such."""
        stats, calls = self.call_stats, []
        for pending in pendings:
            if pending.skipped:
                continue
            if not keep_silent and pending.quiet:
                stats.count(pending.elapsed_ms)
                continue
            call = self._record(pending)
            stats.count(call.elapsed_ms, failed=call.exception is not None)
            calls.append(call)
        return calls

    def _record(self, pending: _Pending) -> ModCall:
        name = mod_name(pending.mod)
        event = pending.event
        event_type = type(event).__name__
        step = getattr(event, "step", 0)
        action: ModAction
        exception: ModException | None
        if pending.outcome is None:  # abandoned after its time limit
            timeout = ModCallTimeout(name, self._timeout or 0.0, event_type, step)
            action, exception, rejected, fatal = Noop(), _timeout_record(timeout, pending.stack), None, True
            logs = _timeout_logs(pending, timeout)
            started_at = pending.started_at or time.time()
            elapsed_ms = (self._timeout or 0.0) * 1000.0
        else:
            action, exception, rejected, fatal = pending.outcome
            logs = pending.buffer.logs()  # type: ignore[union-attr]
            started_at, elapsed_ms = pending.started_at, pending.elapsed_ms
        if exception is not None:
            log.log(logging.ERROR if fatal else logging.WARNING, "mod %s raised %s on %s step %s: %s", name,
                    exception.type, event_type, step, exception.message)
        try:
            action._source = name  # type: ignore[attr-defined]
            if logs:
                action._mod_logs = "".join(entry.message for entry in logs)  # type: ignore[attr-defined]
        except AttributeError:  # an action object that refuses attributes: the record still has it
            pass
        return ModCall(name, event_type, step, action, logs, started_at, elapsed_ms, exception, rejected,
                       pending.outcome is None, fatal)


def _timeout_record(timeout: ModCallTimeout, stack: str) -> ModException:
    where = f"\nWhere the mod was when it was abandoned (its thread keeps running):\n{stack}" if stack else ""
    return ModException(type(timeout).__name__, str(timeout), f"{type(timeout).__name__}: {timeout}{where}")


def _timeout_logs(pending: _Pending, timeout: ModCallTimeout) -> tuple[CapturedLog, ...]:
    """What the call printed before it was abandoned, then the reason; later output is dropped."""
    buffer = pending.buffer
    if buffer is None:  # the worker never got to start the call
        buffer = CaptureBuffer()
    buffer.seal()
    buffer.add(CapturedLog(f"[mods] {timeout}\n", "ERROR", time.time()))
    return buffer.logs()


def stack_of(thread: threading.Thread) -> str:
    """Where ``thread`` is now, as a formatted stack (empty when it has ended): the record of a
    call abandoned on it says where the mod was stuck."""
    frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else ""
