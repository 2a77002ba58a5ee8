"""Running llguidance's native code so that a grammar cannot take the process down.

What was measured (llguidance 1.9): building a grammar is recursive in its depth. A Lark grammar
chaining 2,500 rules needs about 8 MiB of stack, 5,000 about twice that, and past the thread's
stack the process dies of SIGSEGV — a Python exception is never raised. The same happens with a
JSON schema whose ``$ref``s chain a thousand definitions. ``grammar_from_lark`` and
``grammar_from_regex`` only hand the text on; the crash is in the compile that
``LLMatcher(...)`` and ``validate_grammar`` both run, and llguidance has no serialized form of a
compiled grammar that another process could hand back. Once built, a matcher's per-step work
(masks, ``consume``, ``rollback``, ``deep_copy``) is iterative: a 5,000-rule chain runs through
every step on a 256 KiB stack, so it is bounded by the step limits below, not by the stack.

Hence the rule (:mod:`engine.core.structured.compiler` applies it): a grammar is compiled first
in a child process (:mod:`.isolation`) on a thread of :data:`CHILD_STACK_BYTES`, and only a
grammar that compiled there is built in this process — once per distinct grammar, on a thread of
:data:`PARENT_STACK_BYTES`, four times as much stack for the same, deterministic recursion — and
each request gets a ``deep_copy`` of that build.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, TypeVar

__all__ = ["CHILD_STACK_BYTES", "PARENT_STACK_BYTES", "run_with_stack", "parser_limits", "LIMIT_KEYS"]

T = TypeVar("T")

#: the child compiles on this much stack (a Linux thread's default)
CHILD_STACK_BYTES = 8 * 1024 * 1024
#: this process builds a grammar that compiled in the child on four times as much
PARENT_STACK_BYTES = 4 * CHILD_STACK_BYTES

#: the ``structured`` config keys that are llguidance's ``LLParserLimits`` fields
LIMIT_KEYS = ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items", "max_lexer_states",
              "max_grammar_size")

_stack_lock = threading.Lock()


def run_with_stack(fn: Callable[[], T], stack_bytes: int) -> T:
    """``fn()`` on a new thread with ``stack_bytes`` of stack; its value, or its exception raised
    here. Python sets a new thread's stack size process-wide (``threading.stack_size``), so it is
    set for this one start and put back, under a lock; a thread another caller starts in that
    instant gets the larger stack, which costs only address space."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # re-raised in the caller's thread below
            box["error"] = err

    with _stack_lock:
        previous = threading.stack_size(stack_bytes)
        try:
            thread = threading.Thread(target=target, name="raylens-grammar-build", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def parser_limits(limits: Mapping[str, int]) -> Any:
    """llguidance's ``LLParserLimits`` from the ``structured`` config's values (:data:`LIMIT_KEYS`);
    its error messages leave out the parser's state and the grammar (they reach clients)."""
    import llguidance

    return llguidance.LLParserLimits(**{key: int(limits[key]) for key in LIMIT_KEYS}, verbose_errors=False)
