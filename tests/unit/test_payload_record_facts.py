"""A payload's records are made when it is built (once, at the request's end, and only when
something reads or sends it); what each record says is read when it is recorded, so a mod that
changes an event or an action after the engine recorded it does not change the payload, and the
records come out in the order they were recorded."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine.config import IngestConfig
from engine.services.ingest_payload import PayloadBuilder
from mods.manager import ModCall
from mods.types import Added, AdjustedLogits, ContextInfo, ForceTokens, ForwardPass, Prefilled, Sampled, Steer
from tests.helpers import CharTokenizer, assert_payload_valid


def _builder() -> PayloadBuilder:
    return PayloadBuilder("r1", tokenizer=CharTokenizer(), request={}, limits=IngestConfig())


def _call(action, event_type: str, step: int, name: str = "m") -> ModCall:
    return ModCall(name, event_type, step, action, (), time.time(), 0.25)


def _build(builder: PayloadBuilder) -> dict:
    payload = builder.build(final_ids=[], final_text="", finish_reason="stop", prompt_tokens=2)
    assert_payload_valid(payload)
    return payload


def test_records_say_what_was_true_when_recorded_not_at_build():
    builder = _builder()
    prompt = [40, 41, 42]
    builder.event(Prefilled("r1", 0, 8, ContextInfo("r1", prompt, 8), input_ids=prompt))
    ids = [40, 41, 42]
    forward = ForwardPass("r1", 0, None, input_ids=ids)
    index = builder.event(forward)
    adjusted = AdjustedLogits(np.zeros((1, 128), np.float32), token_temp=0.5)
    forced = ForceTokens([43, 44])
    calls = [_call(adjusted, "ForwardPass", 0, "a"), _call(forced, "ForwardPass", 0, "b")]
    a_index, b_index = [builder.call(index, call) for call in calls]
    builder.action(a_index, adjusted, applied=True)
    builder.action(b_index, forced, applied=False, note="one per step")
    sampled = Sampled("r1", 0, 45)
    builder.event(sampled)
    added = Added("r1", 0, [45], False)
    builder.event(added)
    # a mod that kept the objects changes them afterwards
    ids.extend([99, 98])
    forward.input_ids = [1, 2, 3, 4, 5, 6]
    adjusted.token_temp, adjusted.logits = 3.0, np.zeros((1, 7), np.float32)
    forced.tokens.append(50)
    sampled.sampled_token = 60
    added.added_tokens.append(61)
    added.forced = True
    payload = _build(builder)
    events = payload["events"]
    assert [e["event_type"] for e in events] == ["Prefilled", "ForwardPass", "Sampled", "Added"]
    assert [e["sequence_order"] for e in events] == [0, 1, 2, 3]
    assert events[0]["prompt_length"] == 3 and events[0]["max_steps"] == 8
    assert events[1]["input_text"] == CharTokenizer().decode([40, 41, 42])
    assert events[2]["sampled_token"] == 45
    assert events[3]["added_tokens"] == [45] and events[3]["added_token_count"] == 1 and events[3]["forced"] is False
    assert [(c["mod_name"], c["event_sequence_order"]) for c in payload["mod_calls"]] == [("a", 1), ("b", 1)]
    first, second = payload["actions"]
    assert (first["action_type"], first["logits_shape"], first["temperature"]) == ("AdjustedLogits", "[1, 128]", 0.5)
    assert first["details"] == {"applied": True} and first["mod_call_sequence"] == 0
    assert (second["action_type"], second["tokens"], second["mod_call_sequence"]) == ("ForceTokens", [43, 44], 1)
    assert second["details"]["applied"] is False and second["details"]["note"] == "one per step"


def test_a_steer_line_follows_its_calls_logs_in_the_order_recorded():
    builder = _builder()
    index = builder.event(Sampled("r1", 2, 45))
    steer = Steer(feature_id=7, scale=2.0)
    call_index = builder.call(index, _call(steer, "Sampled", 2, "steerer"))
    builder.action(call_index, steer, applied=True)
    later = builder.event(Added("r1", 2, [45], False))
    builder.call(later, _call(ForceTokens([46]), "Added", 2, "forcer"))
    payload = _build(builder)
    (line,) = payload["mod_logs"]
    assert line["mod_name"] == "steerer" and line["mod_call_sequence"] == 0
    assert "Steer feature_id=7 scale=2.0 (applied)" in line["log_message"]
    assert [(c["mod_name"], c["event_sequence_order"]) for c in payload["mod_calls"]] == [("steerer", 0), ("forcer", 1)]


def test_a_recorded_logits_action_does_not_keep_the_steps_host_copy_alive():
    import gc
    import weakref

    import torch

    from engine.model.tensor import HostLogits, TensorShim

    builder = _builder()
    host = HostLogits(torch.randn(4, 128), [0, 1, 2, 3])
    gone = weakref.ref(host)
    row = host.lend(2)
    adjusted = AdjustedLogits(TensorShim.from_numpy(row))
    assert adjusted.logits.lent is not None  # the action wraps the copy's own row
    index = builder.event(ForwardPass("r1", 0, None, input_ids=[40]))
    call_index = builder.call(index, _call(adjusted, "ForwardPass", 0))
    builder.action(call_index, adjusted, applied=True)
    del host, row, adjusted
    gc.collect()
    assert gone() is None, "the payload's records keep the step's host copy of the logits alive"
    payload = _build(builder)
    assert payload["actions"][0]["logits_shape"] == "[1, 128]"


def test_an_adjusted_logits_recorded_as_applied_ahead_of_its_check_is_taken_back_and_only_that():
    """The engine records the usual logits mod's action as applied before the check of its row,
    which is settled just before the step's draw; a failed check takes that record back (its
    record as not applied follows). Only the newest record, and only that call's, can be taken."""
    builder = _builder()
    index = builder.event(ForwardPass("r1", 0, None, input_ids=[40, 41]))
    adjusted = AdjustedLogits(np.zeros((1, 128), np.float32))
    call_index = builder.call(index, _call(adjusted, "ForwardPass", 0, "a"))
    builder.action(call_index, adjusted, applied=True)
    with pytest.raises(AssertionError, match="not call 7's"):
        builder.take_back_action(7)
    builder.take_back_action(call_index)
    builder.action(call_index, adjusted, applied=False, note="unusable")
    with pytest.raises(AssertionError):
        builder.take_back_action(call_index)  # the newest is the record as not applied: nothing to take
    builder.take_back_action(None)  # a call with no record: nothing recorded, nothing taken
    (action,) = _build(builder)["actions"]
    assert action["details"] == {"applied": False, "note": "unusable"}
