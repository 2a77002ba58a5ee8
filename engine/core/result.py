"""What a generation returns."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable

from mods.types import ModAction, ModEvent

__all__ = ["FinishReason", "IgnoredAction", "GenerationResult", "DeferredPayload"]


class FinishReason(str, Enum):
    """Why a request ended. ``stop``: EOS/stop token or ForceOutput; ``length``: token budget,
    context window or step limit; ``tool_calls``: a ToolCalls action; ``error``: an EmitError, or
    a mod or input fault that ended this request alone; ``cancelled``: the caller cancelled it."""

    STOP = "stop"
    LENGTH = "length"
    TOOL_CALLS = "tool_calls"
    ERROR = "error"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class IgnoredAction:
    """A non-Noop action the loop did not apply, and why (nothing is dropped without a trace)."""

    step: int
    event_type: str
    mod_name: str
    action: ModAction
    reason: str


class DeferredPayload:
    """An ingest payload built when it is first read, once (from any thread). A request whose
    payload is not sent anywhere (no ingest URL) and never read costs nothing for it: building a
    payload (every step's record; with their texts, the top tokens it lists) takes milliseconds of CPU per
    request, which at 64 concurrent requests was 13 % of the engine's throughput. ``build`` must
    hold only what the payload is made of, never the request's state (its logits, its internals)."""

    __slots__ = ("_build", "_value", "_lock")

    def __init__(self, build: Callable[[], dict[str, Any]]) -> None:
        self._build: Callable[[], dict[str, Any]] | None = build
        self._value: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def get(self) -> dict[str, Any]:
        with self._lock:
            if self._build is not None:
                self._value, self._build = self._build(), None
            return self._value  # type: ignore[return-value]


class _PayloadField:
    """``GenerationResult.payload``: a plain dict to every reader, built on the first read when
    it was given as a :class:`DeferredPayload`. Put on the class after the dataclass is made, so
    the field stays a required, unrepresented one; the generated ``__init__`` (and ``replace``)
    set it through ``__set__``, ``==`` reads it through ``__get__``."""

    _slot = "_payload"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self._slot]
        return value.get() if isinstance(value, DeferredPayload) else value

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self._slot] = value


@dataclass(frozen=True)
class GenerationResult:
    """One request's outcome.

    ``events``: every dispatched event in order, with hidden states and attention attached.
    ``actions``: every action the loop applied, in order (each carries ``_source``, the mod name).
    ``payload``: the ingest payload (never contains hidden states, attention or input ids); when
    the engine sends payloads nowhere it is built on first read, and its ForwardPass records list
    no top tokens unless the request asked (``payload_top_tokens``; a sent payload lists them).
    ``metadata``: request id, model, device, timings, token counts.
    ``sequence_ids``: what the model read after the prompt (stop ids kept, unlike ``output_ids``).
    ``token_logprobs``: each generated token's log-prob under the distribution it was drawn from
    (None for forced tokens), when the request asked for log-probs; else None.
    ``error_parameter``: with finish reason ``error``, the request's own field at fault (its
    grammar's, e.g. ``response_format.grammar``); None when a mod or the engine ended it.
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    finish_reason: FinishReason
    events: list[ModEvent] = field(repr=False)
    actions: list[ModAction] = field(repr=False)
    ignored_actions: list[IgnoredAction] = field(repr=False)
    payload: dict[str, Any] = field(repr=False)  # read through _PayloadField (set below)
    metadata: dict[str, Any] = field(repr=False)
    tool_calls: list[Any] | None = None
    error: str | None = None
    sequence_ids: list[int] = field(default_factory=list, repr=False)
    token_logprobs: list[float | None] | None = field(default=None, repr=False)
    error_parameter: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        """What pickling sends (a Ray result, a copy): the payload built, never its builder."""
        state = dict(self.__dict__)
        state["_payload"] = self.payload
        return state

    def portable(self, **metadata: Any) -> "GenerationResult":
        """This result for another process (a Ray job's driver, a Serve replica): the same type
        without its events (every step's hidden states and attention) and its ingest payload,
        which stay with the engine that ran the request (it delivers the payload itself);
        ``metadata`` entries are added."""
        return replace(self, events=[], payload={}, metadata={**self.metadata, **metadata})

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able part: what the CLI prints with ``--json``."""
        return {
            "request_id": self.request_id,
            "output_text": self.output_text,
            "output_ids": self.output_ids,
            "finish_reason": str(self.finish_reason),
            "tool_calls": self.tool_calls,
            "error": self.error,
            "error_parameter": self.error_parameter,
            "actions": [
                {"type": type(a).__name__, "mod": getattr(a, "_source", None)} for a in self.actions
            ],
            "ignored_actions": [
                {"step": i.step, "event": i.event_type, "mod": i.mod_name, "type": type(i.action).__name__,
                 "reason": i.reason}
                for i in self.ignored_actions
            ],
            "metadata": self.metadata,
        }


GenerationResult.payload = _PayloadField()  # type: ignore[assignment, misc]
