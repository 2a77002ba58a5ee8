"""Constrained-generation strategies (``quote_mod_sdk.strategies``)."""

from .base import RuntimeState, Strategy
from .pattern import PatternStrat
from .strategy_constructor import CharsMode, CharsStrat, ChoicesStrat, ListStrat, UntilStrat

__all__ = ["ChoicesStrat", "UntilStrat", "ListStrat", "CharsStrat", "CharsMode", "PatternStrat", "Strategy",
           "RuntimeState"]
