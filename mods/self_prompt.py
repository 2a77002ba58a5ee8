"""SelfPrompt: the model prompts itself mid-answer, answers under a strategy, and (optionally)
erases the exchange (legacy name ``quote_mod_sdk.self_prompt``).

Per request: at the first ForwardPass the prompt is forced; while the strategy runs, each
ForwardPass masks the logits to the strategy's allowed tokens (AdjustedLogits, float32 numpy
through ``type(logits).from_numpy``); each Added steps the strategy. On completion an optional
suffix is forced, then — with ``EraseMode.PROMPT`` or ``ALL`` — a Backtrack erases prompt,
answer and suffix (``PROMPT`` re-injects the answer).

Kept from the original because mods depend on it: per-request state in ``_states`` (never
evicted; FlowEngine reads it), a ``completion`` dict produces no suffix, and forced
Added events of any mod count against the prompt/suffix still outstanding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence, Set

import numpy as np

from .actions import ActionBuilder
from .decorator import ModCallable, mod
from .tensor import MaskedLogits
from .strategies.strategy_constructor import ChoicesStrat, ListStrat, StrategyConstructor
from .types import Added, Backtrack, ForceTokens, ForwardPass, ModAction, Prefilled

__all__ = ["EraseMode", "SelfPrompt", "self_prompt_mod"]

_MAX_STRATEGY_BACKTRACK_ATTEMPTS = 3


class EraseMode(Enum):
    NONE = "none"
    PROMPT = "prompt"
    ALL = "all"


@dataclass
class _State:
    compiled: Any = None  # the compiled strategy (None until the request's first event)
    strat_state: Any = None
    prompt_tokens: List[int] = field(default_factory=list)
    prompt_emitted: bool = False
    outstanding_forced: int = 0
    completed: bool = False
    answer_tokens: List[int] = field(default_factory=list)
    suffix_tokens: List[int] = field(default_factory=list)
    suffix_pending: bool = False
    backtrack_n: int = 0
    backtrack_reinject: Optional[List[int]] = None
    backtrack_scheduled: bool = False
    strategy_backtrack_attempts: int = 0


def _encode(text: Optional[str], tokenizer: Any) -> List[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] if text else []


def _ids(values: Set[int]) -> np.ndarray:
    array = getattr(values, "array", None)  # IdSet carries its ids already as an array
    return array if isinstance(array, np.ndarray) else np.fromiter((int(v) for v in values), dtype=np.int64)


def mask_logits(logits: Any, allowed: Set[int], disallowed: Set[int], mask_value: float) -> Any:
    """``logits`` with every id outside ``allowed`` (when non-empty) and every id in ``disallowed``
    set to ``mask_value``: a :class:`~mods.tensor.MaskedLogits` the engine applies where its logits
    are (no host copy), whose ``to_numpy()`` is that edit of ``logits.to_numpy()``. Out-of-range
    ids are ignored; if none is in range the logits come back unchanged."""
    masked = MaskedLogits(logits, allowed=allowed if allowed else None, disallowed=disallowed or (), value=mask_value)
    if (masked.allowed is None or not len(masked.allowed)) and not len(masked.disallowed):
        return logits
    return masked


class SelfPrompt:
    def __init__(self, *, prompt: Optional[Dict[str, Any]] = None, strategy: StrategyConstructor,
                 completion: Any = None, erase: EraseMode = EraseMode.NONE, argmax_sampling: bool = False,
                 mask_value: float = -1e9) -> None:
        self._prompt_cfg = dict(prompt or {})
        self._strategy_spec = strategy
        self._completion_cfg = completion
        self._erase_cfg = erase
        self._argmax = argmax_sampling
        self._mask_value = float(mask_value)
        self._states: Dict[str, _State] = {}
        self._strategy_has_end_with = isinstance(strategy, ListStrat) and bool(strategy.end_with)

    # ------------------------------------------------------------------------------- helpers

    def _prompt_tokens(self, tokenizer: Any) -> List[int]:
        tokens = self._prompt_cfg.get("tokens")
        if isinstance(tokens, list):
            return [int(t) for t in tokens]
        return _encode(self._prompt_cfg.get("text") if isinstance(self._prompt_cfg.get("text"), str) else None,
                       tokenizer)

    def _suffix_tokens(self, tokenizer: Any) -> List[int]:
        return _encode(self._completion_cfg, tokenizer) if isinstance(self._completion_cfg, str) else []

    def _completion_force(self) -> bool:
        cfg = self._completion_cfg
        return bool(cfg.get("force", True)) if isinstance(cfg, dict) and cfg else True

    def _compile(self, st: _State, tokenizer: Any) -> None:
        st.compiled = self._strategy_spec.into_strategy(tokenizer)
        st.strat_state = st.compiled.start(tokenizer)
        st.prompt_tokens = self._prompt_tokens(tokenizer)
        st.prompt_emitted = st.completed = st.suffix_pending = st.backtrack_scheduled = False
        st.outstanding_forced = st.backtrack_n = st.strategy_backtrack_attempts = 0
        st.answer_tokens, st.suffix_tokens, st.backtrack_reinject = [], [], None

    def _retrim(self, st: _State, tokenizer: Any) -> None:
        """Re-derive the answer through the strategy's ``trim_answer`` (e.g. cut a stop string)."""
        st.answer_tokens = _encode(st.compiled.trim_answer(tokenizer.decode(st.answer_tokens)), tokenizer)

    def is_complete(self, request_id: str) -> bool:
        return self._states.setdefault(request_id, _State()).completed

    def answer_tokens(self, request_id: str) -> Optional[list[int]]:
        st = self._states.setdefault(request_id, _State())
        return st.answer_tokens if st.completed else None

    def refresh_responses(self, responses: Optional[Sequence[str]], request_id: Optional[str] = None,
                          idx: Optional[int] = None) -> None:
        """Replace the choices of a ChoicesStrat (or of element ``idx`` of a ListStrat); the
        request's state is dropped so it recompiles."""
        values = [str(v) for v in responses or []]
        spec = self._strategy_spec
        updated = False
        if isinstance(spec, ChoicesStrat):
            spec.choices, updated = values, True
        elif isinstance(spec, ListStrat) and idx is not None:
            # a list of one repeated element has that element at every index
            element = spec.elements[idx] if isinstance(spec.elements, list) else spec.elements
            if isinstance(element, ChoicesStrat):
                element.choices, updated = values, True
        if updated and isinstance(request_id, str):
            self._states.pop(request_id, None)

    # ------------------------------------------------------------------------------ handlers

    def handle_prefilled(self, event: Prefilled, tokenizer: Any | None) -> None:
        rid = getattr(event, "request_id", None)
        if isinstance(rid, str):
            st = self._states.setdefault(rid, _State())
            if st.compiled is None and tokenizer is not None:
                self._compile(st, tokenizer)

    def handle_forward_pass(self, event: ForwardPass, actions: ActionBuilder, tokenizer: Any | None) -> ModAction:
        rid = getattr(event, "request_id", None)
        if not isinstance(rid, str):
            return actions.noop()
        st = self._states.setdefault(rid, _State())
        if st.compiled is None:
            if tokenizer is None:
                return actions.noop()
            self._compile(st, tokenizer)
        if st.backtrack_scheduled and st.backtrack_n > 0:
            n, reinject = st.backtrack_n, st.backtrack_reinject
            st.backtrack_n, st.backtrack_reinject, st.backtrack_scheduled = 0, None, False
            st.completed = True
            return actions.backtrack(n, reinject)
        if not st.prompt_emitted:
            st.prompt_emitted = True
            if st.prompt_tokens:
                st.outstanding_forced = len(st.prompt_tokens)
                return actions.force_tokens(st.prompt_tokens)
        if st.outstanding_forced > 0:
            return actions.noop()
        if st.suffix_pending:
            st.suffix_pending = False
            if st.suffix_tokens:
                st.outstanding_forced = len(st.suffix_tokens)
                return actions.force_tokens(st.suffix_tokens)
        if st.strat_state is not None and st.compiled.is_complete(st.strat_state):
            return self._on_complete_at_forward(st, actions, tokenizer)
        allowed = st.compiled.allowed_tokens(st.strat_state, tokenizer)
        disallowed = st.compiled.disallowed_tokens(st.strat_state, tokenizer)
        if not allowed and not disallowed:
            return actions.noop()
        masked = mask_logits(event.logits, allowed, disallowed, self._mask_value)
        return actions.adjust_logits(masked, token_temp=0.0) if self._argmax else actions.adjust_logits(masked)

    def _on_complete_at_forward(self, st: _State, actions: ActionBuilder, tokenizer: Any) -> ModAction:
        if not st.completed:
            st.completed = True
            if self._erase_cfg != EraseMode.NONE:
                total = len(st.prompt_tokens) + len(st.answer_tokens) + len(st.suffix_tokens)
                reinject = list(st.answer_tokens) if self._erase_cfg == EraseMode.PROMPT else None
                self._retrim(st, tokenizer)
                return actions.backtrack(total, reinject)
        self._retrim(st, tokenizer)
        return actions.noop()

    def handle_added(self, event: Added, actions: ActionBuilder, tokenizer: Any | None) -> Optional[ModAction]:
        rid = getattr(event, "request_id", None)
        if not isinstance(rid, str):
            return None
        st = self._states.setdefault(rid, _State())
        if st.outstanding_forced > 0 and getattr(event, "forced", False):
            st.outstanding_forced = max(0, st.outstanding_forced - len(event.added_tokens or []))
            return None
        if st.compiled is None or st.strat_state is None or tokenizer is None:
            return None
        requested: List[int] = []
        erase = 0
        for token in event.added_tokens or []:
            asked = st.compiled.step(st.strat_state, int(token), tokenizer)
            if isinstance(asked, ForceTokens):
                requested.extend(asked.tokens)
            elif isinstance(asked, Backtrack):
                erase += asked.n
                requested.extend(asked.tokens or [])
            if not getattr(event, "forced", False) and not st.completed:
                st.answer_tokens.append(int(token))
        if st.compiled.is_complete(st.strat_state) and not st.completed:
            if self._on_complete_at_added(st, tokenizer):
                return None
        if erase > 0:
            st.strategy_backtrack_attempts += 1
            if st.strategy_backtrack_attempts > _MAX_STRATEGY_BACKTRACK_ATTEMPTS:
                return None
            return Backtrack(erase, requested)
        return ForceTokens(requested) if requested else None

    def _on_complete_at_added(self, st: _State, tokenizer: Any) -> bool:
        """Schedule the suffix or the erase; True when a suffix is now pending."""
        if not self._strategy_has_end_with and self._completion_force() and self._erase_cfg != EraseMode.ALL:
            st.suffix_tokens = self._suffix_tokens(tokenizer)
            if st.suffix_tokens:
                st.suffix_pending = True
                return True
        if self._erase_cfg != EraseMode.NONE:
            st.backtrack_n = len(st.prompt_tokens) + len(st.answer_tokens)
            st.backtrack_reinject = list(st.answer_tokens) if self._erase_cfg == EraseMode.PROMPT else None
            st.backtrack_scheduled = True
        else:
            st.completed = True
        self._retrim(st, tokenizer)
        return False


def self_prompt_mod(*, prompt: Optional[Dict[str, Any]] = None, strategy: StrategyConstructor,
                    completion: Optional[Dict[str, Any]] = None, erase: EraseMode = EraseMode.NONE,
                    mask_value: float = -1e9) -> ModCallable:
    """A ready-made mod around one SelfPrompt. (Its documented completion suffix is not applied,
    as in the original: only a plain string completion produces one.)"""
    helper = SelfPrompt(prompt=prompt, strategy=strategy, completion=completion, erase=erase, mask_value=mask_value)

    @mod
    def _handler(event: Any, actions: ActionBuilder, tokenizer: Any | None) -> ModAction:
        if isinstance(event, Prefilled):
            helper.handle_prefilled(event, tokenizer)
            return actions.noop()
        if isinstance(event, ForwardPass):
            return helper.handle_forward_pass(event, actions, tokenizer)
        if isinstance(event, Added):
            return helper.handle_added(event, actions, tokenizer) or actions.noop()
        return actions.noop()

    return _handler
