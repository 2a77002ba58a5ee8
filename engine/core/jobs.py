"""Work that is not generation — embeddings, prompt scoring, named capture — scheduled by the step
loop like generation is.

Before, such calls ran beside the loop, in the caller's thread, with nothing bounding them: 256
texts of 1,000 tokens kept a server's cores busy for minutes after their client had left. Now each
is a :class:`Job` the loop runs in units between its steps:

* a unit costs at most the step's token budget (``backend.max_step_tokens``): a batch of texts to
  embed, a chunk of a prompt to score (over KV blocks the scheduler's KV manager reserved, so a
  prompt that cannot fit waits like a request does), one named capture;
* the loop runs one unit per step, so decoding requests keep getting a token per step, as they do
  beside a chunked prefill, and jobs take turns;
* before every unit the job's deadline and its cancel flag are checked: a job whose caller timed
  out or left (``JobHandle.cancel``) stops at the next unit and frees what it held.

A job's work is a generator function run on the loop's thread (where the KV blocks and the forward
belong): each ``next()`` runs one unit and yields the tokens it fed; its return value is the
job's result.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from engine.errors import JobCancelledError, RequestTimeoutError

__all__ = ["Job", "JobHandle", "Work"]

Work = Generator[int, None, Any]  # yields the tokens each unit fed; returns the job's result


class JobHandle:
    """A scheduled job seen from outside the loop: ``result(timeout)`` waits for it, ``cancel()``
    stops it before its next unit (finish: :class:`~engine.errors.JobCancelledError`)."""

    def __init__(self, kind: str, job_id: str | None = None, *, timeout_s: float | None = None) -> None:
        self.kind = kind
        self.job_id = job_id or f"{kind}-{uuid.uuid4().hex[:12]}"
        self.timeout_s = timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.future: Future = Future()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """The job's result (raises what ended it). Waiting past ``timeout`` cancels the job and
        raises :class:`~engine.errors.RequestTimeoutError`."""
        try:
            return self.future.result(timeout)
        except TimeoutError:
            if self.future.done():
                return self.future.result()
            self.cancel()
            raise RequestTimeoutError(f"the {self.kind} must finish within {timeout:g} s, got still running; it was "
                                      f"cancelled", parameter="timeout", value=timeout) from None


@dataclass(eq=False)
class Job:
    """One scheduled job: its handle and ``start(loop)``, which makes its work generator (called on
    the loop's thread when its first unit runs)."""

    handle: JobHandle
    start: Callable[[Any], Work]
    work: Work | None = field(default=None, repr=False)
    units: int = 0
    tokens: int = 0

    def stop_reason(self) -> BaseException | None:
        """Why the job must not run another unit: its caller cancelled it, or its deadline passed."""
        handle = self.handle
        if handle.cancel_requested:
            return JobCancelledError(f"the {handle.kind} {handle.job_id} was cancelled")
        if handle.deadline is not None and time.monotonic() > handle.deadline:
            return RequestTimeoutError(f"the {handle.kind} must finish within {handle.timeout_s:g} s, got still "
                                       f"running after {self.units} units; it was stopped",
                                       parameter="timeout", value=handle.timeout_s)
        return None

    def run_unit(self, loop: Any) -> bool:
        """One unit on the loop's thread; True when the job ended (its handle has the outcome)."""
        reason = self.stop_reason()
        if reason is not None:
            self.close()
            self.handle.future.set_exception(reason)
            return True
        try:
            if self.work is None:
                self.work = self.start(loop)
            self.tokens += int(next(self.work))
            self.units += 1
            return False
        except StopIteration as done:
            self.handle.future.set_result(done.value)
        except BaseException as err:  # the caller gets it; the loop goes on
            self.handle.future.set_exception(err)
        return True

    def close(self) -> None:
        """Stop the work where it is (its ``finally`` blocks free what it held)."""
        if self.work is not None:
            self.work.close()
