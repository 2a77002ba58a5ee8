"""A row of a step's logits is lent to its mod in place (no host copy) when nothing reads the row
after the mod but its draw, whose argmax the runner found before the mod ran: one mod, no
listener, logits not kept, a plain greedy draw. Its mod then edits the engine's own row; nothing the engine samples, records or returns
changes for it. Every other request's mods get the copy, as before."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.core.machine import RequestMachine
from mods import ForwardPass
from tests.core_fixtures import _payload as timeless  # the payload less its times and request id
from tests.helpers import CharTokenizer, ban_best_mod, assert_payload_valid, scripted_engine

TOK = CharTokenizer()


def _is_batch_row(event, array) -> bool:
    """Whether ``array`` (what the event's first read handed out) is the batch's own row."""
    return np.shares_memory(array, event.logits._host.batch.detach().numpy())


def _run(mods: list[Any], *, listener=None, n: int = 3, submit: dict[str, Any] | None = None, **generation):
    """``n`` requests admitted together (one batch, at the same step throughout)."""
    eng = scripted_engine(**generation)
    try:
        with eng.loop.admission_held():
            handles = [eng.submit(input_ids=TOK.encode("Q:"), mods=mods, on_event=listener, **(submit or {}))
                       for _ in range(n)]
        return [h.result(timeout=60) for h in handles]
    finally:
        eng.close()


def _scribbler(seen: dict[int, bool]):
    """Reads its row, notes whether it was lent in place, then overwrites it wholesale (the
    model's best token banned, another raised far above it) and returns nothing."""
    def scribble(event, tokenizer=None):
        if isinstance(event, ForwardPass):
            logits = event.logits.to_numpy()
            seen.setdefault(event.step, _is_batch_row(event, logits))
            best = int(logits.argmax())
            logits[0, :] = -5.0
            logits[0, best] = -1e9
            logits[0, (best + 7) % logits.shape[1]] = 1e9
        return None
    return scribble


def _same(a, b) -> None:
    assert a.output_text == b.output_text and a.sequence_ids == b.sequence_ids
    assert [type(e).__name__ for e in a.events] == [type(e).__name__ for e in b.events]
    assert_payload_valid(a.payload)
    for part in ("events", "mod_calls", "actions", "mod_logs"):
        assert timeless(a.payload[part]) == timeless(b.payload[part]), part


def test_a_mods_writes_into_a_row_lent_in_place_change_nothing_it_did_not_return(monkeypatch):
    in_place: dict[int, bool] = {}
    lent = _run([_scribbler(in_place)])
    assert in_place and all(in_place.values()), f"the rows were not lent in place: {in_place}"
    monkeypatch.setattr(RequestMachine, "_in_place", lambda self: False)  # every row copied, as before
    copied: dict[int, bool] = {}
    reference = _run([_scribbler(copied)])
    assert copied and not any(copied.values())
    for a, b in zip(lent, reference):
        assert a.output_text == "hello world"  # the model's own choices, step after step
        _same(a, b)


def test_a_row_lent_in_place_and_handed_back_is_applied_as_the_copy_would_be(monkeypatch):
    """The usual edit-and-return (the best token banned, the row handed back): the same outputs,
    events and payload as when the row is copied; the bans take effect."""
    seen: dict[int, bool] = {}

    ban_best = ban_best_mod(6, then=lambda event, row: seen.setdefault(event.step, _is_batch_row(event, row)))

    lent = _run([ban_best])
    assert seen and all(seen.values())
    monkeypatch.setattr(RequestMachine, "_in_place", lambda self: False)
    seen.clear()
    reference = _run([ban_best])
    assert seen and not any(seen.values())
    assert lent[0].output_text != "hello world"  # the bans took effect
    for a, b in zip(lent, reference):
        _same(a, b)


def test_a_second_read_of_a_row_lent_in_place_is_a_copy_of_it_as_its_mod_left_it():
    """The one nuance of a row lent in place: its mod's own later reads in the step see what it
    wrote there (the row is the engine's, not a copy) — and still nothing else does."""
    seconds: list[tuple[bool, float]] = []

    def write_then_read(event, tokenizer=None):
        if isinstance(event, ForwardPass):
            first = event.logits.to_numpy()
            first[0, 3] = 123.0
            again = event.logits.to_numpy()
            seconds.append((np.shares_memory(first, again), float(again[0, 3])))
        return None

    results = _run([write_then_read], n=1)
    assert results[0].output_text == "hello world"
    assert seconds and all(not shared and value == 123.0 for shared, value in seconds), seconds


def _noop(event, tokenizer=None):
    return None


@pytest.mark.parametrize("case", ["two mods", "a listener", "kept logits", "temperature", "logit_bias",
                                  "repetition_penalty", "top_logprobs"])
def test_a_row_anything_else_may_read_is_copied_for_its_mods(case):
    """Whatever else may read a row after its mods — another mod, a listener, the result (kept
    logits), a draw that reads the whole row — gets its mods the copy, so every reader sees the
    forward's logits."""
    seen: dict[int, bool] = {}
    mods: list[Any] = [_scribbler(seen)]
    listener = None
    submit: dict[str, Any] = {}
    generation: dict[str, Any] = {}
    if case == "two mods":
        mods.append(_noop)
    elif case == "a listener":
        listener = lambda event: None  # noqa: E731
    elif case == "kept logits":
        generation["keep_logits"] = True
    elif case == "temperature":
        submit.update(temperature=0.7, seed=3)
    elif case == "logit_bias":
        submit["logit_bias"] = {5: 0.5}
    elif case == "repetition_penalty":
        submit["repetition_penalty"] = 1.3
    else:
        submit["top_logprobs"] = 2
    _run(mods, listener=listener, n=1, submit=submit, **generation)
    assert seen and not any(seen.values()), seen


def test_a_row_is_lent_in_place_only_once_min_tokens_no_longer_holds_back_its_stop_tokens():
    seen: dict[int, bool] = {}
    _run([_scribbler(seen)], n=1, submit={"min_tokens": 4})
    assert seen and all(seen[s] == (s >= 4) for s in seen), seen
