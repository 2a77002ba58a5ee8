"""Each allowed event × action pair, as a legacy-style mod file, on the embedded model.

Every mod in tests/mods/ is loaded unchanged (it imports quote_mod_sdk / shared.types /
max.driver) and its stated effect is checked against the mod-free greedy output (the positive
control), and every run's ingest payload is validated against the schema.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

from engine.core.result import FinishReason
from tests.helpers import TEST_MODS, assert_payload_valid

PROMPT = "What is the capital of France?"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def baseline(engine):
    result = engine.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
    assert result.output_text == "The capital of France is Paris.", "the embedded model's answer changed"
    return result


def enc(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def same_as_baseline(result, baseline, tok, engine=None):
    assert result.output_ids == baseline.output_ids and result.finish_reason is FinishReason.STOP


def forced_output(text: str) -> Callable:
    def check(result, baseline, tok, engine=None):
        assert result.output_text == text and result.finish_reason is FinishReason.STOP
        assert result.output_ids == enc(tok, text)
    return check


def tool_call(name: str) -> Callable:
    def check(result, baseline, tok, engine=None):
        assert result.finish_reason is FinishReason.TOOL_CALLS and result.output_text == ""
        assert [c["function"]["name"] for c in result.tool_calls] == [name]
    return check


def error(message: str) -> Callable:
    def check(result, baseline, tok, engine=None):
        assert result.finish_reason is FinishReason.ERROR and result.error == message
    return check


def starts_with(prefix_of_baseline: int, text: str) -> Callable:
    def check(result, baseline, tok, engine=None):
        expected = baseline.output_ids[:prefix_of_baseline] + enc(tok, text)
        assert result.output_ids[: len(expected)] == expected, tok.decode(result.output_ids)
        assert result.output_ids != baseline.output_ids
    return check


def adjust_prefill(result, baseline, tok, engine):
    assert "Italy" in tok.decode(result.prompt_ids) and "France" not in tok.decode(result.prompt_ids)
    direct = engine.generate(PROMPT.replace("France", "Italy"), max_tokens=6, temperature=0.0)
    assert result.output_ids == direct.output_ids  # the same as asking about Italy with 6 tokens
    assert len(result.output_ids) == 6 and result.output_ids != baseline.output_ids


def banned_the(result, baseline, tok, engine=None):
    banned = enc(tok, "The")[0]
    assert baseline.output_ids[0] == banned  # the positive control: the mod-free answer starts with it
    assert banned not in result.output_ids and result.output_ids != baseline.output_ids


def no_forward_pass(result) -> bool:
    return not any(type(e).__name__ == "ForwardPass" for e in result.events)


CASES: dict[str, Callable] = {
    "prefilled/noop.py": same_as_baseline,
    "prefilled/force_output.py": forced_output("EMERGENCY PROTOCOL ACTIVATED."),
    "prefilled/tool_calls.py": tool_call("get_weather"),
    "prefilled/adjust_prefill.py": adjust_prefill,
    "prefilled/emit_error.py": error("prompt refused by policy"),
    "forward_pass/noop.py": same_as_baseline,
    "forward_pass/force_tokens.py": starts_with(0, " [INJECTED]"),
    "forward_pass/backtrack.py": starts_with(2, " Rome"),
    "forward_pass/force_output.py": forced_output(" [END]"),
    "forward_pass/tool_calls.py": tool_call("calculator"),
    "forward_pass/adjust_logits.py": banned_the,
    "forward_pass/emit_error.py": error("forward pass limit reached"),
    "sampled/noop.py": same_as_baseline,
    "sampled/force_tokens.py": starts_with(0, " [OBSERVED]"),
    "sampled/backtrack.py": starts_with(2, " [RESAMPLED]"),
    "sampled/force_output.py": forced_output(" [SAMPLED_END]"),
    "sampled/tool_calls.py": tool_call("query_database"),
    "sampled/emit_error.py": error("sample rejected"),
    "added/noop.py": same_as_baseline,
    "added/force_tokens.py": starts_with(2, " city"),
    "added/backtrack.py": starts_with(2, " of Spain"),
    "added/force_output.py": forced_output(" [STOPPED]"),
    "added/tool_calls.py": tool_call("search"),
    "added/emit_error.py": error("France is off limits"),
}


def test_there_is_one_mod_per_allowed_pair():
    files = sorted(str(p.relative_to(TEST_MODS)) for p in TEST_MODS.rglob("*.py"))
    assert files == sorted(CASES), "tests/mods and CASES disagree"
    assert len(files) == 24


@pytest.mark.parametrize("path", sorted(CASES))
def test_mod_has_its_observable_effect(engine, tokenizer, baseline, path):
    result = engine.generate(PROMPT, mods=[TEST_MODS / path], max_tokens=MAX_TOKENS, temperature=0.0)
    CASES[path](result, baseline, tokenizer, engine)
    assert_payload_valid(result.payload)
    if path.startswith("prefilled/") and not path.endswith(("noop.py", "adjust_prefill.py")):
        assert no_forward_pass(result)
    acted = [a for a in result.payload["actions"] if a["details"]["applied"]]
    if not path.endswith("noop.py"):
        assert acted, "the action is recorded in the payload"
        assert {a["action_type"] for a in acted} <= {"ForceTokens", "Backtrack", "ForceOutput", "ToolCalls",
                                                      "EmitError", "AdjustedLogits", "AdjustedPrefill"}
