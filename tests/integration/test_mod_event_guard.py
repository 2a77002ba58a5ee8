"""A mod whose handler's guard turns an event away is not called for it, and the step makes no
round (no hand-off to the mods' thread) for an event no mod of the request is called for. Nothing
else changes: the same mod behind a callable object, whose guard the engine cannot read, is called
for every event and gives the same tokens, events and payload."""

from __future__ import annotations

from typing import Any

import mods.manager as manager_module
from mods import ForwardPass, mod
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
    """The result, the mod calls made, and the hand-offs to the mods' thread."""
    handoffs = [0]
    original = manager_module.CallRunner.run

    def counting(self, calls):
        handoffs[0] += 1
        return original(self, calls)

    monkeypatch.setattr(manager_module.CallRunner, "run", counting)
    before = engine.metrics().mod_calls
    try:
        result = engine.generate(PROMPT, max_tokens=6, temperature=0.0, mods=mods)
    finally:
        monkeypatch.setattr(manager_module.CallRunner, "run", original)
    return result, engine.metrics().mod_calls - before, handoffs[0]


def test_a_guarded_mod_is_called_only_for_what_its_guard_lets_through_and_nothing_else_changes(engine, monkeypatch):
    free = engine.generate(PROMPT, max_tokens=6, temperature=0.0)
    guarded = ban_first_choice(free.output_ids[0])
    read, read_calls, read_handoffs = run(engine, [guarded], monkeypatch)
    every, every_calls, every_handoffs = run(engine, [Opaque(guarded)], monkeypatch)

    assert read.output_ids != free.output_ids, "the mod had no effect: the comparison would prove nothing"
    assert read.output_ids == every.output_ids
    forward_passes = sum(isinstance(e, ForwardPass) for e in read.events)
    assert forward_passes == len(read.output_ids)
    assert read_calls == forward_passes and read_handoffs == forward_passes
    assert every_calls == len(every.events) == 1 + 3 * forward_passes  # Prefilled, then 3 a step
    assert every_handoffs == every_calls  # one request: one call a round
    assert [(type(e).__name__, e.step) for e in read.events] == [(type(e).__name__, e.step) for e in every.events]
    assert_payload_valid(read.payload)
    assert timeless(read.payload["events"]) == timeless(every.payload["events"])
    for part in ("mod_calls", "actions", "mod_logs"):
        assert timeless(read.payload[part]) == timeless(every.payload[part]), part
