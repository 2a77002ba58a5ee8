"""ModManager: calls every registered mod for an event and records what each call did.

Legacy code imports this module as ``quote.mods.manager``. Contract:

* every mod is called, in registration order, for every event — no short-circuit here; the
  generation loop decides which returned actions it processes. The one exception is a *fatal*
  call (below): its request cannot go on, so the mods after it are not called for that event;
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
  :class:`ModCallTimeout` (``ModCall.timed_out``). Calls run on a worker thread of the manager,
  which waits with that limit; a thread stuck in a mod cannot be killed, so it is left running,
  renamed (:func:`abandoned_mod_threads` lists them) and replaced by a fresh worker;
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

from .capture import CaptureBuffer, CapturedLog, capture_mod_output
from .conversation import pop_request_context, push_request_context
from .types import ModAction, ModEvent, Noop
from .validation import InvalidActionError, validate_action

__all__ = ["ModManager", "ModCall", "ModCallTimeout", "ModException", "ModCallStats", "abandoned_mod_threads", "mod_name"]

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


@dataclass(frozen=True)
class ModCall:
    """What one mod did for one event.

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

    def record(self, call: ModCall) -> None:
        self.calls += 1
        self.errors += call.exception is not None
        self.seconds += call.elapsed_ms / 1000.0


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
    """One mod call: its inputs, and what it produced once it returned."""

    __slots__ = ("mod", "event", "tokenizer", "buffer", "outcome", "done", "context")

    def __init__(self, mod: Callable[..., Any], event: ModEvent, tokenizer: Any) -> None:
        self.mod, self.event, self.tokenizer = mod, event, tokenizer
        self.buffer: CaptureBuffer | None = None
        self.outcome: tuple[ModAction, ModException | None, ModAction | None, bool] | None = None

    def run(self) -> None:
        """Call the mod with its output captured; never raises (everything is recorded)."""
        event = self.event
        exception: ModException | None = None
        rejected: ModAction | None = None
        fatal = False
        request_id = getattr(event, "request_id", None)
        with capture_mod_output() as buffer:
            self.buffer = buffer
            context = push_request_context(request_id if isinstance(request_id, str) else None)
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
        self.outcome = (action, exception, rejected, fatal)


class _Worker:
    """A daemon thread that runs the calls handed to it, one at a time.

    Two raw locks are the hand-off (cheaper than a Queue or an Event): ``_go`` is released to
    start a call, each call's own ``done`` lock when it returns. :meth:`stop` ends the thread after
    its current call, or at once when idle.
    """

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._pending: _Pending | None = None
        self._stopped = False
        self.thread = threading.Thread(target=self._loop, name="raylens-mod-call", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            if self._stopped:
                return
            pending, self._pending = self._pending, None
            assert pending is not None  # internal invariant: submit() sets it before releasing _go
            pending.context.run(pending.run)
            pending.done.release()
            if self._stopped:
                return

    def submit(self, pending: _Pending) -> None:
        self._pending = pending
        self._go.release()

    def stop(self) -> None:
        self._stopped = True
        try:
            self._go.release()
        except RuntimeError:  # already released: the thread will see the flag when it takes it
            pass


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
        self._worker: _Worker | None = None
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
            self._worker = self._finalizer = None

    def dispatch(self, event: ModEvent) -> list[ModAction]:
        return [call.action for call in self.dispatch_traced(event)]

    def dispatch_traced(self, event: ModEvent, mods: Sequence[Callable[..., Any]] | None = None) -> list[ModCall]:
        calls: list[ModCall] = []
        for m in self.mods if mods is None else mods:
            calls.append(self._call(m, event))
            self.call_stats.record(calls[-1])
            if calls[-1].fatal:
                break
        return calls

    # ---------------------------------------------------------------------------------- one call

    def _call(self, mod: Callable[..., Any], event: ModEvent) -> ModCall:
        name = mod_name(mod)
        event_type = type(event).__name__
        step = getattr(event, "step", 0)
        pending = _Pending(mod, event, self._tokenizer)
        started_at = time.time()
        t0 = time.perf_counter()
        stuck_at: str | None = None  # where the mod was when its call was abandoned
        if self._timeout is None:
            pending.run()
        else:
            stuck_at = self._run_on_worker(pending, name)
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        if stuck_at is not None:
            timeout = ModCallTimeout(name, self._timeout or 0.0, event_type, step)
            action, exception, rejected, fatal = Noop(), _timeout_record(timeout, stuck_at), None, True
            logs = _timeout_logs(pending, timeout)
        else:
            assert pending.outcome is not None and pending.buffer is not None  # set by run()
            action, exception, rejected, fatal = pending.outcome
            logs = pending.buffer.logs()
        if exception is not None:
            log.log(logging.ERROR if fatal else logging.WARNING, "mod %s raised %s on %s step %s: %s", name,
                    exception.type, event_type, step, exception.message)
        try:
            action._source = name
            if logs:
                action._mod_logs = "".join(entry.message for entry in logs)
        except AttributeError:  # an action object that refuses attributes: the record still has it
            pass
        return ModCall(name, event_type, step, action, logs, started_at, elapsed_ms, exception, rejected,
                       timed_out=stuck_at is not None, fatal=fatal)

    def _run_on_worker(self, pending: _Pending, name: str) -> str | None:
        """Run the call on the worker thread, in a copy of the caller's context (so the capture
        buffer and request set there are the ones the mod sees). None when it returned in time,
        else the stack of the abandoned thread."""
        pending.context = contextvars.copy_context()
        pending.done = threading.Lock()
        pending.done.acquire()
        with self._lock:
            worker = self._worker
            if worker is None:
                worker = self._worker = _Worker()
                self._finalizer = weakref.finalize(self, worker.stop)
                self._finalizer.atexit = False
            worker.submit(pending)
            try:
                returned = pending.done.acquire(timeout=self._timeout)
            except BaseException:  # e.g. Ctrl-C while waiting: the call is abandoned, the signal goes on
                self._abandon(worker, name)
                raise
            if returned:
                return None
            stack = _stack_of(worker.thread)
            self._abandon(worker, name)
            return stack

    def _abandon(self, worker: _Worker, name: str) -> None:
        worker.stop()
        worker.thread.name = f"{ABANDONED_THREAD_NAME} ({name})"
        if self._finalizer is not None:
            self._finalizer.detach()
        self._worker = self._finalizer = None



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


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None
    return "".join(traceback.format_stack(frame)) if frame is not None else ""
