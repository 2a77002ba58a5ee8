"""Requests whose prompts come in at the same step have their Prefilled dispatched together: one
round of calls for all of them (it was one each, when each round cost ~150 us of thread wake-ups
on a 2-core host), before any of their ForwardPass; what each mod sees and does is unchanged."""

from __future__ import annotations

from mods import Added, ForwardPass, Prefilled, Sampled
from mods.types import AdjustedPrefill, ForceOutput
from tests.helpers import CharTokenizer, scripted_engine

TOK = CharTokenizer()


def _batches_of(eng) -> list[list[str]]:
    """Wrap the loop's runner of mod calls: each round's event types, in order."""
    batches: list[list[str]] = []
    runner = eng.loop.mod_calls
    run = runner.run

    def recording(calls, start=0):
        batches.append([type(p.event).__name__ for p in calls[start:]])
        return run(calls, start)

    runner.run = recording
    return batches


def test_prefilled_of_requests_admitted_together_goes_out_in_one_round():
    seen: dict[str, list[str]] = {}

    def watcher(event, tokenizer=None):
        seen.setdefault(event.request_id, []).append(type(event).__name__)
        return None

    eng = scripted_engine()
    try:
        batches = _batches_of(eng)
        with eng.loop.admission_held():
            handles = [eng.submit(input_ids=TOK.encode("Q:"), mods=[watcher]) for _ in range(4)]
        results = [h.result(timeout=60) for h in handles]
    finally:
        eng.close()
    assert all(r.output_text == "hello world" for r in results)
    with_prefilled = [b for b in batches if "Prefilled" in b]
    assert with_prefilled == [["Prefilled"] * 4], batches
    for r in results:
        kinds = seen[r.request_id]
        assert kinds[:2] == ["Prefilled", "ForwardPass"] and kinds.count("Prefilled") == 1, kinds
        assert [type(e) for e in r.events[:2]] == [Prefilled, ForwardPass]
        assert {type(e) for e in r.events} == {Prefilled, ForwardPass, Sampled, Added}


def test_prefilled_actions_still_apply_per_request_when_dispatched_together():
    def shape(event, tokenizer=None):
        if isinstance(event, Prefilled):
            if event.input_ids == TOK.encode("A:"):
                return ForceOutput(TOK.encode("forced"))
            if event.input_ids == TOK.encode("B:"):
                return AdjustedPrefill(TOK.encode("Q:"), max_steps=5)
        return None

    eng = scripted_engine()
    try:
        with eng.loop.admission_held():
            handles = [eng.submit(input_ids=TOK.encode(p), mods=[shape]) for p in ("A:", "B:", "Q:")]
        forced, adjusted, plain = [h.result(timeout=60) for h in handles]
    finally:
        eng.close()
    assert forced.output_text == "forced" and forced.finish_reason == "stop"
    assert not any(isinstance(e, ForwardPass) for e in forced.events)
    assert adjusted.output_text == "hello"  # the adjusted prompt, at most 5 new tokens
    assert plain.output_text == "hello world"
