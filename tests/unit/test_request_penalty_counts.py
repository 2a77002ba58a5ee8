"""The penalties' token counts stay equal to a fresh count of the request's tokens through every
way tokens join and leave it: sampled or forced tokens appended, Backtrack's erase, and a new
prompt from AdjustedPrefill."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.core.request import RequestState

VOCAB = 16
CPU = torch.device("cpu")


def _state(prompt: list[int]) -> RequestState:
    request = SimpleNamespace(logprobs=-1, request_id="r")
    return RequestState(request=request, manager=None, payload=None, generator=None, plan=None,  # type: ignore[arg-type]
                        prompt_ids=list(prompt), max_tokens=32, forced_queue=[], event_layer=0)


def _fresh(tokens: list[int]) -> list[float]:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB).float().tolist()


def test_counts_follow_appends_and_erases():
    state = _state([1, 2, 2])
    generated = state.penalty_counts("generated", VOCAB, CPU)
    history = state.penalty_counts("history", VOCAB, CPU)
    assert generated.tolist() == [0.0] * VOCAB and history.tolist() == _fresh([1, 2, 2])
    state.append([5, 5, 7])
    state.append([2])
    assert generated.tolist() == _fresh([5, 5, 7, 2]) and history.tolist() == _fresh([1, 2, 2, 5, 5, 7, 2])
    state.erase(2)  # Backtrack: 7 and 2 leave
    assert state.generated == [5, 5]
    assert generated.tolist() == _fresh([5, 5]) and history.tolist() == _fresh([1, 2, 2, 5, 5])
    # the same tensors are read every step: nothing was re-counted
    assert state.penalty_counts("generated", VOCAB, CPU) is generated


def test_a_new_prompt_or_vocabulary_is_counted_afresh():
    state = _state([1, 1])
    state.append([3])
    first = state.penalty_counts("history", VOCAB, CPU)
    kept = state.penalty_counts("generated", VOCAB, CPU)
    state.replace_prompt([4])  # what AdjustedPrefill does
    assert state.penalty_counts("history", VOCAB, CPU).tolist() == _fresh([4, 3])
    assert first.tolist() == _fresh([1, 1, 3])  # the old tensor is no longer kept in step
    assert state.penalty_counts("generated", VOCAB, CPU) is kept  # the generated tokens did not change
    assert state.cached == 0 and state.output is None  # the new prompt is fed by the next forwards
    wider = state.penalty_counts("generated", VOCAB + 4, CPU)  # logits of another width
    assert wider.shape == (VOCAB + 4,) and wider[3] == 1.0
