"""A mod whose handler's guard turns an event away is not called for it, and the step makes no
round of calls for an event no mod of the request is called for; a
Sampled or Added event that no mod and no listener hears is recorded as it happens and made when
the request ends, in its place. Nothing else changes: the same mod behind a callable object, whose
guard the engine cannot read, is called for every event and gives the same tokens, events and
payload. A guard's names are resolved afresh after any mod call, so a mod that rebinds them
mid-step is seen by the next event of that step."""

from __future__ import annotations

from typing import Any

from engine.core.loop_calls import LoopCalls
from mods import Added, ForwardPass, Sampled, mod
from tests.core_fixtures import _payload as timeless  # the payload less its times and request id
from tests.helpers import assert_payload_valid

PROMPT = "What is the capital of France?"


def ban_first_choice(banned: int):
    @mod
    def ban(event, actions, tokenizer):
        if isinstance(event, ForwardPass):
            logits = event.logits.to_numpy()
            logits[0, banned] = -1e9
            return actions.adjust_logits(type(event.logits).from_numpy(logits).to(event.logits.device))
        return None

    return ban


class Opaque:
    """The same mod behind a callable object: every call is made."""

    __name__ = "ban"

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, event: Any, tokenizer: Any = None) -> Any:
        return self.inner(event, tokenizer)


def run(engine, mods, monkeypatch) -> tuple[Any, int, int]:
    """The result, the mod calls made, and the rounds of calls the step loop made."""
    rounds = [0]
    original = LoopCalls.run

    def counting(self, calls, start=0):
        rounds[0] += 1
        return original(self, calls, start)

    monkeypatch.setattr(LoopCalls, "run", counting)
    before = engine.metrics().mod_calls
    try:
        result = engine.generate(PROMPT, max_tokens=6, temperature=0.0, mods=mods)
    finally:
        monkeypatch.setattr(LoopCalls, "run", original)
    return result, engine.metrics().mod_calls - before, rounds[0]


def test_a_guarded_mod_is_called_only_for_what_its_guard_lets_through_and_nothing_else_changes(engine, monkeypatch):
    free = engine.generate(PROMPT, max_tokens=6, temperature=0.0)
    guarded = ban_first_choice(free.output_ids[0])
    read, read_calls, read_rounds = run(engine, [guarded], monkeypatch)
    every, every_calls, every_rounds = run(engine, [Opaque(guarded)], monkeypatch)

    assert read.output_ids != free.output_ids, "the mod had no effect: the comparison would prove nothing"
    assert read.output_ids == every.output_ids
    forward_passes = sum(isinstance(e, ForwardPass) for e in read.events)
    assert forward_passes == len(read.output_ids)
    assert read_calls == forward_passes and read_rounds == forward_passes
    assert every_calls == len(every.events) == 1 + 3 * forward_passes  # Prefilled, then 3 a step
    assert every_rounds == every_calls  # one request: one call a round
    assert facts(read.events) == facts(every.events)
    assert_payload_valid(read.payload)
    assert timeless(read.payload["events"]) == timeless(every.payload["events"])
    for part in ("mod_calls", "actions", "mod_logs"):
        assert timeless(read.payload[part]) == timeless(every.payload[part]), part


def facts(events) -> list[tuple[Any, ...]]:
    """What a result's events say, less the tensors (compared elsewhere)."""
    assert len({e.request_id for e in events}) == 1, "every event names its request"
    return [(type(e).__name__, e.step, getattr(e, "sampled_token", None), getattr(e, "added_tokens", None),
             getattr(e, "forced", None), getattr(e, "input_ids", None)) for e in events]


def noting(kind, seen: list):
    """A mod that hears ``kind`` only and notes what it heard (nothing else)."""
    @mod
    def note(event, actions, tokenizer):
        if isinstance(event, kind):
            seen.append((type(event).__name__, event.step))
        return None

    return note


def test_events_no_one_hears_are_made_in_their_places_when_the_request_ends(engine):
    # a mod that hears Sampled only: its ForwardPass and Added events are unheard (Added made later,
    # ForwardPass recorded as every step's is); one that hears Added only: Sampled is made later
    for kind in (Sampled, Added):
        read_seen: list = []
        every_seen: list = []
        read = engine.generate(PROMPT, max_tokens=5, temperature=0.0, mods=[noting(kind, read_seen)])
        every = engine.generate(PROMPT, max_tokens=5, temperature=0.0, mods=[Opaque(noting(kind, every_seen))])
        assert read_seen == every_seen and len(read_seen) == 5, kind
        assert facts(read.events) == facts(every.events), kind
        assert [type(e).__name__ for e in read.events] == ["Prefilled"] + ["ForwardPass", "Sampled", "Added"] * 5
        assert timeless(read.payload["events"]) == timeless(every.payload["events"]), kind
        assert_payload_valid(read.payload)


def test_a_listener_hears_every_event_as_it_happens_even_those_no_mod_hears(engine):
    heard: list = []
    result = engine.generate(PROMPT, max_tokens=4, temperature=0.0, mods=[noting(ForwardPass, [])],
                             on_event=lambda event: heard.append(event))
    assert [id(e) for e in heard] != [] and facts(heard) == facts(result.events)


def test_a_mod_that_rebinds_a_guards_name_mid_step_is_seen_by_that_steps_next_event(engine):
    """Two requests in one batch: the first has a mod that, on Sampled of step 1, rebinds the name
    another mod's guard reads (from ForwardPass to Added); that other mod is on both requests. The
    second request's Added of step 1 was decided before the rebinding ran (in the same pass of the
    step), the first's after it: the first request's mod hears Added from step 1 on."""
    namespace: dict[str, Any] = {"Kind": ForwardPass, "seen": []}
    exec("def watcher(event, tokenizer):\n"
         "    if isinstance(event, Kind):\n"
         "        seen.append((event.request_id, type(event).__name__, event.step))\n", namespace)
    watcher = namespace["watcher"]

    def rebinder(event, tokenizer):
        if isinstance(event, Sampled):
            if event.step == 1:
                namespace["Kind"] = Added
        return None

    ids = engine.encode(PROMPT)
    with engine.loop.admission_held():
        first = engine.submit(input_ids=ids, max_tokens=4, temperature=0.0, mods=[rebinder, watcher], request_id="first")
        second = engine.submit(input_ids=ids, max_tokens=4, temperature=0.0, mods=[watcher], request_id="second")
    first.result(), second.result()
    seen = namespace["seen"]
    assert ("first", "ForwardPass", 1) in seen and ("first", "ForwardPass", 2) not in seen
    assert ("first", "Added", 1) in seen  # decided after the rebinding mod's call of the same step
    assert ("second", "Added", 2) in seen and ("second", "ForwardPass", 2) not in seen


def test_a_listener_that_raises_fails_its_own_request_alone(engine):
    """A listener is user code like a mod: whatever it raises ends its own request with a reason,
    and the request beside it in the batch goes on (guards are read afresh after it either way)."""
    def listener(event):
        if isinstance(event, ForwardPass) and event.step == 1:
            raise RuntimeError("listener failed")

    ids = engine.encode(PROMPT)
    with engine.loop.admission_held():
        failing = engine.submit(input_ids=ids, max_tokens=4, temperature=0.0, mods=[noting(ForwardPass, [])],
                                on_event=listener)
        beside = engine.submit(input_ids=ids, max_tokens=4, temperature=0.0, mods=[noting(ForwardPass, [])])
    failed, ok = failing.result(), beside.result()
    assert failed.finish_reason.value == "error" and "listener failed" in (failed.error or "")
    assert len(ok.output_ids) == 4 and ok.finish_reason.value == "length"
