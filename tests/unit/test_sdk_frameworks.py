"""SelfPrompt, FlowEngine, strategies and the conversation API, against a scripted model
(the project's own JSON-schema and agent mods stand in for the production ones, whose files
are not ours to ship).

The scripted model answers each self-prompt with the next characters of a script, one
character per token (tests/helpers.ScriptedAnswerBackend).
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

from mods import Added, ForwardPass, Prefilled, mod
from mods.flow import FlowEngine, FlowQuestion, route_output
from mods.self_prompt import EraseMode, SelfPrompt
from mods.strategies.base import token_texts
from mods.strategies.primitives import CharsMode, CharsStrategy, UntilEndType, UntilStrategy
from mods.strategies.strategy_constructor import CharsStrat, ChoicesStrat, ListStrat, UntilStrat
from tests.helpers import TEST_MODS, CharTokenizer, scripted_engine

TOK = CharTokenizer()
SDK_MODS = TEST_MODS.parent / "sdk_mods"


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def self_prompt_mod_of(helper: SelfPrompt):
    @mod
    def handler(event, actions, tokenizer):
        if isinstance(event, Prefilled):
            helper.handle_prefilled(event, tokenizer)
        elif isinstance(event, ForwardPass):
            return helper.handle_forward_pass(event, actions, tokenizer)
        elif isinstance(event, Added):
            return helper.handle_added(event, actions, tokenizer)

    return handler


def allowed_in(action) -> set[int]:
    """The ids an AdjustedLogits left unmasked."""
    arr = action.logits.to_numpy()[0]
    return {int(i) for i in np.nonzero(arr > -1e8)[0]}


def run(mods, answers, **kw):
    eng = scripted_engine(answers=answers, max_tokens=kw.pop("max_tokens", 64), **kw)
    return eng.generate(input_ids=ids(kw.pop("prompt", "Hi")), mods=mods, **kw)


# ----------------------------------------------------------------------------- SelfPrompt §10.4


def test_self_prompt_erase_none_with_a_suffix():
    helper = SelfPrompt(prompt={"text": " Q:"}, strategy=ChoicesStrat(["yes", "no"]), completion="\n")
    result = run([self_prompt_mod_of(helper)], "no", keep_logits=True)  # the masks are read after the run
    acts = result.actions
    assert [type(a).__name__ for a in acts] == ["ForceTokens", "AdjustedLogits", "AdjustedLogits", "ForceTokens"]
    assert acts[0].tokens == ids(" Q:") and acts[3].tokens == ids("\n")
    assert allowed_in(acts[1]) == set(ids("ny")) and allowed_in(acts[2]) == set(ids("o"))
    assert result.output_text == " Q:no\n"
    assert helper.answer_tokens(result.request_id) == ids("no")


def test_self_prompt_refresh_responses_replaces_the_choices_and_drops_the_request_state():
    spec = ChoicesStrat(["yes", "no"])
    helper = SelfPrompt(prompt={"text": " Q:"}, strategy=spec)
    result = run([self_prompt_mod_of(helper)], "no")
    assert helper.is_complete(result.request_id)
    helper.refresh_responses(["maybe", 7], request_id=result.request_id)
    assert spec.choices == ["maybe", "7"]
    assert not helper.is_complete(result.request_id)  # it recompiles with the new choices on its next event
    first, second = ChoicesStrat(["a"]), ChoicesStrat(["b"])
    SelfPrompt(strategy=ListStrat([first, second])).refresh_responses(["c"], idx=1)
    assert (first.choices, second.choices) == (["a"], ["c"])
    repeated = ChoicesStrat(["a"])  # a list of one repeated element: the element at every index
    SelfPrompt(strategy=ListStrat(repeated)).refresh_responses(["d"], idx=2)
    assert repeated.choices == ["d"]


def test_self_prompt_erase_prompt_keeps_only_the_answer():
    helper = SelfPrompt(prompt={"text": " Q:"}, strategy=ChoicesStrat(["yes", "no"]), erase=EraseMode.PROMPT)
    result = run([self_prompt_mod_of(helper)], "no")
    backtrack = result.actions[-1]
    assert type(backtrack).__name__ == "Backtrack" and (backtrack.n, backtrack.tokens) == (5, ids("no"))
    assert result.output_text == "no"


def test_self_prompt_erase_all_leaves_nothing():
    helper = SelfPrompt(prompt={"text": " Q:"}, strategy=ChoicesStrat(["yes", "no"]), erase=EraseMode.ALL)
    result = run([self_prompt_mod_of(helper)], "no")
    assert (result.actions[-1].n, result.actions[-1].tokens) == (5, None)
    assert result.output_text == ""


def test_argmax_sampling_sets_token_temp_zero():
    helper = SelfPrompt(prompt={"text": " Q:"}, strategy=ChoicesStrat(["yes", "no"]), argmax_sampling=True)
    result = run([self_prompt_mod_of(helper)], "no", temperature=5.0, top_k=0, top_p=1.0, seed=1)
    assert result.actions[1].token_temp == 0.0 and result.output_text.startswith(" Q:no")


# ----------------------------------------------------------------------------- FlowEngine §10.5


def two_question_flow():
    size = FlowQuestion(name="size", prompt=" Size?", strategy=ChoicesStrat(["small", "big"]), erase_mode=EraseMode.ALL)
    color = FlowQuestion(name="color", prompt=" Color?", strategy=ChoicesStrat(["red", "blue"]),
                         erase_mode=EraseMode.ALL).then(size)
    size.then(lambda state: route_output(f"{state.answers['color']}-{state.answers['size']}"))
    engine = FlowEngine(entry_question=color)

    @mod
    def flow_mod(event, actions, tokenizer):
        return engine.handle_event(event, actions, tokenizer)

    return engine, flow_mod


def test_flow_engine_asks_erases_routes_and_outputs():
    engine, flow_mod = two_question_flow()
    result = run([flow_mod], "bluebig")
    kinds = [type(a).__name__ for a in result.actions]
    assert kinds == ["ForceTokens", *["AdjustedLogits"] * 4, "Backtrack",
                     "ForceTokens", *["AdjustedLogits"] * 3, "Backtrack", "ForceOutput"]
    backtracks = [a for a in result.actions if type(a).__name__ == "Backtrack"]
    assert [b.n for b in backtracks] == [len(" Color?") + len("blue"), len(" Size?") + len("big")]
    # the next question's prompt is forced on the ForwardPass right after the erase, and the
    # output on the ForwardPass after the last erase
    calls = result.payload["mod_calls"]
    placed = [(a["action_type"], calls[a["mod_call_sequence"]]["event_type"], calls[a["mod_call_sequence"]]["step"])
              for a in result.payload["actions"] if a["action_type"] in ("Backtrack", "ForceTokens", "ForceOutput")]
    (_, _, bt1), (_, event, force2) = placed[1], placed[2]
    assert placed[1][0] == "Backtrack" and event == "ForwardPass" and force2 == bt1 + 1
    assert placed[-1][:2] == ("ForceOutput", "ForwardPass") and placed[-1][2] == placed[-2][2] + 1
    assert result.output_text == "blue-big" and result.finish_reason == "stop"
    assert engine._states[result.request_id].answers == {"color": "blue", "size": "big"}
    assert engine._get_state(result.request_id) is engine._states[result.request_id]


# ------------------------------------------------------------ the project's production-style mods


def load(name):
    from mods.loading import load_mod_from_path

    return load_mod_from_path(SDK_MODS / name)


def with_chat(mods, answers, messages, **kw):
    eng = scripted_engine(answers=answers, max_tokens=400)
    return eng.generate(messages=messages, mods=mods, **kw)


class ChatTokenizer(CharTokenizer):
    chat_template = "scripted"

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False):
        return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant: "


@pytest.fixture(autouse=True)
def chat_tokenizer(monkeypatch):
    import tests.helpers as helpers

    monkeypatch.setattr(helpers, "CharTokenizer", ChatTokenizer)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}


def test_json_schema_mod_builds_the_object_from_scripted_answers():
    result = with_chat([load("json_schema_mod.py")], 'Bob"042true', [{"role": "user", "content": "a person"}],
                       response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    assert result.finish_reason == "stop"
    assert json.loads(result.output_text) == {"name": "Bob", "age": 42, "ok": True}
    first_backtrack = next(a for a in result.actions if type(a).__name__ == "Backtrack")
    assert first_backtrack.n == len('\nThe name as a JSON string is: "') + len('Bob"')


def test_json_schema_mod_without_a_schema_does_nothing_and_refuses_an_unfillable_one():
    plain = with_chat([load("json_schema_mod.py")], "hello", [{"role": "user", "content": "hi"}])
    assert plain.actions == [] and plain.output_text == "hello"
    bad = {"type": "object", "properties": {"tags": {"type": "array"}}, "required": ["tags"]}
    refused = with_chat([load("json_schema_mod.py")], "x", [{"role": "user", "content": "hi"}],
                        response_format={"type": "json_schema", "json_schema": {"name": "b", "schema": bad}})
    assert refused.finish_reason == "error" and "cannot fill" in refused.error


def test_flow_agent_calls_the_tool_with_the_code_from_the_message():
    result = with_chat([load("flow_agent_mod.py")], "yes", [{"role": "user", "content": "Cancel ABC123 please"}])
    assert result.finish_reason == "tool_calls"
    call = result.tool_calls[0]
    assert call["function"]["name"] == "cancel_reservation"
    assert json.loads(call["function"]["arguments"]) == {"reservation_id": "ABC123"}


def test_flow_agent_asks_for_a_code_with_an_integer_stop_strategy():
    result = with_chat([load("flow_agent_mod.py")], "yesxyz789", [{"role": "user", "content": "Cancel my trip"}])
    assert json.loads(result.tool_calls[0]["function"]["arguments"]) == {"reservation_id": "XYZ789"}


def test_flow_agent_says_no_and_reports_a_finished_tool_call():
    declined = with_chat([load("flow_agent_mod.py")], "no", [{"role": "user", "content": "Tell me a joke"}])
    assert declined.output_text.startswith("I can help with cancellations")
    history = [{"role": "user", "content": "Cancel ABC123"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "cancel_reservation", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "cancelled ABC123"}]
    reported = with_chat([load("flow_agent_mod.py")], "", history)
    assert reported.output_text == "Your reservation is cancelled: cancelled ABC123"


# --------------------------------------------------------------------------------- strategies


def run_strategy(strategy, text):
    state = strategy.start(TOK)
    allowed_trace = []
    for token in ids(text):
        allowed_trace.append(strategy.allowed_tokens(state, TOK))
        strategy.step(state, token, TOK)
    return state, allowed_trace


def test_choices_strategy_completes_on_a_full_choice_and_prefixes_win():
    strategy = ChoicesStrat(["cat", "cow"]).into_strategy(TOK)
    state, allowed = run_strategy(strategy, "cow")
    assert allowed[0] == set(ids("c")) and allowed[1] == set(ids("ao")) and strategy.is_complete(state)
    prefix = ChoicesStrat(["hello", "hello world"]).into_strategy(TOK)  # kept quirk: the prefix completes
    state, _ = run_strategy(prefix, "hello")
    assert prefix.is_complete(state)


def test_chars_strategy_with_an_integer_stop_takes_exactly_n_characters():
    strategy = CharsStrategy(CharsMode.NUMERIC, 3)
    state = strategy.start(TOK)
    for ch in "12":
        strategy.step(state, ids(ch)[0], TOK)
        assert not strategy.is_complete(state)
    strategy.step(state, ids("3")[0], TOK)
    assert strategy.is_complete(state) and state.char_count == 3


def test_chars_strategy_string_mode_and_stop():
    strategy = CharsStrat(CharsMode.STRING, stop='"', min=2).into_strategy(TOK)
    state = strategy.start(TOK)
    assert ids('"')[0] not in strategy.allowed_tokens(state, TOK)  # min not reached
    for ch in "ab":
        strategy.step(state, ids(ch)[0], TOK)
    assert ids('"')[0] in strategy.allowed_tokens(state, TOK)
    strategy.step(state, ids('"')[0], TOK)
    assert strategy.is_complete(state) and strategy.trim_answer('ab"') == "ab"
    assert TOK.eos_token_id in strategy.disallowed_tokens(state, TOK)


def test_js_float_grammar():
    strategy = CharsStrategy(CharsMode.JS_FLOAT, "\n")
    state = strategy.start(TOK)
    first = strategy.allowed_tokens(state, TOK)
    assert ids("-")[0] in first and ids(".")[0] not in first
    for ch in "-1.5":
        strategy.step(state, ids(ch)[0], TOK)
    after = strategy.allowed_tokens(state, TOK)
    assert ids(".")[0] not in after and ids("e")[0] in after and ids("-")[0] not in after
    strategy.step(state, ids("e")[0], TOK)
    assert ids("-")[0] in strategy.allowed_tokens(state, TOK)


def test_until_strategy_tag_and_anychar():
    tag = UntilStrategy("<a>", UntilEndType.TAG, "</a>")
    state = tag.start(TOK)
    assert tag.allowed_tokens(state, TOK) == set(ids("<"))  # the start tag is forced
    for ch in "<a>hi</a>":
        tag.step(state, ids(ch)[0], TOK)
    assert tag.is_complete(state)
    anychar = UntilStrat(None, UntilEndType.ANYCHAR, ".!").into_strategy(TOK)
    state = anychar.start(TOK)
    for ch in "ok!":
        anychar.step(state, ids(ch)[0], TOK)
    assert anychar.is_complete(state)
    assert UntilStrategy(None, UntilEndType.TAG, "x").start(TOK).accum_toks == []  # not shared across states


class _AddedPunctuation(CharTokenizer):
    """``get_vocab()`` lacks the punctuation ids (as a tokenizer's added tokens can be missing from
    it), yet ``decode`` knows them: strategies must read such ids' text as the original SDK does."""

    ADDED = ".!<>/"

    def get_vocab(self):
        return {text: i for text, i in super().get_vocab().items() if text not in self.ADDED}


def test_until_strategy_reads_ids_outside_get_vocab_by_decoding_them():
    tok = _AddedPunctuation()
    missing = [tok.encode(ch)[0] for ch in tok.ADDED]
    assert not set(missing) & set(tok.get_vocab().values())  # positive control: really outside the vocabulary
    anychar = UntilStrat(None, UntilEndType.ANYCHAR, ".!").into_strategy(tok)
    state = anychar.start(tok)
    for ch in "ok":
        anychar.step(state, tok.encode(ch)[0], tok)
    assert not anychar.is_complete(state)
    anychar.step(state, tok.encode(".")[0], tok)
    assert anychar.is_complete(state) and state.accum == "ok."
    tag = UntilStrategy(None, UntilEndType.TAG, "</a>")
    state = tag.start(tok)
    for ch in "x</a>":
        tag.step(state, tok.encode(ch)[0], tok)
    assert tag.is_complete(state) and state.accum == "x</a>"
    assert token_texts(tok).text(tok.encode("!")[0]) == "!"
    assert set(missing).isdisjoint(token_texts(tok).ids.tolist())  # the vocabulary table itself is unchanged


def test_list_strategy_with_wrap_sep_and_close_completes():
    # (a one-token separator would swallow the next token, a quirk kept from the original)
    strategy = ListStrat(ChoicesStrat(["a", "b"]), open="[", close="]", wrap="'", max=3).into_strategy(TOK)
    state, allowed = run_strategy(strategy, "['a', 'b']")
    assert strategy.is_complete(state)
    assert allowed[0] == set(ids("["))
    assert set(ids("']")) >= allowed[1] >= set(ids("'"))  # open an element, or close (min 0)


def test_token_texts_are_decoded_once_per_tokenizer():
    class Counting(CharTokenizer):
        calls = 0

        def batch_decode(self, batch, **kwargs):
            type(self).calls += 1
            return super().batch_decode(batch, **kwargs)

    tok = Counting()
    strategy = CharsStrategy(CharsMode.ALPHA, " ")
    state = strategy.start(tok)
    for _ in range(5):
        strategy.allowed_tokens(state, tok)
        strategy.step(state, ids("a")[0], tok)
    assert Counting.calls == 1 and token_texts(tok) is token_texts(tok)


# ---------------------------------------------------------------------------- conversation API


def test_conversation_api_reads_only_the_active_request():
    from mods import conversation as conv

    conv.set_conversation("r1", [{"role": "user", "content": "hi"}])
    conv.set_schemas("r1", conv.schemas_from_request({"json_schema": {"schema": {"type": "object"}}}, [{"t": 1}]))
    try:
        assert conv.get_conversation() == []  # no active request
        token = conv.push_request_context("r1")
        try:
            assert conv.get_conversation() == [{"role": "user", "content": "hi"}]
            assert conv.get_schemas() == [{"type": "object"}, {"t": 1}]
            with pytest.raises(PermissionError):
                conv.get_conversation("r2")
            copy = conv.get_conversation()
            copy.append("x")
            assert len(conv.get_conversation()) == 1  # a deep copy
        finally:
            conv.pop_request_context(token)
    finally:
        conv.clear_request("r1")
    assert conv.schemas_from_request({"type": "json_object"}, None) == [{"type": "json_object"}]


def test_tool_call_pairs_match_calls_to_responses():
    from mods.conversation import tool_call_pairs

    messages = [
        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}, {"id": 3}, "junk"]},
        {"role": "tool", "tool_call_id": "a", "content": [{"text": "one"}, "two"]},
        {"role": "assistant", "tool_calls": [{"id": "b"}]},
        {"role": "tool", "tool_call_id": "b", "content": {"x": 1}},
    ]
    assert tool_call_pairs(messages) == [({"id": "a", "function": {"name": "f"}}, "onetwo"), ({"id": "b"}, '{"x": 1}')]


def test_one_copy_of_each_sdk_module_whatever_the_import_name():
    from mods.legacy_names import install_legacy_names

    install_legacy_names()
    a = importlib.import_module("sdk.quote_mod_sdk.self_prompt")
    b = importlib.import_module("quote_mod_sdk.self_prompt")
    assert a is b and a.EraseMode.NONE is b.EraseMode.NONE
    assert importlib.import_module("quote_mod_sdk.conversation") is importlib.import_module("shared.conversation")
    assert importlib.import_module("sdk.quote_mod_sdk.flow").FlowQuestion is FlowQuestion


def test_pattern_strat_compiles_fixed_length_patterns_to_positions():
    from mods.strategies.pattern import FixedPatternStrategy, PatternStrat, fixed_positions

    assert len(fixed_positions(r"^[0-9]{4}-\d{2}-(\d\d)$")) == 10
    assert fixed_positions(r"[a-z]+") is None and fixed_positions("ab|cd") is None and fixed_positions("[^a]") is None
    assert fixed_positions("a|b") == [frozenset("ab")]  # one position either way
    date = PatternStrat(r"[0-9]{4}-[0-9]{2}").into_strategy(TOK)
    assert isinstance(date, FixedPatternStrategy)
    state = date.start(TOK)
    assert date.allowed_tokens(state, TOK) == set(ids("0123456789"))
    for ch in "2024":
        date.step(state, ids(ch)[0], TOK)
    assert date.allowed_tokens(state, TOK) == set(ids("-"))
    for ch in "-11":
        date.step(state, ids(ch)[0], TOK)
    assert date.is_complete(state) and date.allowed_tokens(state, TOK) == set()
    loose = PatternStrat(r"\w+@\w+", stop='"').into_strategy(TOK)  # not fixed: a STRING fallback
    assert isinstance(loose, CharsStrategy)
