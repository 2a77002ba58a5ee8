"""A submitted request seen from outside the step loop: its stream of tokens and its result.

:class:`RequestHandle` is what ``Engine.submit`` returns. Iterating it yields, as they happen,
:class:`TokenEvent` (tokens committed: one sampled token, or a forced chunk) and :class:`Erased`
(a mod's Backtrack removed the newest tokens), and ends when the request finishes.
``result()`` waits for the :class:`~engine.core.result.GenerationResult`; ``cancel()`` ends the
request at the next step boundary and frees its batch slot.

The loop thread only appends to a queue; consumers block on it. Host copies (numpy attention
rows, Python floats) are made by the loop before an event is queued, so a slow consumer never
holds device memory of a later step.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["TokenEvent", "Erased", "RequestHandle", "StreamEvent"]


@dataclass(frozen=True)
class TokenEvent:
    """Tokens committed to a request's output.

    ``logprobs[i]``: log-prob of ``token_ids[i]`` under the distribution it was drawn from (None
    for forced tokens or when not asked for). ``top_logprobs[i]``: the k most likely ``(id,
    logprob)`` of that distribution, when asked for. ``attention``: ``(layers, heads, context)``
    float32, the attention from the position that produced the token to every position in
    context (each row sums to 1), when the request asked for every layer's attention.
    ``sae_features``: the inline SAE's top-k features (``mods.types.SAEFeatures``, shape ``(k,)``)
    of the position that produced the token, when the engine encodes inline; else None.
    """

    request_id: str
    token_ids: tuple[int, ...]
    forced: bool
    logprobs: tuple[float | None, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    attention: np.ndarray | None = None
    sae_features: Any = None


@dataclass(frozen=True)
class Erased:
    """The newest ``n`` tokens already streamed were erased (a Backtrack)."""

    request_id: str
    n: int


StreamEvent = TokenEvent | Erased
_END = object()


class RequestHandle:
    """One request in flight. ``request``: the :class:`~engine.core.request.EngineRequest` it runs
    (its token ids, stop set and limits: what a route needs to present the stream)."""

    def __init__(self, request_id: str, request: Any = None) -> None:
        self.request_id = request_id
        self.request = request
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._future: Future = Future()
        self._cancel = threading.Event()

    # ------------------------------------------------------------------------- loop side

    def committed(self, tokens: Sequence[int], forced: bool, sample: Any, attention: Any,
                  sae_features: Any = None) -> None:
        if sample is not None:
            logprobs = (sample.logprob,) + (None,) * (len(tokens) - 1)
            top = (sample.top,) if sample.top is not None else None
        else:
            logprobs, top = (None,) * len(tokens), None
        self._events.put(TokenEvent(self.request_id, tuple(int(t) for t in tokens), forced, logprobs, top,
                                    attention, sae_features))

    def erased(self, n: int) -> None:
        self._events.put(Erased(self.request_id, n))

    def end(self) -> None:
        self._events.put(_END)

    def set_result(self, result: Any) -> None:
        if not self._future.done():
            self._future.set_result(result)

    def set_exception(self, err: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(err)
        self.end()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    # --------------------------------------------------------------------- consumer side

    def __iter__(self) -> Iterator[StreamEvent]:
        while True:
            event = self._events.get()
            if event is _END:
                self._events.put(_END)  # a second iteration ends at once
                return
            yield event

    def result(self, timeout: float | None = None) -> Any:
        """The GenerationResult (raises what failed the request; TimeoutError after ``timeout``)."""
        return self._future.result(timeout)

    def cancel(self) -> None:
        """End the request at the next step boundary (finish reason ``cancelled``); idempotent."""
        self._cancel.set()
