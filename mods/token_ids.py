"""The token ids an event carries (``ForwardPass.input_ids``: the whole sequence so far), as a
read-only view of the first ``n`` ids of its request's sequence.

Every step of a request hands its mods a ForwardPass whose ``input_ids`` is the sequence so far,
and its result keeps every one. A fresh list each step would cost a request O(length) work per
step and its result O(length²) memory (1,000 steps after a 2,000-token prompt: 2.5 million ids, 20
MB a request). A view costs neither: the engine appends to one list per request and never changes
or removes an id a view can see (an erase starts a new list), so a view of the first ``n`` ids stays
what it was when its event was made.

It reads like the list it replaces: ``len``, indexing, slices (lists), iteration, ``in``, ``==``
with a list (not a tuple, as a list), ``+``, ``numpy.asarray``; ``list(ids)`` is a list of its own.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence, overload

import numpy as np

__all__ = ["TokenIds"]


class TokenIds(Sequence[int]):
    """The first ``n`` ids of ``ids`` (all of them when ``n`` is None), read-only."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: list[int], n: int | None = None) -> None:
        if n is None:
            n = len(ids)
        elif not 0 <= n <= len(ids):
            raise ValueError(f"a view of {n} ids needs a list of at least {n}, got {len(ids)}")
        self._ids, self._n = ids, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: Any) -> Any:
        n = self._n
        if type(index) is slice:
            start, stop, step = index.indices(n)
            return self._ids[start:stop] if step == 1 else self._ids[:n][index]
        i = index.__index__()  # an int-like index (a numpy integer too), as a list takes
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token index out of range")
        return self._ids[i]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._n)

    def __reversed__(self) -> Iterator[int]:
        return reversed(self._ids[:self._n])

    def __contains__(self, value: object) -> bool:
        return value in self._ids[:self._n]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self._n == other._n and (self._ids is other._ids or self._ids[:self._n] == other._ids[:other._n])
        if isinstance(other, list):  # not a tuple: the list it replaces equals none
            return self._n == len(other) and self._ids[:self._n] == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, which has none

    def __add__(self, other: Sequence[int]) -> list[int]:
        return self._ids[:self._n] + list(other)

    def __radd__(self, other: Sequence[int]) -> list[int]:
        return list(other) + self._ids[:self._n]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.array(self._ids[:self._n], dtype=dtype)

    def __repr__(self) -> str:
        return repr(self._ids[:self._n])

    def tolist(self) -> list[int]:
        """The ids as a list of their own (as ``numpy``'s and ``torch``'s ``tolist``)."""
        return self._ids[:self._n]
