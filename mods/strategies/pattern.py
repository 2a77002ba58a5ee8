"""PatternStrat: constrain an answer to a regular expression, where that can be done per position.

A pattern that is a fixed-length concatenation — literals, ``.``, ``\\d``, positive character
classes, ``{n}`` repeats, groups without alternation; anchors ignored — compiles to a positional
matcher: at each position only tokens whose text fits the next characters are allowed, so
``[0-9]{4}-[0-9]{2}-[0-9]{2}`` yields exactly a date shape. Any other pattern falls back to a
STRING CharsStrategy up to ``stop`` (the pattern then guides only the prompt), as the original
json_schema example did. The pattern is read with Python's own regex parser; the allowed set of
each position is computed once from the cached token-text table, not per step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import AbstractSet, Any, FrozenSet, List, Optional

try:  # the stdlib regex parser (public as sre_parse before 3.11)
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
    from re import _constants as _sre  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - older layouts
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _sre_parse  # type: ignore[no-redef]

from .base import IdSet, RuntimeState, Strategy, token_texts
from .primitives import CharsMode, CharsStrategy
from .strategy_constructor import StrategyConstructor

__all__ = ["PatternStrat", "FixedPatternStrategy", "fixed_positions"]

Position = Optional[FrozenSet[str]]  # None: any character but a newline

_DIGITS = frozenset("0123456789")


def _class_chars(items: list) -> Optional[FrozenSet[str]]:
    chars: set[str] = set()
    for op, arg in items:
        if op == _sre.LITERAL:
            chars.add(chr(arg))
        elif op == _sre.RANGE:
            chars.update(chr(c) for c in range(arg[0], arg[1] + 1))
        elif op == _sre.CATEGORY and arg == _sre.CATEGORY_DIGIT:
            chars |= _DIGITS
        else:  # negation, other categories: not a fixed positive class
            return None
    return frozenset(chars)


def _walk(parsed: Any) -> Optional[List[Position]]:
    positions: List[Position] = []
    for op, arg in parsed:
        if op == _sre.LITERAL:
            positions.append(frozenset(chr(arg)))
        elif op == _sre.ANY:
            positions.append(None)
        elif op == _sre.IN:
            chars = _class_chars(arg)
            if chars is None:
                return None
            positions.append(chars)
        elif op == _sre.AT:  # ^ and $: the answer is the whole match anyway
            continue
        elif op == _sre.SUBPATTERN:
            inner = _walk(arg[-1])
            if inner is None:
                return None
            positions.extend(inner)
        elif op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT):
            low, high, body = arg
            inner = _walk(body)
            if low != high or inner is None:
                return None  # variable length
            positions.extend(inner * low)
        else:  # alternation, back-references, lookarounds …
            return None
    return positions


def fixed_positions(pattern: str) -> Optional[List[Position]]:
    """The allowed characters at each position, or None if ``pattern`` is not fixed-length."""
    try:
        parsed = _sre_parse.parse(pattern)
    except re.error:
        return None
    positions = _walk(parsed)
    return positions or None


@dataclass
class _FixedState:
    pos: int = 0
    done: bool = False


class FixedPatternStrategy(Strategy):
    def __init__(self, positions: List[Position]) -> None:
        self._positions = positions
        self._length = len(positions)

    def _fits(self, text: str, pos: int) -> bool:
        if not text or pos + len(text) > self._length:
            return False
        for offset, ch in enumerate(text):
            allowed = self._positions[pos + offset]
            if (allowed is None and ch == "\n") or (allowed is not None and ch not in allowed):
                return False
        return True

    def start(self, tokenizer: Any) -> RuntimeState:
        return _FixedState()

    def allowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        if state.done or state.pos >= self._length:
            return set()
        table = token_texts(tokenizer)
        pos = state.pos
        return table.memo(("pattern", tuple(self._positions), pos),
                          lambda: IdSet(tid for tid, text in table.items() if self._fits(text, pos)))

    def disallowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        return set()

    def step(self, state: Any, token_id: int, tokenizer: Any) -> None:
        state.pos += len(token_texts(tokenizer).text(token_id))
        state.done = state.pos >= self._length

    def is_complete(self, state: Any) -> bool:
        return state.done or state.pos >= self._length

    def trim_answer(self, answer: str) -> str:
        return answer[: self._length]


class PatternStrat(StrategyConstructor):
    """``PatternStrat(pattern, stop="\\n", min_chars=0)`` — see the module docstring."""

    def __init__(self, pattern: Optional[str], stop: str = "\n", min_chars: int = 0) -> None:
        self.pattern = pattern
        self.stop = stop
        self.min_chars = min_chars

    def into_strategy(self, tokenizer: Any) -> Strategy:
        positions = fixed_positions(self.pattern) if isinstance(self.pattern, str) else None
        if positions is not None:
            return FixedPatternStrategy(positions)
        return CharsStrategy(CharsMode.STRING, stop=self.stop, min_chars=self.min_chars)
