"""A step's ForwardPass goes to every watched request's mods in one round of calls, with no phase a
request (:meth:`RequestMachine.forward_calls`, then :meth:`RequestMachine.after_forward`); a step
whose mods force tokens instead of a sample adds them as a phase after the round, since its Added
may have listeners. Requests that do all of these side by side in one batch get what each gets
alone: tokens, finish, events and payload."""

from __future__ import annotations

from typing import Any

from engine.core.loop_calls import LoopCalls
from mods import Added, ForceTokens, ForwardPass
from mods.types import Noop
from tests.core_fixtures import _payload as timeless  # the payload less its times and request id
from tests.helpers import CharTokenizer, assert_payload_valid, ban_best_mod, scripted_engine

TOK = CharTokenizer()


def force_at_step_one(event, tokenizer=None):
    """Forces "XY" at step 1's ForwardPass and hears Added (so that step's Added goes to a mod)."""
    if isinstance(event, ForwardPass) and event.step == 1:
        return ForceTokens(TOK.encode("XY"))
    if isinstance(event, Added):
        return Noop()
    return None


def force_unheard(event, tokenizer=None):
    """Forces "Z" at step 2's ForwardPass and hears nothing else."""
    if isinstance(event, ForwardPass) and event.step == 2:
        return ForceTokens(TOK.encode("Z"))
    return None


MODS: dict[str, list[Any] | None] = {
    "logits mod": [ban_best_mod(3)],
    "forces, hears Added": [force_at_step_one],
    "forces, hears nothing else": [force_unheard],
    "both": [force_at_step_one, ban_best_mod(2)],
    "no mod": None,
}


def _run(names: list[str]) -> dict[str, Any]:
    eng = scripted_engine()
    try:
        with eng.loop.admission_held():  # one batch, at the same step throughout
            handles = {name: eng.submit(input_ids=TOK.encode("Q:"), mods=MODS[name], max_tokens=8,
                                        on_event=(lambda e: None) if name == "no mod" else None)
                       for name in names}
        return {name: h.result(timeout=60) for name, h in handles.items()}
    finally:
        eng.close()


def test_one_batch_of_mixed_mods_gives_each_request_what_it_gets_alone(monkeypatch):
    rounds: list[list[tuple[str, int]]] = []
    real = LoopCalls.run

    def recording(self, calls, start=0):
        rounds.append([(type(c.event).__name__, c.event.step) for c in calls[start:]])
        return real(self, calls, start)
    monkeypatch.setattr(LoopCalls, "run", recording)
    together = _run(list(MODS))
    monkeypatch.setattr(LoopCalls, "run", real)
    # a step: one round with every ForwardPass call of the batch (five: the logits mods' guards and
    # the forcing mods' let ForwardPass through), then one with the two Added calls; at step 1 those
    # are the forced tokens' Added, added after the ForwardPass round as a phase
    for step in range(4):
        assert rounds[2 * step] == [("ForwardPass", step)] * 5, rounds[:8]
        assert rounds[2 * step + 1] == [("Added", step)] * 2, rounds[:8]

    for name in MODS:
        alone = _run([name])[name]
        got = together[name]
        assert (got.output_ids, got.output_text, got.finish_reason, got.error) == \
            (alone.output_ids, alone.output_text, alone.finish_reason, alone.error), name
        assert [(type(e).__name__, e.step) for e in got.events] == \
            [(type(e).__name__, e.step) for e in alone.events], name
        assert_payload_valid(got.payload)
        for part in ("events", "mod_calls", "actions"):
            assert timeless(got.payload[part]) == timeless(alone.payload[part]), (name, part)

    assert together["forces, hears Added"].output_text[1:3] == "XY"
    assert together["forces, hears nothing else"].output_text[2] == "Z"
    assert together["logits mod"].output_text != together["no mod"].output_text  # the bans took effect
    forced = [e for e in together["forces, hears Added"].events if isinstance(e, Added) and e.step == 1]
    assert len(forced) == 1 and forced[0].forced and forced[0].added_tokens == TOK.encode("XY")
