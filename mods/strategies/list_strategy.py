"""ListStrategy: open, elements (optionally wrapped) with separators, close, end_with.

Phase machine: ``in_open → await_element → [in_wrap_open] → in_element →
[in_wrap_close] → await_sep → in_separator → await_element … → in_close → [in_end_with] →
complete``. Fixed sequences (open, wrap, sep, close, end_with) are forced one token at a time.
In ``await_element`` both "start an element" (while under ``max``) and "close" (once ``min``
elements are done) are allowed; in ``await_sep`` the separator (under ``max``) and close.

The original's known quirks are kept, since mods were written against them: without
``wrap`` an element never hands over to the separator phase; after a one-token separator one
step has no constraint; an element whose stop character is the wrap character needs it twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, List, Optional, Set

from ..types import Backtrack, ForceTokens
from .base import RuntimeState, Strategy

__all__ = ["ListStrategy"]


@dataclass
class _ListState:
    phase: str = "await_element"
    open_pos: int = 0
    wrap_pos: int = 0
    sep_pos: int = 0
    close_pos: int = 0
    end_with_pos: int = 0
    elements_completed: int = 0
    element_state: Optional[Any] = None
    _complete: bool = False


class ListStrategy(Strategy):
    def __init__(self, *, open_ids: List[int], close_ids: List[int], wrap_ids: List[int], sep_ids: List[int],
                 end_with_ids: List[int], min_elements: int, max_elements: Optional[int],
                 elements: Strategy | list[Strategy]) -> None:
        self._open = list(open_ids or [])
        self._close = list(close_ids or [])
        self._wrap = list(wrap_ids or [])
        self._sep = list(sep_ids or [])
        self._end_with = list(end_with_ids or [])
        self._min = int(min_elements) if isinstance(min_elements, (int, float)) else 0
        self._max = int(max_elements) if isinstance(max_elements, (int, float)) else None
        self._elements = elements

    # -- helpers --

    def _element(self, state: _ListState) -> Strategy:
        return self._elements[state.elements_completed] if isinstance(self._elements, list) else self._elements

    def start_element(self, state: _ListState, tokenizer: Any) -> Any:
        return self._element(state).start(tokenizer)

    def element_completed(self, state: _ListState) -> bool:
        return self._element(state).is_complete(state.element_state)

    def _under_max(self, state: _ListState) -> bool:
        return self._max is None or state.elements_completed < self._max

    @staticmethod
    def _at(seq: List[int], pos: int) -> Set[int]:
        return {seq[pos]} if pos < len(seq) else set()

    # -- protocol --

    def start(self, tokenizer: Any) -> RuntimeState:
        return _ListState(phase="in_open" if self._open else "await_element")

    def is_complete(self, state: Any) -> bool:
        return state._complete

    def disallowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        return set()

    def allowed_tokens(self, state: Any, tokenizer: Any) -> AbstractSet[int]:
        if state._complete:
            return set()
        phase = state.phase
        if phase == "in_open":
            return self._at(self._open, state.open_pos)
        if phase == "await_element":
            allowed: Set[int] = set()
            if self._under_max(state):
                if self._wrap:
                    allowed.add(self._wrap[0])
                else:
                    state.element_state = self.start_element(state, tokenizer)
                    allowed |= set(self._element(state).allowed_tokens(state.element_state, tokenizer))
            if self._close and state.elements_completed >= self._min:
                allowed.add(self._close[0])
            return allowed
        if phase in ("in_wrap_open", "in_wrap_close"):
            return self._at(self._wrap, state.wrap_pos)
        if phase == "in_element":
            if state.element_state is None:
                state.element_state = self.start_element(state, tokenizer)
            if self._wrap and self.element_completed(state):
                return {self._wrap[0]}
            return set(self._element(state).allowed_tokens(state.element_state, tokenizer))
        if phase == "await_sep":
            allowed = set()
            if self._sep and self._under_max(state):
                allowed.add(self._sep[0])
            if self._close and state.elements_completed >= self._min:
                allowed.add(self._close[0])
            return allowed
        if phase == "in_separator":
            return self._at(self._sep, state.sep_pos)
        if phase == "in_close":
            if state.close_pos < len(self._close):
                return {self._close[state.close_pos]}
            return self._at(self._end_with, state.end_with_pos) if self._end_with else set()
        if phase == "in_end_with":
            return self._at(self._end_with, state.end_with_pos)
        return set()

    def step(self, state: Any, token_id: int, tokenizer: Any) -> Optional[Backtrack] | Optional[ForceTokens]:
        if state._complete:
            return None
        token = int(token_id)
        phase = state.phase
        if phase == "in_open":
            if state.open_pos < len(self._open) and token == self._open[state.open_pos]:
                state.open_pos += 1
                if state.open_pos >= len(self._open):
                    state.phase = "await_element"
        elif phase == "await_element":
            self._step_await_element(state, token, tokenizer)
        elif phase == "in_wrap_open":
            if state.wrap_pos < len(self._wrap) and token == self._wrap[state.wrap_pos]:
                state.wrap_pos += 1
                if state.wrap_pos >= len(self._wrap):
                    state.element_state = self.start_element(state, tokenizer)
                    state.phase = "in_element"
        elif phase == "in_element":
            self._step_in_element(state, token, tokenizer)
        elif phase == "in_wrap_close":
            if state.wrap_pos < len(self._wrap) and token == self._wrap[state.wrap_pos]:
                state.wrap_pos += 1
                if state.wrap_pos >= len(self._wrap):
                    state.elements_completed += 1
                    state.phase, state.wrap_pos = "await_sep", 0
        elif phase == "await_sep":
            if self._sep and token == self._sep[0] and self._under_max(state):
                state.phase, state.sep_pos = "in_separator", 1
            elif self._close and token == self._close[0] and state.elements_completed >= self._min:
                state.phase, state.close_pos = "in_close", 1
                self._step_close(state, token)
        elif phase == "in_separator":
            if state.sep_pos < len(self._sep) and token == self._sep[state.sep_pos]:
                state.sep_pos += 1
            if state.sep_pos >= len(self._sep):
                state.phase, state.sep_pos = "await_element", 0
        elif phase == "in_close":
            self._step_close(state, token)
        if state.phase == "in_end_with" and phase == "in_end_with":
            if state.end_with_pos < len(self._end_with) and token == self._end_with[state.end_with_pos]:
                state.end_with_pos += 1
                if state.end_with_pos >= len(self._end_with):
                    state._complete = True
        return None

    def _step_await_element(self, state: _ListState, token: int, tokenizer: Any) -> None:
        if self._wrap and token == self._wrap[0]:
            state.wrap_pos = 1
            if state.wrap_pos >= len(self._wrap):
                state.element_state = self.start_element(state, tokenizer)
                state.phase = "in_element"
            else:
                state.phase = "in_wrap_open"
        elif self._close and token == self._close[0] and state.elements_completed >= self._min:
            state.phase, state.close_pos = "in_close", 1
        elif not self._wrap:
            if state.element_state is None:
                state.element_state = self.start_element(state, tokenizer)
            self._element(state).step(state.element_state, token, tokenizer)
            state.phase = "in_element"

    def _step_in_element(self, state: _ListState, token: int, tokenizer: Any) -> None:
        if state.element_state is None:
            state.element_state = self.start_element(state, tokenizer)
        if self._wrap and self.element_completed(state) and token == self._wrap[0]:
            state.wrap_pos = 1
            if state.wrap_pos >= len(self._wrap):
                state.elements_completed += 1
                state.phase, state.wrap_pos = "await_sep", 0
            else:
                state.phase = "in_wrap_close"
            return
        self._element(state).step(state.element_state, token, tokenizer)

    def _step_close(self, state: _ListState, token: int) -> None:
        if state.close_pos < len(self._close) and token == self._close[state.close_pos]:
            state.close_pos += 1
        elif self._end_with and state.close_pos >= len(self._close):
            if state.end_with_pos < len(self._end_with) and token == self._end_with[state.end_with_pos]:
                state.end_with_pos += 1
                if state.end_with_pos >= len(self._end_with):
                    state._complete = True
            return
        if state.close_pos >= len(self._close) and state.phase == "in_close":
            if self._end_with:
                state.phase, state.end_with_pos = "in_end_with", 0
            else:
                state._complete = True

    def trim_answer(self, answer: str) -> str:
        return answer
