"""From the engine's blocking request handle to async routes, with cancellation and a deadline.

A handle blocks on each event, so one daemon thread per active request reads it and hands events
to the event loop. Whatever ends the consumer early (a client that disconnected, the per-request
time limit, a stop string, an error) cancels the request, which frees its slot in the engine.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any, AsyncIterator

from .engine_stream import submit
from .errors import ApiError, ErrorCode, api_error_from

__all__ = ["Stream", "open_stream", "run_job"]

_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


async def open_stream(engine: Any, request: Any, *, timeout_s: float) -> "Stream":
    """Submit a :class:`~engine.core.inputs.GenerationRequest` (off the event loop: prompt encoding
    and mod loading take time); bad input raises :class:`ApiError` here, before any response has
    started. A full queue is a 503 QUEUE_FULL, not a hung connection (``block=False``)."""
    try:
        handle = await asyncio.to_thread(submit, engine, request, block=False)
    except Exception as err:
        raise api_error_from(err) from err
    return Stream(handle, timeout_s)


async def run_job(engine: Any, method: str, *args: Any, request: Any = None, timeout_s: float,
                  **kwargs: Any) -> Any:
    """``engine.<method>(*args, job_id=…, timeout=timeout_s, **kwargs)`` (embeddings, scoring, a
    capture: scheduled by the engine's step loop a unit per step) off the event loop, cancelled
    when the HTTP client behind ``request`` disconnects and stopped by the engine past
    ``timeout_s`` (a 504 TIMEOUT); its typed errors become :class:`ApiError`."""
    job_id = f"{method}-{uuid.uuid4().hex[:12]}"
    call = asyncio.ensure_future(asyncio.to_thread(getattr(engine, method), *args, job_id=job_id,
                                                   timeout=timeout_s, **kwargs))
    try:
        while True:
            done, _ = await asyncio.wait({call}, timeout=_DISCONNECT_POLL_S)
            if done:
                break
            if request is not None and await request.is_disconnected():
                await asyncio.to_thread(engine.cancel, job_id)  # its next unit does not run
                raise ApiError(ErrorCode.INVALID_REQUEST, "the client disconnected; the work was cancelled")
        return call.result()
    except asyncio.CancelledError:  # the server dropped the route (shutdown, disconnect): stop the work too
        await asyncio.to_thread(engine.cancel, job_id)
        raise
    except ApiError:
        raise
    except TimeoutError:
        raise ApiError(ErrorCode.TIMEOUT, f"the request must finish within {timeout_s:g} s; it was cancelled. Send "
                                          f"less (fewer or shorter inputs).") from None
    except Exception as err:
        raise api_error_from(err) from err


_DISCONNECT_POLL_S = 0.25  # how often a waiting route asks whether its client is still there


class Stream:
    """``async for event in stream`` yields the request's events; ``await stream.result()`` its result.

    Leaving the ``async for`` before the end (or :meth:`cancel`) cancels the request.
    """

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        self.finished = False
        self.cancelled = False
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + timeout_s
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        threading.Thread(target=self._pump, daemon=True, name="raylens-stream").start()

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            pass

    def _pump(self) -> None:
        try:
            for event in self.handle:
                self._put(event)
        except BaseException as err:  # handed to the consumer, which raises it as a coded error
            self._put(_Failed(err))
        finally:
            self._put(_END)

    def cancel(self) -> None:
        if not self.finished and not self.cancelled:
            self.cancelled = True
            self.handle.cancel()

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            while True:
                remaining = self._deadline - self._loop.time()
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    raise ApiError(ErrorCode.TIMEOUT, f"the request must finish within {self.timeout_s:g} s, "
                                                      f"got still running; it was cancelled. Ask for fewer tokens.",
                                   "max_new_tokens") from None
                if item is _END:
                    self.finished = True
                    return
                if isinstance(item, _Failed):
                    self.finished = True
                    raise api_error_from(item.error) from item.error
                yield item
        finally:
            self.cancel()

    async def result(self) -> Any:
        remaining = max(self._deadline - self._loop.time(), 1.0)
        try:
            return await asyncio.to_thread(self.handle.result, remaining)
        except TimeoutError:
            self.cancel()
            raise ApiError(ErrorCode.TIMEOUT, f"the request must finish within {self.timeout_s:g} s; it was "
                                              "cancelled.") from None
        except Exception as err:
            raise api_error_from(err) from err
