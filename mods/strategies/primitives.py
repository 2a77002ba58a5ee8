"""Primitive strategies: choices, until, chars, tokens (``quote_mod_sdk.strategies.primitives``).

Behaviour follows the original SDK's strategies. Deliberate differences: CharsStrategy with an
integer ``stop`` means "at most N characters, done at N" (the original crashed on it);
per-vocabulary character classes come from the cached :func:`token_texts` table instead of
decoding every id per instance; UntilStrategy's accumulated tokens are per state (the original
shared one list between all states).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import AbstractSet, Any, List, Optional, Set, cast

from ..types import Backtrack, ForceTokens
from .base import IdSet, RuntimeState, Strategy, TrieNode, decode_token, require_token_ids, token_texts  # noqa: F401

__all__ = [
    "ChoicesStrategy",
    "UntilEndType",
    "UntilStrategy",
    "CharsMode",
    "CharsStrategy",
    "TokensStrategy",
]

def _eos(tokenizer: Any) -> Set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return {int(eos)} if eos else set()  # a falsy id (0) means "none", as in the original


# ------------------------------------------------------------------------------------- choices


@dataclass
class _ChoicesState:
    active: List[TrieNode] = field(default_factory=list)
    has_terminal: bool = False
    started: bool = False
    done: bool = False


class ChoicesStrategy(Strategy):
    """Follow a trie of token sequences. A choice that is a prefix of another completes first
    (kept from the original); an off-trie token restarts matching from the root."""

    def __init__(self, root: TrieNode) -> None:
        self._root = root

    def start(self, tokenizer: Any) -> RuntimeState:
        return cast(RuntimeState, _ChoicesState(active=[self._root]))

    def allowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        nodes = state.active or [self._root]
        state.has_terminal = any(node.terminal for node in nodes)
        return {token for node in nodes for token in node.children}

    def disallowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        return set()

    def step(self, state: Any, token_id: int, tokenizer: Any) -> None:
        state.started = True
        kept: List[TrieNode] = []
        for node in state.active or [self._root]:
            child = node.children.get(int(token_id))
            if child is not None and child not in kept:
                kept.append(child)
        state.active = [] if all(node.terminal for node in kept) else kept
        state.has_terminal = any(node.terminal for node in kept)

    def is_complete(self, state: Any) -> bool:
        if not state.done:
            state.done = state.started and not state.active and state.has_terminal
        return state.done

    def trim_answer(self, answer: str) -> str:
        return answer


# --------------------------------------------------------------------------------------- until


class UntilEndType(Enum):
    TAG = auto()
    ANYCHAR = auto()


@dataclass
class _UntilState:
    done: bool = False
    accum_toks: List[int] = field(default_factory=list)
    accum: str = ""
    max_len: Optional[int] = None
    disallow_eos: bool = True


class UntilStrategy(Strategy):
    """Force an optional start tag, then allow anything until ``stop`` (TAG) or any of its
    characters (ANYCHAR) has appeared in the generated text (the start tag counts)."""

    def __init__(self, start_tag: Optional[str], end_type: UntilEndType, stop: str) -> None:
        self._start_tag = start_tag
        self.end_type = end_type
        self.stop = stop
        self._stop_chars = set(stop) if end_type == UntilEndType.ANYCHAR else set()

    def start(self, tokenizer: Any) -> RuntimeState:
        return cast(RuntimeState, _UntilState())

    def allowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        if self._start_tag and len(state.accum) < len(self._start_tag):
            tag = tokenizer.encode(self._start_tag, add_special_tokens=False)
            done = tokenizer.encode(state.accum, add_special_tokens=False)
            return {int(tag[len(done)])}
        table = token_texts(tokenizer)
        return table.memo(("all",), lambda: IdSet(table.ids.tolist()))

    def disallowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        return _eos(tokenizer) if state.disallow_eos else set()

    def step(self, state: Any, token_id: int, tokenizer: Any) -> None:
        if state.done:
            return
        state.accum_toks.append(int(token_id))
        state.accum += token_texts(tokenizer).text(token_id)
        if self.end_type == UntilEndType.TAG:
            state.done = self.stop in state.accum
        else:
            state.done = any(ch in state.accum for ch in self._stop_chars)

    def is_complete(self, state: Any) -> bool:
        return state.done

    def trim_answer(self, answer: str) -> str:
        return answer


# --------------------------------------------------------------------------------------- chars


class CharsMode(Enum):
    ALPHA = auto()
    ALPHANUMERIC = auto()
    STRING = auto()
    NUMERIC = auto()
    JS_FLOAT = auto()


_UNESCAPED_QUOTE = re.compile(r'(?<!\\)"')


@dataclass
class _CharsState:
    char_count: int = 0
    stop_token: Optional[int] = None
    done: bool = False
    seen_decimal: bool = False  # JS_FLOAT bookkeeping
    seen_exponent: bool = False
    after_exponent: bool = False
    started: bool = False


class CharsStrategy(Strategy):
    """Characters of one class until a stop string (``stop: str``) or up to ``stop: int`` characters.

    ``min_chars`` delays the stop until that many characters were generated. Token classes:
    ALPHA ``isalpha``, ALPHANUMERIC ``isalnum``, NUMERIC/JS_FLOAT ``isdigit``, STRING anything
    without an unescaped ``"``; pieces that contain the stop string are allowed once ``min``
    is reached.
    """

    def __init__(self, kind: CharsMode, stop: int | str, min_chars: int = 0,
                 include_stop_in_answer: bool = False) -> None:
        self._kind = kind
        self._min = int(min_chars) if isinstance(min_chars, (int, float)) else 0
        if isinstance(stop, int) and not isinstance(stop, bool):
            self._max: Optional[int] = int(stop)
            self._stop: Optional[str] = None
        else:
            self._max = None
            self._stop = str(stop)
        self._include_stop = include_stop_in_answer

    # -- character classes over the cached vocabulary table --

    def _plain(self, text: str) -> bool:
        if not text:
            return False
        if self._kind == CharsMode.ALPHA:
            return text.isalpha()
        if self._kind == CharsMode.ALPHANUMERIC:
            return text.isalnum()
        if self._kind == CharsMode.STRING:
            return _UNESCAPED_QUOTE.search(text) is None
        return text.isdigit()

    def _with_stop(self, text: str) -> bool:
        stop = self._stop
        if not stop or stop not in text:
            return False
        if self._kind == CharsMode.ALPHA:
            return text.endswith(stop) and text[: len(stop)].isalpha()
        if self._kind == CharsMode.ALPHANUMERIC:
            return text.endswith(stop) and text[: len(stop)].isalnum()
        if self._kind == CharsMode.STRING:
            prefix = text[: len(stop)] if self._include_stop else text[: text.index(stop)]
            ok = _UNESCAPED_QUOTE.search(prefix) is None
            return (text.endswith(stop) and ok) if self._include_stop else ok
        return text.isdigit()

    def _classes(self, tokenizer: Any) -> tuple[list[tuple[int, int]], IdSet]:
        """(plain pieces as (length, id) sorted by length, pieces allowed with the stop)."""
        table = token_texts(tokenizer)

        def build() -> tuple[list[tuple[int, int]], IdSet]:
            plain = sorted((len(text), tid) for tid, text in table.items() if self._plain(text))
            plain_ids = {tid for _, tid in plain}
            with_stop = IdSet(tid for tid, text in table.items() if tid not in plain_ids and self._with_stop(text))
            return plain, with_stop

        return table.memo(("chars", self._kind, self._stop, self._include_stop), build)

    def _plain_up_to(self, tokenizer: Any, remaining: Optional[int]) -> IdSet:
        plain, _ = self._classes(tokenizer)
        key = ("chars-len", self._kind, self._stop, self._include_stop, remaining)
        return token_texts(tokenizer).memo(
            key, lambda: IdSet(tid for length, tid in plain if remaining is None or length <= remaining))

    def _js_float(self, tokenizer: Any) -> dict[str, IdSet]:
        table = token_texts(tokenizer)

        def build() -> dict[str, IdSet]:
            groups: dict[str, set[int]] = {"digit": set(), ".": set(), "-": set(), "e": set()}
            for tid, text in table.items():
                if text and text.isdigit():
                    groups["digit"].add(tid)
                elif text in (".", "-"):
                    groups[text].add(tid)
                elif text in ("e", "E"):
                    groups["e"].add(tid)
            return {name: IdSet(ids) for name, ids in groups.items()}

        return table.memo(("js-float",), build)

    # -- protocol --

    def start(self, tokenizer: Any) -> RuntimeState:
        stop_token = int(tokenizer.encode(self._stop, add_special_tokens=False)[0]) if self._stop else None
        return cast(RuntimeState, _CharsState(stop_token=stop_token))

    def allowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        stop_ok = state.stop_token is not None and state.char_count >= self._min
        if self._kind == CharsMode.JS_FLOAT:
            groups = self._js_float(tokenizer)
            allowed = set(groups["digit"])
            if not state.seen_decimal and state.started:
                allowed |= groups["."]
            if not state.seen_exponent and state.started:
                allowed |= groups["e"]
            if not state.started or state.after_exponent:
                allowed |= groups["-"]
            if stop_ok:
                allowed.add(state.stop_token)
            return allowed
        remaining = None if self._max is None else self._max - state.char_count
        plain = self._plain_up_to(tokenizer, remaining)
        if not stop_ok:
            return plain
        _, with_stop = self._classes(tokenizer)
        key = ("chars-stop", self._kind, self._stop, self._include_stop, remaining, state.stop_token)
        return token_texts(tokenizer).memo(key, lambda: IdSet(plain | with_stop | {state.stop_token}))

    def disallowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        return _eos(tokenizer)

    def step(self, state: Any, token_id: int, tokenizer: Any) -> None:
        text = token_texts(tokenizer).text(token_id)
        if (state.stop_token is not None and int(token_id) == state.stop_token) or (self._stop and self._stop in text):
            state.done = True
            return
        if self._kind == CharsMode.JS_FLOAT:
            if text.isdigit():
                state.started, state.after_exponent = True, False
            elif text == ".":
                state.seen_decimal = True
            elif text in ("e", "E"):
                state.seen_exponent = state.after_exponent = True
            elif text == "-":
                state.after_exponent = False
        state.char_count += len(text)
        if self._max is not None and state.char_count >= self._max:
            state.done = True
        elif not self.allowed_tokens(state, tokenizer):
            state.done = True

    def is_complete(self, state: Any) -> bool:
        if self._max is not None and self._max - state.char_count <= 0:
            state.done = True
        return state.done

    def trim_answer(self, answer: str) -> str:
        if self._stop and not self._include_stop and self._stop in answer:
            return answer[: answer.index(self._stop)]
        return answer


# -------------------------------------------------------------------------------------- tokens


@dataclass
class _TokensState:
    done: bool = False


class TokensStrategy(Strategy):
    """Exactly one token out of a fixed set."""

    def __init__(self, token_ids: Set[int]) -> None:
        self._token_ids = IdSet(int(t) for t in token_ids)

    def start(self, tokenizer: Any) -> RuntimeState:
        return cast(RuntimeState, _TokensState())

    def allowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        return self._token_ids

    def disallowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        return set()

    def step(self, state: Any, token_id: int, tokenizer: Any) -> Optional[Backtrack] | Optional[ForceTokens]:
        state.done = True
        return None

    def is_complete(self, state: Any) -> bool:
        return state.done

    def trim_answer(self, answer: str) -> str:
        return answer
