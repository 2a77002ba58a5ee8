"""Per-mod-call capture of ``print`` output and ``logging`` records.

The original swapped ``sys.stdout`` around every mod call (``redirect_stdout``), which is process
global: two requests running in threads got each other's prints. Here one stdout
router is installed once; each write goes to the capture buffer selected by a ``ContextVar`` for
the current thread/context, or to the real stream when no mod call is running. A logging handler
on the root logger does the same for log records.

The router re-installs itself only when someone else replaced ``sys.stdout`` afterwards (pytest's
capture does this), never per call.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, TextIO

__all__ = ["CapturedLog", "CaptureBuffer", "capture_mod_output", "ensure_capture_installed"]

_LEVELS = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING"}


@dataclass(frozen=True)
class CapturedLog:
    """One log line of a mod call: consecutive prints are merged into one INFO message."""

    message: str
    level: str  # DEBUG | INFO | WARNING | ERROR (the ingest schema's set)
    created_at: float  # epoch seconds


class CaptureBuffer:
    """Collects what one mod call printed or logged, in order.

    :meth:`seal` stops collecting: a mod call abandoned after its time limit keeps running on its
    own thread, and a mod stuck printing in a loop must not grow a buffer nobody reads any more.
    """

    __slots__ = ("_parts", "_stdout", "_stdout_started", "_sealed")  # one is made per mod call

    def __init__(self) -> None:
        self._parts: list[CapturedLog] = []
        self._stdout: list[str] = []
        self._stdout_started = 0.0
        self._sealed = False

    def seal(self) -> None:
        """Drop everything written from now on (what was written so far stays readable)."""
        self._sealed = True

    def add(self, entry: CapturedLog) -> None:
        """Append a line of the caller's own (e.g. why the call was abandoned), even when sealed."""
        self._flush_stdout()
        self._parts.append(entry)

    def write_stdout(self, text: str) -> None:
        if text and not self._sealed:
            if not self._stdout:
                self._stdout_started = time.time()
            self._stdout.append(text)

    def add_record(self, record: logging.LogRecord, message: str) -> None:
        if self._sealed:
            return
        self._flush_stdout()
        level = "ERROR" if record.levelno >= logging.ERROR else _LEVELS.get(record.levelno, "INFO")
        self._parts.append(CapturedLog(message, level, record.created))

    def _flush_stdout(self) -> None:
        if self._stdout:
            self._parts.append(CapturedLog("".join(self._stdout), "INFO", self._stdout_started))
            self._stdout = []

    @property
    def empty(self) -> bool:
        """Nothing was printed or logged."""
        return not self._parts and not self._stdout

    def logs(self) -> tuple[CapturedLog, ...]:
        if not self._parts and not self._stdout:  # the usual call: nothing printed or logged
            return ()
        self._flush_stdout()
        return tuple(self._parts)


_active: ContextVar[CaptureBuffer | None] = ContextVar("raylens_mod_capture", default=None)


class _StdoutRouter(io.TextIOBase):
    """Sends writes to the active mod call's buffer, else to the stream it wraps."""

    def __init__(self, target: TextIO) -> None:
        self._target = target

    def write(self, text: str) -> int:
        buffer = _active.get()
        if buffer is None:
            return self._target.write(text)
        buffer.write_stdout(text)
        return len(text)

    def flush(self) -> None:
        if _active.get() is None:
            self._target.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._target.isatty()

    def fileno(self) -> int:
        return self._target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", "utf-8")

    def __getattr__(self, name: str):  # anything else (buffer, errors, …) from the real stream
        return getattr(self._target, name)


class _LogRouter(logging.Handler):
    """Root-logger handler that copies records emitted during a mod call into its buffer."""

    def emit(self, record: logging.LogRecord) -> None:
        buffer = _active.get()
        if buffer is None:
            self._stand_in_for_last_resort(record)
            return
        try:
            buffer.add_record(record, record.getMessage())
        except Exception:  # a broken log call in a mod must not break dispatch
            self.handleError(record)

    def _stand_in_for_last_resort(self, record: logging.LogRecord) -> None:
        """Being on the root logger hides ``logging.lastResort``; print what it would have."""
        last_resort = logging.lastResort
        if last_resort is None or record.levelno < last_resort.level:
            return
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return
            logger = logger.parent if logger.propagate else None
        last_resort.handle(record)


_install_lock = threading.Lock()
_log_router = _LogRouter(level=logging.NOTSET)


def ensure_capture_installed() -> None:
    """Install the stdout router and the log handler if someone replaced or removed them. Checked
    before every mod call, or once before a round of calls (a mod that swaps ``sys.stdout`` for
    good sends the rest of its round's prints to its own stream; the next round takes them
    back), so the quick test reads the root logger's handlers directly."""
    if isinstance(sys.stdout, _StdoutRouter) and _log_router in logging.root.handlers:
        return
    with _install_lock:
        if not isinstance(sys.stdout, _StdoutRouter):
            sys.stdout = _StdoutRouter(sys.stdout)
        root = logging.getLogger()
        if _log_router not in root.handlers:
            root.addHandler(_log_router)


@contextlib.contextmanager
def capture_mod_output() -> Iterator[CaptureBuffer]:
    """Route prints and log records of the current context into a fresh buffer."""
    ensure_capture_installed()
    buffer = CaptureBuffer()
    token = _active.set(buffer)
    try:
        yield buffer
    finally:
        _active.reset(token)
