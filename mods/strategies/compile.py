"""Compiling spec dicts (``quote_mod_sdk.strategies.compile``): the single-token ``tokens`` spec."""

from __future__ import annotations

from typing import Any, Dict, Set

from .primitives import TokensStrategy

__all__ = ["_compile_tokens_strategy"]


def _compile_tokens_strategy(spec: Dict[str, Any], tokenizer: Any) -> TokensStrategy:
    items = list(spec.get("items") or [])
    if not items:
        raise ValueError("tokens.items must be a non-empty list of strings")
    ids: Set[int] = set()
    for text in items:
        sequence = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
        if len(sequence) != 1:
            raise ValueError(f"tokens.items entry {text!r} must map to exactly one token")
        ids.add(sequence[0])
    return TokensStrategy(ids)
