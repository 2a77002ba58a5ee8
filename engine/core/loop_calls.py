"""Mod calls made on the step loop's own thread, their time limits kept by handing the loop over.

A step's mod calls used to run on a thread of their own, so that a call past its time limit
could be abandoned while the loop went on. Each round of calls then cost two thread wake-ups (the
loop hands the round over and sleeps; the mods' thread hands it back), and on a small machine a
wake-up takes 0.1-0.5 ms: about as long as the calls themselves at 8 concurrent requests with a
logits mod, and ~6 % of the step at 64. So the calls run on the loop's thread, in turn, with no hand-off.

The time limit still holds, for a call stuck in Python or in native code alike. The step is a
generator (:func:`~engine.core.phases.drive`) suspended while its round's calls run, so it does not
belong to the thread that drives it: a watchdog thread, which sleeps until the running call's
deadline, abandons a call still running then — it records the call as timed out, renames the
stuck thread ``raylens-abandoned-mod-call (<mod>)`` and starts a new loop thread, which makes the
round's remaining calls and drives the suspended step on. When the stuck call returns, its
thread finds it no longer owns the loop and ends (:class:`LoopAbandoned`), touching nothing.
"""

from __future__ import annotations

import contextvars
import logging
import math
import threading
import time
from typing import Callable, Sequence

from mods.capture import ensure_capture_installed
from mods.event_guard import forget_decisions
from mods.manager import ABANDONED_THREAD_NAME, PendingCall, stack_of

__all__ = ["LoopCalls", "LoopAbandoned", "TakeOver"]

log = logging.getLogger("raylens.step_loop")

#: ``take_over(calls, start)``: start and return a new loop thread that makes ``calls[start:]`` and
#: drives the step they belong to on (it owns the loop from then on).
TakeOver = Callable[[Sequence[PendingCall], int], threading.Thread]

_IDLE_CHECK_S = 60.0  # how long the watchdog sleeps with no call running
_RETRY_S = 1.0  # how soon it tries again when no new loop thread could be started


class LoopAbandoned(BaseException):
    """Raised on a loop thread whose call was abandoned, once the call returns: another thread
    drives the loop now, so this one must end without touching anything. (A BaseException: no
    fault handler of the loop may take it for a failed step.)"""


class LoopCalls:
    """Makes a round's mod calls on the calling thread (the step loop's), watched for their time
    limits (see the module docstring). ``take_over`` starts the replacement loop thread."""

    def __init__(self, take_over: TakeOver) -> None:
        self._take_over = take_over
        self._lock = threading.Lock()  # who owns the loop, which call runs, when the watchdog looks next
        self._wake = threading.Condition(threading.Lock())
        self._owner: threading.Thread | None = None  # the thread that drives the loop now
        # the limited call running now: (its round, its index, perf_counter at its start, its thread)
        self._running: tuple[Sequence[PendingCall], int, float, threading.Thread] | None = None
        self._next_look = math.inf  # perf_counter when the watchdog looks next (none yet: inf)
        self._watchdog: threading.Thread | None = None
        self._poked = False
        self._closed = False

    def own(self, thread: threading.Thread) -> None:
        """``thread`` drives the loop (set before it starts)."""
        with self._lock:
            self._owner = thread

    def run(self, calls: Sequence[PendingCall], start: int = 0) -> None:
        """Make ``calls[start:]`` in order on this thread, each in the same copy of the caller's
        context (what a mod sets there never reaches the loop). A call after a fatal one on its
        event is skipped (:class:`~mods.manager.PendingCall`). Raises :class:`LoopAbandoned` when a
        call overran its limit and was abandoned: this thread must end."""
        context = contextvars.copy_context()
        me = threading.current_thread()
        lock = self._lock
        ensure_capture_installed()  # once a round (PendingCall.call leaves it, and the reset, to us)
        try:
            for k in range(start, len(calls)):
                pending = calls[k]
                limit = pending.timeout
                if limit:
                    with lock:
                        started = time.perf_counter()
                        self._running = (calls, k, started, me)
                        early = started + limit < self._next_look  # due before the watchdog looks
                    if early:
                        self._poke()
                context.run(pending.call)
                if limit:
                    with lock:
                        if self._owner is not me:
                            raise LoopAbandoned
                        self._running = None
        finally:
            # the mods' code may have rebound what guards read: they are read afresh after the
            # round (no guard is read between its calls)
            forget_decisions()

    def close(self) -> None:
        """Stop the watchdog (a call running now is no longer watched)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        watchdog = self._watchdog
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(1.0)

    # ----------------------------------------------------------------------------- the watchdog

    def _poke(self) -> None:
        """Make the watchdog look now (started on the first limited call)."""
        with self._wake:
            if self._closed:
                return
            self._poked = True
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="raylens-mod-watchdog", daemon=True)
                self._watchdog.start()
            else:
                self._wake.notify()

    def _watch(self) -> None:
        while True:
            with self._lock:
                nap = self._look()
                self._next_look = time.perf_counter() + nap
            with self._wake:
                if not self._poked and not self._closed:
                    self._wake.wait(nap)
                self._poked = False
                if self._closed:
                    return

    def _look(self) -> float:
        """Abandon the running call if it is past its limit; how long to sleep before looking again
        (until the running call's deadline; with none running, a call that starts later pokes the
        watchdog when its deadline comes before the next look). Called holding ``_lock``."""
        running = self._running
        if running is None:
            return _IDLE_CHECK_S
        calls, k, started, thread = running
        left = started + calls[k].timeout - time.perf_counter()  # type: ignore[operator]
        if left > 0 or self._owner is not thread:
            return max(left, 0.001)
        calls[k].stack = stack_of(thread)
        try:
            self._owner = self._take_over(calls, k + 1)  # the new loop thread, started
        except Exception:  # no thread to be had (the process is at its limit): look again soon
            log.exception("could not start a loop thread to take over from a stuck mod call; retrying")
            return _RETRY_S
        self._running = None
        try:
            thread.name = f"{ABANDONED_THREAD_NAME} ({calls[k].name})"
        except Exception:  # a name is cosmetic
            pass
        return _IDLE_CHECK_S
