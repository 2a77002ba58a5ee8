"""Strategy protocols and helpers (legacy name ``quote_mod_sdk.strategies.base``).

Strategies constrain generation token by token: ``allowed_tokens`` / ``disallowed_tokens`` give
id sets for the next step, ``step`` advances on each added token. Whole-vocabulary scans read
:func:`token_texts`, a per-tokenizer table of every id's decoded text built once (one batched
decode), so no step decodes the vocabulary again (a 128k vocabulary decoded per step costs
seconds). An id outside ``get_vocab()`` (some added tokens) is decoded when a strategy first
reads its text, as the original SDK decodes every id, without slowing the table's build.

Sets a strategy returns may be :class:`IdSet` — a frozenset that also carries its ids as a sorted
numpy array, so SelfPrompt masks logits without converting a 49k-element set each step.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Dict, Iterable, Optional, Protocol, Set, runtime_checkable

import numpy as np

from ..types import Backtrack, ForceTokens

__all__ = [
    "RuntimeState",
    "Strategy",
    "require_token_ids",
    "tokenize_str",
    "decode_token",
    "TrieNode",
    "IdSet",
    "TokenTexts",
    "token_texts",
]


class RuntimeState(Protocol):
    """Opaque per-generation state of a Strategy (each strategy defines its own fields)."""


@runtime_checkable
class Strategy(Protocol):
    """A token-level constraint. Empty ``allowed_tokens`` means "no positive constraint"."""

    def start(self, tokenizer: Any) -> RuntimeState: ...

    def allowed_tokens(self, state: RuntimeState, tokenizer: Any) -> AbstractSet[int]: ...

    def disallowed_tokens(self, state: RuntimeState, tokenizer: Any) -> AbstractSet[int]: ...

    def step(self, state: RuntimeState, token_id: int, tokenizer: Any) -> Optional[Backtrack] | Optional[ForceTokens]: ...

    def is_complete(self, state: RuntimeState) -> bool: ...

    def trim_answer(self, answer: str) -> str: ...


def require_token_ids(tokenizer: Any) -> Set[int]:
    """Every id of the tokenizer: ``get_vocab().values()``, else ``range(len(tokenizer))``."""
    vocab = getattr(tokenizer, "get_vocab", None)
    if callable(vocab):
        try:
            mapping = vocab()
        except Exception:
            mapping = None
        if isinstance(mapping, dict) and mapping:
            return {int(v) for v in mapping.values()}
    try:
        return set(range(int(len(tokenizer))))
    except Exception as exc:
        raise RuntimeError("Tokenizer must expose get_vocab() or __len__()") from exc


def tokenize_str(text: Optional[str], tokenizer: Any) -> list[int]:
    """``encode(text)`` without special tokens as a list of ints; ``[]`` for empty/None."""
    if not text:
        return []
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def decode_token(tokenizer: Any, token_id: int) -> str:
    """One id's text without special tokens; falls back to ``convert_ids_to_tokens``, else ``""``."""
    try:
        return tokenizer.decode([int(token_id)], skip_special_tokens=True)
    except Exception:
        convert = getattr(tokenizer, "convert_ids_to_tokens", None)
        if callable(convert):
            token = convert(int(token_id))
            return str(token) if token is not None else ""
    return ""


@dataclass
class TrieNode:
    children: Dict[int, "TrieNode"]
    terminal: bool = False

    def __init__(self) -> None:
        self.children = {}
        self.terminal = False

    def insert(self, sequence: list[int]) -> None:
        node = self
        for token in sequence:
            node = node.children.setdefault(int(token), TrieNode())
        node.terminal = True


class IdSet(frozenset):
    """A frozenset of token ids that also holds them as a sorted ``np.int64`` array."""

    array: np.ndarray

    def __new__(cls, ids: Iterable[int]) -> "IdSet":
        self = super().__new__(cls, ids)
        self.array = np.fromiter(sorted(self), dtype=np.int64, count=len(self))
        return self


class TokenTexts:
    """Decoded text of every vocabulary id, and memoised classifications of that table."""

    def __init__(self, tokenizer: Any) -> None:
        ids = sorted(require_token_ids(tokenizer))
        batch = getattr(tokenizer, "batch_decode", None)
        texts: list[str] | None = None
        if callable(batch):
            try:
                texts = list(batch([[i] for i in ids], skip_special_tokens=True))
            except Exception:
                texts = None
        if texts is None or len(texts) != len(ids):
            texts = [decode_token(tokenizer, i) for i in ids]
        self.ids = np.asarray(ids, dtype=np.int64)
        self._tokenizer = weakref.proxy(tokenizer) if _weakrefable(tokenizer) else tokenizer
        self._text = dict(zip(ids, texts))
        self._extra: dict[int, str] = {}  # ids outside the vocabulary, decoded when first seen
        self._memo: dict[Any, Any] = {}

    def text(self, token_id: int) -> str:
        """An id's text; an id outside ``get_vocab()`` (added tokens, or any id a model can still
        emit) is decoded on first use and kept, as the original SDK decodes every id it sees."""
        token_id = int(token_id)
        text = self._text.get(token_id)
        if text is None:
            text = self._extra.get(token_id)
        if text is None:
            text = self._extra[token_id] = decode_token(self._tokenizer, token_id)
        return text

    def items(self) -> Iterable[tuple[int, str]]:
        """The vocabulary's ids and texts only (what whole-vocabulary classes are built from)."""
        return self._text.items()

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """``build()`` once per key (e.g. a character class over the whole vocabulary)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


def _weakrefable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


_TABLES: "weakref.WeakKeyDictionary[Any, TokenTexts]" = weakref.WeakKeyDictionary()
_TABLES_BY_ID: dict[int, TokenTexts] = {}


def token_texts(tokenizer: Any) -> TokenTexts:
    """The tokenizer's :class:`TokenTexts`, built on first use and kept while the tokenizer lives."""
    try:
        table = _TABLES.get(tokenizer)
        if table is None:
            table = _TABLES[tokenizer] = TokenTexts(tokenizer)
        return table
    except TypeError:  # a tokenizer that takes no weak references: keyed by id for the process
        key = id(tokenizer)
        if key not in _TABLES_BY_ID:
            _TABLES_BY_ID[key] = TokenTexts(tokenizer)
        return _TABLES_BY_ID[key]
