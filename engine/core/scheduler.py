"""Which requests run in a step and how many tokens each feeds: a request budget and a token budget.

Admission fills free batch places (``backend.max_batch``) from the wait queue in arrival order,
while the KV cache can reserve the tokens each may use (``fits``: the paged cache admits by
tokens, not by ``max_batch × max_sequence``); the first that does not fit waits, and so does
everyone behind it. Each step's forward then feeds at most ``backend.max_step_tokens`` tokens::

    decoding requests first: one token each, reserved — a stream never waits for a prefill
    a decoding request with more to feed (forced tokens, a new prompt after AdjustedPrefill)
        takes what the reservation left
    prompts being prefilled, in arrival order: chunks filling the rest of the budget

so a long prompt is prefilled in chunks over several steps while every decoding neighbour keeps
receiving a token per step. The scheduler reads only what a request needs fed
(:attr:`~engine.core.machine.RequestMachine.pending_tokens`) and whether it is decoding.
"""

from __future__ import annotations

import collections
from typing import Callable, Protocol, Sequence, TypeVar

__all__ = ["Scheduler", "Schedulable"]


class Schedulable(Protocol):
    @property
    def decoding(self) -> bool: ...

    @property
    def pending_tokens(self) -> int: ...


T = TypeVar("T")


class Scheduler:
    def __init__(self, *, max_batch: int, max_step_tokens: int) -> None:
        if max_step_tokens < max_batch:
            raise ValueError(f"`max_step_tokens` must be >= max_batch ({max_batch}), got {max_step_tokens}; "
                             f"raise backend.max_step_tokens or lower backend.max_batch")
        self.max_batch = max_batch
        self.max_step_tokens = max_step_tokens

    def admit(self, waiting: collections.deque[T], active: int,
              fits: Callable[[T, bool], bool] | None = None) -> list[T]:
        """Take from the front of ``waiting`` what fits next to ``active`` running requests:
        ``fits(request, alone)`` reserves its cache room (``alone``: nothing else would run)."""
        new: list[T] = []
        while waiting and active + len(new) < self.max_batch:
            if fits is not None and not fits(waiting[0], active + len(new) == 0):
                break
            new.append(waiting.popleft())
        return new

    def schedule(self, running: Sequence[Schedulable]) -> list[tuple[int, int]]:
        """``(index in running, tokens it may feed now)`` for every running request that needs a
        forward, decoding ones first, within the step's token budget."""
        decoding, prefilling = [], []
        for i, m in enumerate(running):
            need = m.pending_tokens
            if need:
                (decoding if m.decoding else prefilling).append((i, need))
        left = self.max_step_tokens - len(decoding)  # one token reserved for each decoding row
        out: list[tuple[int, int]] = []
        for i, need in decoding:
            extra = min(need - 1, max(0, left))
            left -= extra
            out.append((i, 1 + extra))
        for i, need in prefilling:
            if left <= 0:
                break
            take = min(need, left)
            left -= take
            out.append((i, take))
        return out
