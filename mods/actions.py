"""``ActionBuilder``: the ``actions`` argument of ``@mod`` handlers.

Keyword names (``steps=``, ``tokens=``) are part of the contract; test mods call them by name.
Which builder methods an event permits comes from the one table of allowed actions
(:data:`mods.validation.ALLOWED_ACTIONS`), read with ``isinstance`` unlike
:func:`validate_action`'s exact-type lookup.
"""

from __future__ import annotations

from typing import Any, Iterable

from .types import (
    AdjustedLogits,
    AdjustedPrefill,
    Backtrack,
    EmitError,
    ForceOutput,
    ForceTokens,
    ModAction,
    ModEvent,
    Noop,
    Steer,
    ToolCalls,
)
from .validation import InvalidActionError, allowed_actions

__all__ = ["ActionBuilder", "for_event"]


class ActionBuilder:
    def __init__(self, event: ModEvent) -> None:
        self._event = event

    def _require(self, method: str, action: type[ModAction]) -> None:
        if not issubclass(action, allowed_actions(self._event)):
            raise InvalidActionError(
                f"Action '{method}' not permitted for event type {type(self._event).__name__}"
            )

    def noop(self) -> Noop:
        return Noop()

    def force_output(self, tokens: Iterable[Any]) -> ForceOutput:
        self._require("force_output", ForceOutput)
        return ForceOutput([int(t) for t in tokens])

    def tool_calls(self, payload: Any) -> ToolCalls:
        self._require("tool_calls", ToolCalls)
        return ToolCalls(payload)

    def emit_error(self, err_str: str) -> EmitError:
        return EmitError(err_str)

    def adjust_prefill(self, tokens: Iterable[Any], *, max_steps: int | None = None) -> AdjustedPrefill:
        self._require("adjust_prefill", AdjustedPrefill)
        return AdjustedPrefill([int(t) for t in tokens], int(max_steps) if max_steps is not None else 0)

    def adjust_logits(self, logits: Any = None, token_temp: float | None = None) -> AdjustedLogits:
        self._require("adjust_logits", AdjustedLogits)
        chosen = logits if logits is not None else getattr(self._event, "logits", None)
        if chosen is None:
            raise InvalidActionError("adjust_logits requires logits when event has none")
        return AdjustedLogits(chosen, token_temp)

    def force_tokens(self, tokens: Iterable[Any]) -> ForceTokens:
        self._require("force_tokens", ForceTokens)
        return ForceTokens([int(t) for t in tokens])

    def backtrack(self, steps: int, tokens: Iterable[Any] | None = None) -> Backtrack:
        self._require("backtrack", Backtrack)
        return Backtrack(int(steps), [int(t) for t in tokens] if tokens else None)


    def steer(self, feature_id: int, scale: float) -> Steer:
        """Add ``scale`` × the SAE decoder direction of ``feature_id`` to the residual stream at the
        SAE's layer on every later forward of this request (0 removes the steer)."""
        self._require("steer", Steer)
        return Steer(feature_id, scale)


def for_event(event: ModEvent) -> ActionBuilder:
    return ActionBuilder(event)
