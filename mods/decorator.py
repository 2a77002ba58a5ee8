"""``@mod`` and ``create_mod``: turn a handler into the callable the ModManager calls.

Legacy mods import this module as ``quote_mod_sdk.mod``. Handlers are written as
``handler(event, actions, tokenizer)`` or ``handler(event, actions)``; the wrapped mod is called
as ``mod(event, tokenizer=None)`` and always returns a validated action.

``@mod`` uses ``functools.wraps`` so the wrapper carries ``__wrapped__`` and the handler's name:
the original test harness finds a mod as a function with ``__wrapped__``, and mod names in logs
come from ``__name__``.

Two-argument fallback: the original retried *any* ``TypeError`` with two
arguments, running the handler body twice and losing the real error. We keep the retry only where
it can help — a handler whose signature accepts both forms — and otherwise call the handler with
the arity its signature takes, so a ``TypeError`` raised inside a handler surfaces as itself.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from .actions import ActionBuilder
from .types import ModAction, ModEvent
from .validation import InvalidActionError, validate_action

__all__ = ["mod", "create_mod", "ModCallable", "validate_action", "InvalidActionError"]

ModCallable = Callable[[ModEvent, Any], ModAction]


def _accepts(handler: Callable[..., Any], nargs: int) -> bool:
    try:
        inspect.signature(handler).bind(*([None] * nargs))
    except TypeError:
        return False
    except ValueError:  # no signature available (builtins, some C callables): assume it may
        return True
    return True


def mod(handler: Callable[..., Any]) -> ModCallable:
    takes_three = _accepts(handler, 3)
    takes_two = _accepts(handler, 2)

    @functools.wraps(handler)
    def wrapper(event: ModEvent, tokenizer: Any = None) -> ModAction:
        builder = ActionBuilder(event)
        if not takes_three:
            result = handler(event, builder)
        else:
            try:
                result = handler(event, builder, tokenizer)
            except TypeError as first:
                if not takes_two:
                    raise
                try:
                    result = handler(event, builder)
                except TypeError as second:
                    raise second from first
        return validate_action(event, result)

    return wrapper


def create_mod(handler: Callable[..., Any]) -> ModCallable:
    """Like :func:`mod` for three-argument handlers, without ``functools.wraps`` or fallback."""

    def _mod(event: ModEvent, tokenizer: Any = None) -> ModAction:
        return validate_action(event, handler(event, ActionBuilder(event), tokenizer))

    return _mod
