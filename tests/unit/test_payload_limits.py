"""Payloads the ingest backend accepts: mod output bounded per call and per request, request
values the backend's schema refuses caught up front, and strict JSON (no NaN/Infinity)."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

from engine.config import GenerationConfig, IngestConfig, check_request_id
from engine.errors import ConfigError, InvalidRequestError
from engine.services.ingest_payload import MOD_LOG_ENTRY_OVERHEAD, PayloadBuilder
from engine.services.strict_json import dumps, finite
from mods.capture import CapturedLog
from mods.manager import ModCall, ModException
from mods.types import AdjustedLogits, ContextInfo, Noop, Prefilled, ToolCalls
from tests.helpers import CharTokenizer, assert_payload_valid

MARKER = "[raylens:"


def new_builder(**limits) -> PayloadBuilder:
    return PayloadBuilder("r1", tokenizer=CharTokenizer(), request={}, limits=IngestConfig(**limits))


def prefilled(builder: PayloadBuilder) -> int:
    return builder.event(Prefilled("r1", 0, 8, ContextInfo("r1", [10, 11], 8), input_ids=[10, 11]))


def chatty_call(entries: int, chars: int, *, name: str = "chatty", exception: ModException | None = None) -> ModCall:
    logs = tuple(CapturedLog("x" * chars, "INFO", time.time()) for _ in range(entries))
    return ModCall(name, "Prefilled", 0, Noop(), logs, time.time(), 0.5, exception)


def build(builder: PayloadBuilder) -> dict:
    payload = builder.build(final_ids=[], final_text="", finish_reason="stop", prompt_tokens=2)
    assert_payload_valid(payload)
    return payload


def kept_text(payload: dict) -> int:
    """Characters of mod output kept (markers and the "…" of a cut entry not counted)."""
    return sum(len(e["log_message"].removesuffix("…")) for e in payload["mod_logs"] if MARKER not in e["log_message"])


def test_mod_logs_are_cut_per_call_with_a_marker_saying_how_much():
    builder = new_builder(mod_log_max_chars_per_call=1000, mod_log_max_chars_per_request=100_000)
    event = prefilled(builder)
    builder.call(event, chatty_call(5, 300))  # 1500 characters written; 1000 (with overheads) allowed
    payload = build(builder)
    markers = [e for e in payload["mod_logs"] if MARKER in e["log_message"]]
    assert len(markers) == 1 and markers[0]["log_level"] == "WARNING", payload["mod_logs"]
    assert "mod_log_max_chars_per_call" in markers[0]["log_message"]
    cut = payload["request"]["inference_stats"]["mod_logs_cut"]
    assert kept_text(payload) + cut["characters"] == 5 * 300, (kept_text(payload), cut)
    assert f"{cut['characters']:,} characters" in markers[0]["log_message"]
    kept = len(payload["mod_logs"]) - 1
    assert kept_text(payload) + kept * MOD_LOG_ENTRY_OVERHEAD <= 1000


def test_mod_logs_within_the_limits_are_kept_whole():
    # positive control for the test above: the same mod under roomy limits loses nothing
    builder = new_builder(mod_log_max_chars_per_call=100_000, mod_log_max_chars_per_request=100_000)
    builder.call(prefilled(builder), chatty_call(5, 300))
    payload = build(builder)
    assert kept_text(payload) == 5 * 300 and "mod_logs_cut" not in payload["request"]["inference_stats"]
    assert not any(MARKER in e["log_message"] for e in payload["mod_logs"])


def test_a_chatty_mod_cannot_push_a_payload_past_the_request_limit():
    limit = 50_000
    builder = new_builder(mod_log_max_chars_per_call=10_000, mod_log_max_chars_per_request=limit)
    event = prefilled(builder)
    for _ in range(200):  # 200 calls × 20 entries × 2000 characters = 8 MB written
        builder.call(event, chatty_call(20, 2000))
    payload = build(builder)
    body = json.dumps(payload)
    written = 200 * 20 * 2000
    assert len(body) < 4 * limit, f"payload is {len(body)} bytes for a {limit}-character log limit"
    request_markers = [e for e in payload["mod_logs"] if "mod_log_max_chars_per_request" in e["log_message"]]
    assert len(request_markers) == 1, "one marker for everything the request limit cut"
    cut = payload["request"]["inference_stats"]["mod_logs_cut"]
    assert kept_text(payload) + cut["characters"] == written
    assert cut["entries"] > 0


def test_exception_tracebacks_count_against_the_limits():
    huge = ModException("RuntimeError", "boom", "Traceback:\n" + "  frame\n" * 100_000)
    builder = new_builder(mod_log_max_chars_per_call=2000, mod_log_max_chars_per_request=10_000)
    event = prefilled(builder)
    for _ in range(50):
        builder.call(event, chatty_call(0, 0, exception=huge))
    payload = build(builder)
    assert all(c["exception_occurred"] for c in payload["mod_calls"])
    assert sum(len(c["exception_traceback"]) for c in payload["mod_calls"]) < 10_000 + 50 * 100
    assert payload["mod_calls"][0]["exception_traceback"].startswith("Traceback:")


@pytest.mark.parametrize("limits", [
    {"mod_log_max_chars_per_call": 10},
    {"mod_log_max_chars_per_call": 2000, "mod_log_max_chars_per_request": 1000},
    {"mod_log_max_chars_per_request": 10**12},
])
def test_mod_log_limits_are_validated(limits):
    with pytest.raises(ConfigError, match="ingest.mod_log_max_chars"):
        IngestConfig(**limits)


# ------------------------------------------------------------------------------ request bounds


@pytest.mark.parametrize("override,name", [
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"top_k": 2**40}, "top_k"),
    ({"step_limit": 2**31}, "step_limit"),
    ({"stop_tokens": (2, 2**32)}, "stop_tokens"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": math.inf}, "top_p"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": "12"}, "max_tokens"),
])
def test_values_the_backend_would_refuse_are_refused_with_the_name(override, name):
    with pytest.raises(ConfigError, match=f"`{name}` must be") as err:
        dataclasses.replace(GenerationConfig(), **override)
    assert err.value.parameter == name


def test_the_largest_allowed_values_pass():
    # positive control: the bounds are inclusive and not tighter than the backend's
    cfg = dataclasses.replace(GenerationConfig(), max_tokens=2**31 - 1, top_k=2**31 - 1, seed=2**64 - 1,
                              temperature=1e6, stop_tokens=(0, 2**31 - 1))
    assert cfg.seed == 2**64 - 1


def test_request_ids_longer_than_the_backend_stores_are_refused():
    assert check_request_id("r" * 255) == "r" * 255
    with pytest.raises(InvalidRequestError, match="at most 255 characters, got 256") as err:
        check_request_id("r" * 256)
    assert err.value.parameter == "request_id"
    for bad in ("", None, 7):
        with pytest.raises(InvalidRequestError, match="`request_id` must be a non-empty string"):
            check_request_id(bad)


# --------------------------------------------------------------------------------- strict JSON


def test_non_finite_floats_in_a_payload_become_null_and_the_body_is_strict_json():
    builder = new_builder()
    event = prefilled(builder)
    action = ToolCalls([{"name": "f", "arguments": {"score": math.nan, "range": [-math.inf, 1.5]}}])
    calls = [ModCall("odd", "Prefilled", 0, action, (), time.time(), 0.1),
             ModCall("odd2", "Prefilled", 0, AdjustedLogits(None, token_temp=math.nan), (), time.time(), 0.1)]
    indices = [builder.call(event, call) for call in calls]
    builder.action(indices[0], calls[0].action, applied=True)
    builder.action(indices[1], calls[1].action, applied=False, note="test")
    payload = build(builder)
    body = dumps(payload)
    strict = json.loads(body, parse_constant=lambda name: pytest.fail(f"{name} in a payload"))
    assert strict["actions"][0]["tool_calls"][0]["arguments"] == {"score": None, "range": [None, 1.5]}
    assert strict["actions"][1]["temperature"] is None


def test_strict_dumps_keeps_finite_data_exactly_and_refuses_what_it_cannot_clean():
    data = {"a": [1, 2.5, {"b": -0.0}], "c": "NaN"}
    assert finite(data) is data and json.loads(dumps(data)) == data
    assert json.loads(dumps({"x": (math.inf,)})) == {"x": [None]}

    class Weird:
        def __repr__(self) -> str:
            return "weird"

    with pytest.raises(ValueError):  # a NaN that only appears through `default` is still refused
        dumps({"w": Weird()}, default=lambda o: math.nan)
