"""Strategy constructors: what mods build (``quote_mod_sdk.strategies.strategy_constructor``).

A constructor holds plain settings and compiles to a Strategy for a tokenizer
(``into_strategy``). Names, argument order and the falsy-argument rules match the original:
``ListStrat`` keeps class defaults for falsy arguments (``sep`` defaults to
``", "``) and a list of elements fixes ``min = max = len(elements)``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Protocol, runtime_checkable

from .base import Strategy, TrieNode, tokenize_str
from .list_strategy import ListStrategy
from .primitives import CharsMode, CharsStrategy, ChoicesStrategy, UntilEndType, UntilStrategy

__all__ = [
    "StrategyConstructor",
    "ChoicesStrat",
    "CharsStrat",
    "UntilStrat",
    "ListStrat",
    "CharsMode",
    "UntilEndType",
    "Strategy",
    "tokenize_str",
    "TrieNode",
    "ListStrategy",
    "UntilStrategy",
    "CharsStrategy",
    "ChoicesStrategy",
]


@runtime_checkable
class StrategyConstructor(Protocol):
    def into_strategy(self, tokenizer: Any) -> Strategy: ...


class ListStrat(StrategyConstructor):
    """``open``/``close`` around the list, ``wrap`` around each element, ``sep`` between them,
    ``end_with`` after the close; ``min``/``max`` element counts."""

    open: Optional[str] = None
    close: Optional[str] = None
    wrap: Optional[str] = None
    sep: str = ", "
    min: Optional[int] = None
    max: Optional[int] = None
    end_with: Optional[str] = None
    elements: List[StrategyConstructor] | StrategyConstructor = []

    def __init__(self, elements: List[StrategyConstructor] | StrategyConstructor, open: Optional[str] = None,
                 close: Optional[str] = None, wrap: Optional[str] = None, sep: Optional[str] = None,
                 min: Optional[int] = None, max: Optional[int] = None, end_with: Optional[str] = None) -> None:
        for name, value in (("open", open), ("close", close), ("wrap", wrap), ("sep", sep), ("min", min),
                            ("max", max), ("end_with", end_with)):
            if value:
                setattr(self, name, value)
        self.elements = elements
        if isinstance(elements, list):
            self.min = self.max = len(elements)

    def into_strategy(self, tokenizer: Any) -> Strategy:
        elements = self.elements
        compiled = ([e.into_strategy(tokenizer) for e in elements] if isinstance(elements, list)
                    else elements.into_strategy(tokenizer))
        return ListStrategy(
            open_ids=tokenize_str(self.open, tokenizer), close_ids=tokenize_str(self.close, tokenizer),
            wrap_ids=tokenize_str(self.wrap, tokenizer), sep_ids=tokenize_str(self.sep, tokenizer),
            end_with_ids=tokenize_str(self.end_with, tokenizer), min_elements=int(self.min or 0),
            max_elements=int(self.max) if isinstance(self.max, (int, float)) else None, elements=compiled,
        )


class CharsStrat(StrategyConstructor):
    """Characters of ``mode`` until ``stop`` (a string) or up to ``stop`` characters (an int);
    keyword ``min`` delays the stop."""

    mode: CharsMode
    min: Optional[int] = None
    stop: int | str

    def __init__(self, mode: CharsMode, stop: int | str, **kwargs: Any) -> None:
        if kwargs.get("min"):
            self.min = kwargs.get("min")
        self.mode = mode
        self.stop = stop

    def into_strategy(self, tokenizer: Any) -> Strategy:
        return CharsStrategy(self.mode, self.stop, self.min or 0)


class UntilStrat(StrategyConstructor):
    """Force ``start`` (if any), then generate until ``end`` (TAG) or any character of it (ANYCHAR)."""

    end_type: UntilEndType
    end: str
    start: Optional[str] = None

    def __init__(self, start: Optional[str], end_type: UntilEndType, end: str) -> None:
        self.start = start
        self.end_type = end_type
        self.end = end

    def into_strategy(self, tokenizer: Any) -> Strategy:
        return UntilStrategy(self.start, self.end_type, self.end)


class ChoicesStrat(StrategyConstructor):
    """One of ``choices`` (strings of any token length), through a trie of their token ids."""

    choices: List[str]

    def __init__(self, choices: List[str]) -> None:
        self.choices = choices

    def into_strategy(self, tokenizer: Any) -> Strategy:
        root = TrieNode()
        seen: set[tuple[int, ...]] = set()
        for text in self.choices:
            sequence = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
            if sequence and sequence not in seen:
                seen.add(sequence)
                root.insert(list(sequence))
        return ChoicesStrategy(root)
