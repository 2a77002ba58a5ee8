"""Which actions each event allows, and which values an allowed action may carry; legacy mods
import this module as ``shared.utils``.

The table is keyed by the *exact* event class: an event subclass is an
"Unsupported event type", while action subclasses are accepted. It is checked once per mod
result, at dispatch.

The value checks (:func:`check_action_values` and the helpers it uses) are pure numpy functions
for the generation rules: an action of an allowed type can still carry values the engine cannot
use (a negative token id crashed payload building, NaN logits sample garbage). Each raises
:class:`InvalidActionValue` naming the field, so the request can end with finish reason
``error`` naming the mod instead of crashing or sampling nonsense.
"""

from __future__ import annotations

import math
import numbers
import operator
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

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
    Steer,
    ToolCalls,
)

__all__ = [
    "InvalidActionError",
    "InvalidActionValue",
    "validate_action",
    "ALLOWED_ACTIONS",
    "allowed_actions",
    "check_action_values",
    "check_token_ids",
    "check_logits",
    "check_token_temp",
]


class InvalidActionError(ValueError):
    """A mod returned something the event does not allow (a ``ValueError``, as in the original)."""


class InvalidActionValue(InvalidActionError):
    """An allowed action carries a value the engine cannot use. Recoverable for the process; ends
    the request. ``parameter`` names the field (``ForceTokens.tokens[2]``), ``value`` is what it held."""

    def __init__(self, message: str, *, parameter: str, value: Any) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


_ALLOWED_ACTIONS: dict[type[ModEvent], tuple[type[ModAction], ...]] = {
    Prefilled: (Noop, ForceOutput, ToolCalls, AdjustedPrefill, EmitError),
    ForwardPass: (Noop, ForceTokens, Backtrack, ForceOutput, ToolCalls, AdjustedLogits, EmitError, Steer),
    Sampled: (Noop, ForceTokens, Backtrack, ForceOutput, ToolCalls, EmitError, Steer),
    Added: (Noop, ForceTokens, Backtrack, ForceOutput, ToolCalls, EmitError, Steer),
}

#: Read-only view of the table: the one statement of which action each event allows, read by
#: :func:`validate_action` (exact event class), the SDK's ``ActionBuilder`` (:func:`allowed_actions`)
#: and the engine's phases (each applies exactly the actions its event's row lists).
ALLOWED_ACTIONS: Mapping[type[ModEvent], tuple[type[ModAction], ...]] = MappingProxyType(_ALLOWED_ACTIONS)


def allowed_actions(event: ModEvent | type[ModEvent]) -> tuple[type[ModAction], ...]:
    """The actions an event (or event class) allows, by ``isinstance`` — the SDK builder's
    reading of the table; ``()`` for an object that is no event."""
    cls = event if isinstance(event, type) else type(event)
    for base in cls.__mro__:
        if base in _ALLOWED_ACTIONS:
            return _ALLOWED_ACTIONS[base]
    return ()


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


# ------------------------------------------------------------------------------- value checks


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_token_ids(ids: Any, vocab: int, *, field: str = "tokens") -> list[int]:
    """``ids`` as a list of ints, each in ``[0, vocab)``. An id is anything Python accepts as an
    integer index (``int``, numpy integers, a one-element integer tensor); bools, floats (even
    integral ones) and anything else are refused, as is a bare string."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise InvalidActionValue(f"`{field}` must be a list of token ids, got {_short(ids)}.",
                                 parameter=field, value=ids)
    tokens: list[int] = []
    for i, token in enumerate(ids):
        try:
            if isinstance(token, (bool, np.bool_)):
                raise TypeError("a bool is not a token id")
            token = operator.index(token)
        except TypeError:
            raise InvalidActionValue(f"`{field}[{i}]` must be an int token id, got {_short(token)}.",
                                     parameter=f"{field}[{i}]", value=token) from None
        if not 0 <= token < vocab:
            raise InvalidActionValue(f"`{field}[{i}]` must be a token id in [0, {vocab}), got {token}.",
                                     parameter=f"{field}[{i}]", value=token)
        tokens.append(token)
    return tokens


def check_logits(logits: Any, *, field: str = "AdjustedLogits.logits", vocab: int | None = None) -> None:
    """Refuse logits that cannot be sampled from: not numeric, empty, holding NaN or +inf anywhere,
    or -inf everywhere (no token left). With ``vocab``, the shape must be ``[V]`` or ``[1, V]``.

    Takes anything numpy can read (a numpy array, or a CPU tensor through ``__array__``); the
    engine may check a device tensor itself with the same rule to avoid a copy to the host.
    """
    try:
        array = np.asarray(logits)
    except Exception as err:
        raise InvalidActionValue(f"`{field}` must be an array of numbers, got {type(logits).__name__} ({err}).",
                                 parameter=field, value=type(logits).__name__) from err
    if array.dtype.kind not in "biuf" or array.dtype.kind == "b":
        raise InvalidActionValue(f"`{field}` must be an array of numbers, got dtype {array.dtype}.",
                                 parameter=field, value=str(array.dtype))
    if vocab is not None and array.shape not in ((vocab,), (1, vocab)):
        raise InvalidActionValue(f"`{field}` must have shape [{vocab}] or [1, {vocab}], got {list(array.shape)}.",
                                 parameter=field, value=list(array.shape))
    if array.size == 0:
        raise InvalidActionValue(f"`{field}` must not be empty, got shape {list(array.shape)}.",
                                 parameter=field, value=list(array.shape))
    if array.dtype.kind != "f":
        return
    nan = int(np.isnan(array).sum())
    if nan:
        raise InvalidActionValue(f"`{field}` must not contain NaN, got {nan} NaN of {array.size} values.",
                                 parameter=field, value=f"{nan} NaN")
    pos_inf = int(np.isposinf(array).sum())
    if pos_inf:
        raise InvalidActionValue(f"`{field}` must not contain +inf, got {pos_inf} of {array.size} values.",
                                 parameter=field, value=f"{pos_inf} +inf")
    if np.isneginf(array).all():
        raise InvalidActionValue(f"`{field}` must leave at least one finite logit, got -inf everywhere.",
                                 parameter=field, value="all -inf")


def check_token_temp(value: Any, *, field: str = "AdjustedLogits.token_temp") -> float | None:
    """``None`` (keep the request's temperature), ``0`` (greedy, see docs/generation-rules.md) or a
    finite positive number, as a float; negative, NaN, infinite and non-numbers are refused."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidActionValue(f"`{field}` must be None or a number >= 0, got {_short(value)}.",
                                 parameter=field, value=value)
    temp = float(value)
    if not math.isfinite(temp) or temp < 0:
        raise InvalidActionValue(f"`{field}` must be None, 0 (greedy) or a finite number > 0, got {temp}.",
                                 parameter=field, value=temp)
    return temp


def check_steer(action: Steer, *, num_features: int | None = None) -> tuple[int, float]:
    """``(feature_id, scale)`` of a Steer: an int feature id (below ``num_features`` when given)
    and a finite scale."""
    fid = action.feature_id
    if isinstance(fid, (bool, np.bool_)) or not isinstance(fid, (numbers.Integral, np.integer)) or int(fid) < 0 or (
            num_features is not None and int(fid) >= num_features):
        bound = f"in [0, {num_features})" if num_features is not None else ">= 0"
        raise InvalidActionValue(f"`Steer.feature_id` must be an int feature id {bound}, got {_short(fid)}.",
                                 parameter="Steer.feature_id", value=fid)
    scale = action.scale
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real) or not math.isfinite(float(scale)):
        raise InvalidActionValue(f"`Steer.scale` must be a finite number, got {_short(scale)}.",
                                 parameter="Steer.scale", value=scale)
    return int(fid), float(scale)


def check_action_values(action: ModAction, vocab: int, *, logits: bool = True,
                        logits_width: int | None = None) -> None:
    """Check every value field of an action the engine will apply, once, before it is applied.

    ``vocab``: the tokenizer's vocabulary size (token ids must be below it). ``logits=False``
    skips ``AdjustedLogits.logits`` for a caller that checks them where they live (on a device);
    ``logits_width``: the width the logits must have (``[W]`` or ``[1, W]``).
    """
    name = type(action).__name__
    if isinstance(action, (ForceTokens, ForceOutput, AdjustedPrefill)):
        check_token_ids(action.tokens, vocab, field=f"{name}.tokens")
    elif isinstance(action, Backtrack):
        if action.n < 0:
            raise InvalidActionValue(f"`{name}.n` must be >= 0, got {action.n}.", parameter=f"{name}.n",
                                     value=action.n)
        if action.tokens is not None:
            check_token_ids(action.tokens, vocab, field=f"{name}.tokens")
    elif isinstance(action, Steer):
        check_steer(action)
    elif isinstance(action, AdjustedLogits):
        check_token_temp(action.token_temp, field=f"{name}.token_temp")
        if logits:
            check_logits(action.logits, field=f"{name}.logits", vocab=logits_width)
