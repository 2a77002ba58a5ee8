"""A request whose Sampled and Added events nobody hears (no listener, and every mod's guard turns
them away: the usual logits mod) ends its step on the loop's thread with no phase to drive
(:meth:`RequestMachine.on_sample_now`); one whose mods hear either gets the phase. Which of the two
ended a step changes nothing a result shows: tokens, finish, events and payload are the same."""

from __future__ import annotations

from typing import Any

from engine.core.machine import RequestMachine
from mods import Added, Sampled
from mods.types import Noop
from tests.core_fixtures import _payload as timeless  # the payload less its times and request id
from tests.helpers import CharTokenizer, ban_best_mod, assert_payload_valid, scripted_engine

TOK = CharTokenizer()


ban_best = ban_best_mod(4)  # hears ForwardPass only: the best token of the first steps banned


def hears_sampled(event, tokenizer=None):
    if isinstance(event, Sampled):
        return Noop()
    return None


def hears_added(event, tokenizer=None):
    if isinstance(event, Added):
        return Noop()
    return None


MODS = {"ForwardPass only": [ban_best], "Sampled too": [ban_best, hears_sampled],
        "Added too": [hears_added, ban_best]}


def _run() -> dict[str, Any]:
    eng = scripted_engine()
    try:
        with eng.loop.admission_held():  # one batch, at the same step throughout
            handles = {name: eng.submit(input_ids=TOK.encode("Q:"), mods=mods, max_tokens=8)
                       for name, mods in MODS.items()}
        return {name: h.result(timeout=60) for name, h in handles.items()}
    finally:
        eng.close()


def test_a_step_nobody_hears_after_its_sample_ends_without_a_phase_and_gives_the_same_results(monkeypatch):
    ended_here: list[str] = []
    real = RequestMachine.on_sample_now

    def spy(self, sample):
        hold = real(self, sample)
        if hold is not None:
            ended_here.append(self.request_id)
        return hold
    monkeypatch.setattr(RequestMachine, "on_sample_now", spy)
    now = _run()
    assert ended_here and set(ended_here) == {now["ForwardPass only"].request_id}, \
        "only the request whose Sampled and Added nobody hears ends its steps without a phase"
    assert len(ended_here) == len(now["ForwardPass only"].output_ids)  # every one of its steps

    monkeypatch.setattr(RequestMachine, "on_sample_now", lambda self, sample: None)  # every step driven
    driven = _run()
    for name in MODS:
        a, b = now[name], driven[name]
        assert a.output_text != "hello wo"  # the bans took effect
        assert (a.output_ids, a.output_text, a.finish_reason, a.error) == \
            (b.output_ids, b.output_text, b.finish_reason, b.error), name
        assert [type(e).__name__ for e in a.events] == [type(e).__name__ for e in b.events], name
        assert [getattr(e, "step", None) for e in a.events] == [getattr(e, "step", None) for e in b.events]
        assert_payload_valid(a.payload)
        for part in ("events", "mod_calls", "actions"):
            assert timeless(a.payload[part]) == timeless(b.payload[part]), (name, part)
