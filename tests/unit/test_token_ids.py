"""``ForwardPass.input_ids`` is a view of its request's one list of ids (mods/token_ids.py): it
reads like the list it replaces, and every view keeps what it showed when its event was made
through every way ids join and leave the request (appends, Backtrack's erase, AdjustedPrefill's
new prompt)."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from engine.core.request import RequestState
from mods.token_ids import TokenIds


def test_a_view_reads_like_its_list():
    backing = [5, 6, 7, 8, 9, 10]
    ids, plain = TokenIds(backing, 4), [5, 6, 7, 8]
    assert len(ids) == 4 and list(ids) == plain and ids.tolist() == plain
    assert ids == plain and plain == ids and ids != [5, 6, 7] and ids != [5, 6, 7, 8, 9]
    assert ids != tuple(plain) and (ids == tuple(plain)) == (plain == tuple(plain))  # as the list it replaces
    assert ids == TokenIds(list(plain)) and ids != TokenIds(backing)
    assert [ids[i] for i in range(-4, 4)] == [plain[i] for i in range(-4, 4)]
    assert ids[np.int64(1)] == 6  # a numpy integer indexes it as it indexes a list
    for index in (4, -5, 100):
        with pytest.raises(IndexError):
            ids[index]
    for part in (slice(None), slice(1, 3), slice(-2, None), slice(None, None, 2), slice(None, None, -1),
                 slice(2, 100), slice(-100, 2)):
        assert ids[part] == plain[part] and type(ids[part]) is list
    assert list(reversed(ids)) == plain[::-1] and 8 in ids and 9 not in ids
    assert ids.index(7) == 2 and ids.count(6) == 1
    assert ids + [1] == plain + [1] and [1] + ids == [1] + plain
    assert np.asarray(ids).tolist() == plain and np.asarray(ids, dtype=np.int32).dtype == np.int32
    assert repr(ids) == repr(plain) and json.dumps(list(ids)) == json.dumps(plain)
    assert pickle.loads(pickle.dumps(ids)) == plain
    with pytest.raises(TypeError):
        hash(ids)
    with pytest.raises(TypeError):
        ids[0] = 1  # type: ignore[index]  # read-only
    with pytest.raises(ValueError):
        TokenIds([1, 2], 3)


def _state(prompt: list[int]) -> RequestState:
    request = SimpleNamespace(logprobs=-1, request_id="r")
    return RequestState(request=request, manager=None, payload=None, generator=None, plan=None,  # type: ignore[arg-type]
                        prompt_ids=list(prompt), max_tokens=32, forced_queue=[], event_layer=0)


def test_views_keep_what_they_showed_through_appends_erases_and_a_new_prompt():
    state = _state([1, 2])
    seen: list[tuple[TokenIds, list[int]]] = []

    def view() -> None:
        ids = state.token_ids()
        assert ids == state.prompt_ids + state.generated
        seen.append((ids, state.prompt_ids + state.generated))

    view()
    state.append([3])
    view()
    state.append([4, 5])
    view()
    state.erase(2)  # Backtrack: 4 and 5 leave; the views made before still show them
    view()
    state.append([6])
    view()
    state.replace_prompt([9, 9, 9])  # AdjustedPrefill
    view()
    state.append([7])
    view()
    assert [list(ids) for ids, _ in seen] == [then for _, then in seen]
    assert seen[2][0] == [1, 2, 3, 4, 5] and seen[4][0] == [1, 2, 3, 6] and seen[-1][0] == [9, 9, 9, 3, 6, 7]


def test_a_step_makes_no_list_of_its_own():
    """O(1) a step: the views of successive steps share one list (a list a step would cost a request
    O(length) a step and its events O(length²) ids)."""
    state = _state(list(range(1000)))
    first = state.token_ids()
    state.append([1])
    second = state.token_ids()
    assert first._ids is second._ids and len(first) == 1000 and len(second) == 1001
