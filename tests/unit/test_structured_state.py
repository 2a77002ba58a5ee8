"""Structured outputs without the model: compiling (refusals naming what cannot be enforced, the
cache), one request's grammar state (mask, advance, the bypass of forced off-grammar tokens,
rollback), and the step loop on the scripted one-character-per-token model — regex and tool-call
outputs, min_tokens, ignore_eos, and a Backtrack rolling the grammar back."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.core.result import FinishReason
from engine.core.structured import GrammarCompiler, grammar_spec
from engine.errors import InvalidRequestError
from engine.model.sampling import unpack_mask
from mods import Added, ForwardPass, mod
from tests.helpers import CharTokenizer, scripted_engine

TOK = CharTokenizer()
EOS = TOK.eos_token_id


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(TOK, vocab_size=TOK.vocab_size, eos_token_ids=[EOS])
    yield compiler
    compiler.close()


def regex(compiler, pattern):
    return compiler.compile(grammar_spec({"type": "regex", "regex": pattern}, None, None)).new_state()


def allowed(state, **kw) -> set[int]:
    return set(torch.nonzero(unpack_mask(state.mask(**kw)[None, :], TOK.vocab_size)[0]).flatten().tolist())


def ids(text):
    return TOK.encode(text)


# ------------------------------------------------------------------------------------ compiling


def test_a_schema_feature_it_cannot_enforce_is_refused_naming_it(compiler):
    spec = grammar_spec({"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}, None, None)
    with pytest.raises(InvalidRequestError, match=r"`response_format.json_schema.schema` must be only JSON-schema "
                                                  r"features raylens enforces, got: .*uniqueItems") as err:
        compiler.compile(spec)
    assert err.value.parameter == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError, match="`response_format.regex` must be a regex raylens can compile"):
        regex(compiler, "[a-")
    with pytest.raises(InvalidRequestError, match="`response_format.grammar` must be a Lark grammar"):
        compiler.compile(grammar_spec({"type": "grammar", "grammar": "start: undefined_rule"}, None, None))


def test_compiles_are_cached_by_the_specs_text(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    one = compiler.compile(grammar_spec({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                                        None, None))
    # the same schema written in another key order is the same text once canonical
    two = compiler.compile(grammar_spec({"type": "json_schema", "json_schema": {
        "name": "y", "schema": dict(reversed(list(schema.items())))}}, None, None))
    assert one.grammar is two.grammar
    other = compiler.compile(grammar_spec({"type": "json_object"}, None, None))
    assert other.grammar != one.grammar


def test_tool_choice_makes_a_tool_call_spec_and_wins_over_response_format():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    required = grammar_spec({"type": "json_object"}, "required", tools)
    assert required.is_tool_call and required.tool_names == ("f", "g") and "anyOf" in required.source
    named = grammar_spec(None, {"type": "function", "function": {"name": "g"}}, tools)
    assert named.tool_names == ("g",) and json.loads(named.source)["properties"]["name"] == {"const": "g"}
    assert grammar_spec(None, "auto", tools) is None and grammar_spec({"type": "text"}, "none", tools) is None


# ------------------------------------------------------------------------------- grammar state


def test_the_mask_allows_exactly_what_may_come_next_and_the_end_only_at_the_end(compiler):
    state = regex(compiler, "(yes|no)")
    assert allowed(state) == {ids("y")[0], ids("n")[0]}
    assert state.advance(ids("ye")) == 2 and allowed(state) == set(ids("s"))
    assert state.advance(ids("s")) == 1 and allowed(state) == {EOS}
    assert state.ended  # nothing can follow: complete without waiting for the end token
    open_ended = regex(compiler, "a+")
    assert open_ended.advance(ids("aa")) == 2 and not open_ended.ended
    assert open_ended.advance([EOS]) == 1 and open_ended.ended


def test_hold_end_leaves_the_end_out_unless_it_is_all_that_is_allowed(compiler):
    state = regex(compiler, "a+")
    state.advance(ids("a"))
    assert allowed(state) == {ids("a")[0], EOS}
    assert allowed(state, hold_end=True) == {ids("a")[0]}
    done = regex(compiler, "ab")
    done.advance(ids("ab"))
    assert allowed(done, hold_end=True) == {EOS}


def test_forced_tokens_it_rejects_bypass_it_until_erased_then_it_resumes_exactly(compiler):
    state = regex(compiler, "(yes|no)")
    assert state.advance(ids("y")) == 1
    assert state.advance(ids("ezz")) == 1 and not state.attached  # "e" taken, "zz" bypass
    assert state.advance(ids("more")) == 0 and state.detached == 6
    state.rollback(6)  # the off-grammar tokens erased: it applies again after "ye"
    assert state.attached and allowed(state) == set(ids("s"))
    state.rollback(2)  # back to the start
    assert allowed(state) == {ids("y")[0], ids("n")[0]}
    assert state.advance(ids("no") + [EOS]) == 3 and state.ended


# -------------------------------------------------------------------- the scripted model's loop


def test_a_regex_constrains_what_the_model_writes():
    with scripted_engine("maybe so") as eng:
        assert eng.generate(prompt="q").output_text == "maybe so"  # positive control
        for seed in range(3):
            result = eng.generate(prompt="q", response_format={"type": "regex", "regex": "(yes|no)!"},
                                  temperature=1.0, seed=seed)
            assert result.finish_reason is FinishReason.STOP
            assert re.fullmatch("(yes|no)!", result.output_text), result.output_text


def test_tool_choice_required_ends_in_one_tool_call_with_valid_arguments():
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["left", "right"]}}, "required": ["x"],
        "additionalProperties": False}}}]
    with scripted_engine("plain words", max_tokens=60) as eng:
        result = eng.generate(prompt="q", tools=tools, tool_choice="required")
    assert result.finish_reason is FinishReason.TOOL_CALLS and result.output_text == ""
    [call] = result.tool_calls
    assert call["type"] == "function" and call["function"]["name"] == "pick" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"])["x"] in ("left", "right")


def test_min_tokens_holds_the_stop_tokens_back_and_ignore_eos_runs_to_the_budget():
    with scripted_engine("ab", max_tokens=8) as eng:
        assert eng.generate(prompt="q").output_text == "ab"  # positive control: EOS after two
        held = eng.generate(prompt="q", min_tokens=5)
        assert len(held.output_ids) >= 5 and held.output_text.startswith("ab")
        assert eng.generate(prompt="q", ignore_eos=True).finish_reason is FinishReason.LENGTH
        # with a grammar, min_tokens holds its end back while something else is allowed
        grown = eng.generate(prompt="q", min_tokens=4, response_format={"type": "regex", "regex": "[ab]+"})
        assert re.fullmatch("[ab]+", grown.output_text) and len(grown.output_text) >= 4


def test_a_backtrack_rolls_the_grammar_back_by_the_erased_tokens():
    erased = []

    @mod
    def backtrack_once(event, actions, tokenizer):
        if isinstance(event, Added) and event.step == 3 and not erased:
            erased.append(event.step)
            return actions.backtrack(steps=3)
        return None

    with scripted_engine("abcdefgh", max_tokens=20) as eng:
        result = eng.generate(prompt="q", mods=[backtrack_once],
                              response_format={"type": "regex", "regex": "[a-h]{6}"})
    assert erased and any(type(a).__name__ == "Backtrack" for a in result.actions)
    assert result.finish_reason is FinishReason.STOP and re.fullmatch("[a-h]{6}", result.output_text)


def test_forced_tokens_outside_the_grammar_bypass_it_and_it_resumes_once_they_are_erased():
    @mod
    def ask_then_erase(event, actions, tokenizer):
        if isinstance(event, ForwardPass) and event.step == 0:
            return actions.force_tokens(tokenizer.encode("Q?"))
        if isinstance(event, Added) and event.step == 1:
            return actions.backtrack(steps=3)  # the question (step 0) and the model's one-token answer
        return None

    @mod
    def force_and_keep(event, actions, tokenizer):
        if isinstance(event, ForwardPass) and event.step == 0:
            return actions.force_tokens(tokenizer.encode("Q?"))
        return None

    grammar = {"type": "regex", "regex": "(yes|no)"}
    with scripted_engine("nothing", max_tokens=12) as eng:
        erased = eng.generate(prompt="q", mods=[ask_then_erase], response_format=grammar)
        kept = eng.generate(prompt="q", mods=[force_and_keep], response_format=grammar)
    assert erased.finish_reason is FinishReason.STOP and erased.output_text in ("yes", "no")
    # not erased: the mod's text stays (the documented bypass) and the rest is unconstrained
    assert kept.output_text.startswith("Q?") and kept.output_text not in ("yes", "no")
