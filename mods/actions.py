"""``ActionBuilder``: the ``actions`` argument of ``@mod`` handlers.

Keyword names (``steps=``, ``tokens=``) are part of the contract; test mods call them by name.
Event checks use ``isinstance``, unlike :func:`validate_action`'s exact-type table.
"""

from __future__ import annotations

from typing import Any, Iterable

from .types import (
    Added,
    AdjustedLogits,
    AdjustedPrefill,
    Backtrack,
    EmitError,
    ForceOutput,
    ForceTokens,
    ForwardPass,
    ModEvent,
    Noop,
    Prefilled,
    Sampled,
    Steer,
    ToolCalls,
)
from .validation import InvalidActionError

__all__ = ["ActionBuilder", "for_event"]

_ANY_EVENT = (Prefilled, ForwardPass, Sampled, Added)
_STEP_EVENTS = (ForwardPass, Sampled, Added)


class ActionBuilder:
    def __init__(self, event: ModEvent) -> None:
        self._event = event

    def _require(self, method: str, allowed: tuple[type, ...]) -> None:
        if not isinstance(self._event, allowed):
            raise InvalidActionError(
                f"Action '{method}' not permitted for event type {type(self._event).__name__}"
            )

    def noop(self) -> Noop:
        return Noop()

    def force_output(self, tokens: Iterable[Any]) -> ForceOutput:
        self._require("force_output", _ANY_EVENT)
        return ForceOutput([int(t) for t in tokens])

    def tool_calls(self, payload: Any) -> ToolCalls:
        self._require("tool_calls", _ANY_EVENT)
        return ToolCalls(payload)

    def emit_error(self, err_str: str) -> EmitError:
        return EmitError(err_str)

    def adjust_prefill(self, tokens: Iterable[Any], *, max_steps: int | None = None) -> AdjustedPrefill:
        self._require("adjust_prefill", (Prefilled,))
        return AdjustedPrefill([int(t) for t in tokens], int(max_steps) if max_steps is not None else 0)

    def adjust_logits(self, logits: Any = None, token_temp: float | None = None) -> AdjustedLogits:
        self._require("adjust_logits", (ForwardPass,))
        chosen = logits if logits is not None else getattr(self._event, "logits", None)
        if chosen is None:
            raise InvalidActionError("adjust_logits requires logits when event has none")
        return AdjustedLogits(chosen, token_temp)

    def force_tokens(self, tokens: Iterable[Any]) -> ForceTokens:
        self._require("force_tokens", _STEP_EVENTS)
        return ForceTokens([int(t) for t in tokens])

    def backtrack(self, steps: int, tokens: Iterable[Any] | None = None) -> Backtrack:
        self._require("backtrack", _STEP_EVENTS)
        return Backtrack(int(steps), [int(t) for t in tokens] if tokens else None)


    def steer(self, feature_id: int, scale: float) -> Steer:
        """Add ``scale`` × the SAE decoder direction of ``feature_id`` to the residual stream at the
        SAE's layer on every later forward of this request (0 removes the steer)."""
        self._require("steer", _STEP_EVENTS)
        return Steer(feature_id, scale)


def for_event(event: ModEvent) -> ActionBuilder:
    return ActionBuilder(event)
