"""The rows of a step's logits that mods hand back (``AdjustedLogits`` of the row they were lent) are
checked (finite, and their greedy choice found) just before the step's draw, every row of the step
in one search on the step loop's thread. Whether the check was settled in the phase or before the
draw changes nothing a mod or a result can see: outputs, events, payloads and the fault a
non-finite row is."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from engine.core.actions import PhaseActions
from engine.model.tensor import HostLogits
from mods import ForwardPass
from mods.types import Backtrack, ForceTokens, Prefilled
from tests.core_fixtures import _payload as timeless  # the payload less its times and request id
from tests.helpers import CharTokenizer, ban_best_mod, assert_payload_valid, scripted_engine

TOK = CharTokenizer()
N = 4  # requests admitted together: one batch, at the same step throughout


def _run(mod: Any, **generation: Any) -> list[Any]:
    eng = scripted_engine(**generation)
    try:
        with eng.loop.admission_held():
            handles = [eng.submit(input_ids=TOK.encode("Q:"), mods=[mod]) for _ in range(N)]
        return [h.result(timeout=60) for h in handles]
    finally:
        eng.close()


def _ban_best(poison_request: int | None = None):
    """Bans each step's best token and hands back the row; the ``poison_request``-th request to
    reach step 2 hands back a row of -inf there (nothing can be sampled from it: a fault)."""
    order: list[str] = []

    def poison(event, row) -> None:
        if event.step == 2 and poison_request is not None:
            order.append(event.request_id)
            if len(order) == poison_request + 1:
                row[0, :] = float("-inf")
    return ban_best_mod(6, then=poison)


def _same(a: Any, b: Any) -> None:
    assert (a.output_text, a.sequence_ids, a.finish_reason, a.error) == \
        (b.output_text, b.sequence_ids, b.finish_reason, b.error)
    assert [type(e).__name__ for e in a.events] == [type(e).__name__ for e in b.events]
    assert [(type(x).__name__, getattr(x, "_source", None)) for x in a.actions] == \
        [(type(x).__name__, getattr(x, "_source", None)) for x in b.actions]
    assert [(i.step, i.reason) for i in a.ignored_actions] == [(i.step, i.reason) for i in b.ignored_actions]
    assert_payload_valid(a.payload)
    for part in ("events", "mod_calls", "actions", "mod_logs"):
        assert timeless(a.payload[part]) == timeless(b.payload[part]), part


@pytest.fixture
def searches(monkeypatch) -> list[tuple[str, int]]:
    """Every search of rows handed back, as (the thread that searched, rows searched)."""
    seen: list[tuple[str, int]] = []
    real = HostLogits._search

    def search(self, spans):
        seen.append((threading.current_thread().name, sum(len(span.keys) for span in spans)))
        return real(self, spans)
    monkeypatch.setattr(HostLogits, "_search", search)
    return seen


@pytest.mark.parametrize("keep_logits", [False, True], ids=["lent in place", "copied"])
@pytest.mark.parametrize("poison", [None, 1], ids=["every row usable", "one request's row all -inf"])
def test_rows_handed_back_are_checked_at_the_draw_in_one_search_with_the_results_of_a_check_in_the_phase(
        keep_logits, poison, searches, monkeypatch):
    settled: list[int] = []
    real_settle = PhaseActions.settle
    monkeypatch.setattr(PhaseActions, "settle", lambda self, plan: settled.append(1) or real_settle(self, plan))
    at_draw = _run(_ban_best(poison), keep_logits=keep_logits)
    # the loop's thread searched each step's four rows handed back at once; once the poisoned
    # request has failed, three
    assert {n for _, n in searches} == ({4} if poison is None else {4, 3}), searches
    assert all(name == "raylens-step-loop" for name, _ in searches), searches
    assert len(settled) == sum(n for _, n in searches)  # each row handed back was checked at the draw

    real_adjust = PhaseActions.adjust_logits
    monkeypatch.setattr(PhaseActions, "adjust_logits",  # every check made in the phase, at once
                        lambda self, item, action, plan, *, last=False: real_adjust(self, item, action, plan))
    settled.clear()
    in_phase = _run(_ban_best(poison), keep_logits=keep_logits)
    assert not settled

    assert at_draw[0].output_text != "hello world"  # the bans took effect
    if poison is not None:
        assert sorted(r.finish_reason.value for r in at_draw).count("error") == 1
        failed = next(r for r in at_draw if r.finish_reason.value == "error")
        assert "must be finite" in failed.error
    for a, b in zip(sorted(at_draw, key=lambda r: r.error or ""), sorted(in_phase, key=lambda r: r.error or "")):
        _same(a, b)


def _backtrack_at_step_3(event, tokenizer=None):
    if isinstance(event, ForwardPass) and event.step == 3:
        return Backtrack(1)
    return None


def _force_at_prefill(event, tokenizer=None):  # a plain mod: its ForceTokens at Prefilled is queued
    if isinstance(event, Prefilled):
        return ForceTokens(TOK.encode("ab"))
    return None


@pytest.mark.parametrize("other", [_backtrack_at_step_3, _force_at_prefill],
                         ids=["an action after it in the phase", "forced tokens queued"])
def test_a_row_handed_back_is_checked_in_the_phase_when_the_step_may_not_draw(other, monkeypatch):
    """The check is left to the draw only when the AdjustedLogits is the phase's last action and
    no forced tokens are queued: otherwise the step may end without a draw (a Backtrack after it,
    the queued tokens committed), and the row is checked in the phase, as a copy's is."""
    settled: list[int] = []
    real_settle = PhaseActions.settle
    monkeypatch.setattr(PhaseActions, "settle", lambda self, plan: settled.append(1) or real_settle(self, plan))

    def run(copy: bool) -> list[Any]:
        eng = scripted_engine()
        try:
            with eng.loop.admission_held():
                handles = [eng.submit(input_ids=TOK.encode("Q:"), mods=[ban_best_mod(6, copy=copy), other])
                           for _ in range(N)]
            return [h.result(timeout=60) for h in handles]
        finally:
            eng.close()
    lent, copied = run(False), run(True)
    for a, b in zip(lent, copied):
        _same(a, b)
    actions = {type(x).__name__ for r in lent for x in r.actions}
    assert {"AdjustedLogits", "Backtrack" if other is _backtrack_at_step_3 else "ForceTokens"} <= actions
    if other is _force_at_prefill:
        assert lent[0].output_text.startswith("ab")
    assert settled, "the other steps' checks are settled at the draw"
