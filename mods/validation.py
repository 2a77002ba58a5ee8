"""Which actions each event allows; legacy mods import this module as ``shared.utils``.

The table is keyed by the *exact* event class (compat §2.3): an event subclass is an
"Unsupported event type", while action subclasses are accepted. It is checked once per mod
result, at dispatch.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from .types import (
    Added,
    AdjustedLogits,
    AdjustedPrefill,
    Backtrack,
    EmitError,
    ForceOutput,
    ForceTokens,
    ForwardPass,
    ModAction,
    ModEvent,
    Noop,
    Prefilled,
    Sampled,
    ToolCalls,
)

__all__ = ["InvalidActionError", "validate_action", "ALLOWED_ACTIONS"]


class InvalidActionError(ValueError):
    """A mod returned something the event does not allow (a ``ValueError``, as in the original)."""


_ALLOWED_ACTIONS: dict[type[ModEvent], tuple[type[ModAction], ...]] = {
    Prefilled: (Noop, ForceOutput, ToolCalls, AdjustedPrefill, EmitError),
    ForwardPass: (Noop, ForceTokens, Backtrack, ForceOutput, ToolCalls, AdjustedLogits, EmitError),
    Sampled: (Noop, ForceTokens, Backtrack, ForceOutput, ToolCalls, EmitError),
    Added: (Noop, ForceTokens, Backtrack, ForceOutput, ToolCalls, EmitError),
}

#: Read-only view of the table, for documentation and tests.
ALLOWED_ACTIONS: Mapping[type[ModEvent], tuple[type[ModAction], ...]] = MappingProxyType(_ALLOWED_ACTIONS)


def validate_action(event: ModEvent, action: Any) -> ModAction:
    """Return ``action`` if ``event`` allows it; ``None`` becomes a fresh :class:`Noop`."""
    if action is None:
        return Noop()
    allowed = _ALLOWED_ACTIONS.get(type(event))
    if allowed is None:
        raise InvalidActionError(f"Unsupported event type {type(event).__name__}")
    if not isinstance(action, allowed):
        raise InvalidActionError(
            f"Action {type(action).__name__} not permitted for event {type(event).__name__}"
        )
    return action
