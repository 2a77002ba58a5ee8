"""What a grammar's text may be before any native code sees it: at most ``structured.max_grammar_bytes``
bytes and ``structured.max_grammar_rules`` rules. Checked in Python, in microseconds, so an
oversized grammar is refused without costing a compile (in a child process or anywhere else).

Rules are counted the way each kind grows its grammar: a Lark grammar's rule and terminal
definitions (one per line: ``name:``, ``?name:``, ``NAME.2:``; ``%`` directives and ``|``
continuation lines are not), a JSON schema's objects (every ``{...}`` in it: each subschema or
definition becomes rules), a regex one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.core.structured.spec import GrammarSpec
from engine.errors import GrammarError

__all__ = ["check_budget", "count_rules"]

_LARK_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?\d+)?[ \t]*:", re.MULTILINE)


def count_rules(spec: GrammarSpec) -> int:
    """How many rules ``spec`` defines (see the module's docstring); a JSON schema nested too deep
    to read counts as too many."""
    if spec.kind == "grammar":
        return len(_LARK_DEFINITION.findall(spec.source))
    if spec.kind in ("json", "tool_call"):
        try:
            schema: Any = json.loads(spec.source)
        except RecursionError:
            return 1 << 62
        count, stack = 0, [schema]
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                count += 1
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
        return count
    return 1


def check_budget(spec: GrammarSpec, *, max_bytes: int, max_rules: int) -> None:
    """Raise :class:`GrammarError` naming the spec's field when its text is over either bound."""
    size = len(spec.source.encode("utf-8"))
    if size > max_bytes:
        raise GrammarError(f"`{spec.parameter}` must be at most {max_bytes} bytes (structured.max_grammar_bytes), got "
                           f"{size}; simplify it, or ask the operator to raise the limit",
                           parameter=spec.parameter, value=size)
    rules = count_rules(spec)
    if rules > max_rules:
        shown = "too deeply nested to count" if rules >= 1 << 62 else str(rules)
        raise GrammarError(f"`{spec.parameter}` must define at most {max_rules} rules "
                           f"(structured.max_grammar_rules), got {shown}; simplify it, or ask the operator to "
                           "raise the limit", parameter=spec.parameter, value=rules)
