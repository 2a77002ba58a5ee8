"""``tokenize(text, tokenizer)``: the SDK's one way to turn text into ids.

A tokenizer with ``encode`` is called with ``add_special_tokens`` (default ``False``); a callable
one may return a dict with ``input_ids``. The result is always a list of ints; any encoding
failure is re-raised as ``RuntimeError``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tokenize"]


def _as_int_list(encoded: Any) -> list[int]:
    if isinstance(encoded, (list, tuple)):
        return [int(t) for t in encoded]
    if hasattr(encoded, "tolist"):
        listed = encoded.tolist()
        if isinstance(listed, (list, tuple)):
            return [int(t) for t in listed]
    try:
        return [int(t) for t in encoded]
    except TypeError:
        raise TypeError(f"tokenizer returned {type(encoded).__name__}, expected a sequence of ids") from None


def tokenize(text: str, tokenizer: Any, *, add_special_tokens: bool = False) -> list[int]:
    if tokenizer is None:
        raise RuntimeError("Tokenizer is required when calling tokenize().")
    if hasattr(tokenizer, "encode"):
        encode = lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens)  # noqa: E731
    elif callable(tokenizer):
        def encode() -> Any:
            enc = tokenizer(text)
            return enc["input_ids"] if isinstance(enc, dict) and "input_ids" in enc else enc
    else:
        raise RuntimeError("Tokenizer must provide encode(text, add_special_tokens=...) or be callable.")
    try:
        return _as_int_list(encode())
    except Exception as err:
        raise RuntimeError(f"Tokenizer failed to encode text: {err}") from err
