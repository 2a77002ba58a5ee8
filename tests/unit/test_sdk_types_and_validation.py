"""Events, actions, the validation table, ActionBuilder, @mod and friends."""

from __future__ import annotations

import numpy as np
import pytest

from mods import (
    ActionBuilder,
    Added,
    AdjustedLogits,
    AdjustedPrefill,
    Backtrack,
    EmitError,
    ForceOutput,
    ForceTokens,
    ForwardPass,
    InvalidActionError,
    Noop,
    Prefilled,
    Sampled,
    ToolCalls,
    create_mod,
    mod,
    tokenize,
    validate_action,
)
from mods.tensor import NumpyTensor
from mods.types import Steer
from mods.validation import ALLOWED_ACTIONS

ALLOWED = {
    Prefilled: {Noop, ForceOutput, ToolCalls, AdjustedPrefill, EmitError},
    ForwardPass: {Noop, ForceTokens, Backtrack, ForceOutput, ToolCalls, AdjustedLogits, EmitError, Steer},
    Sampled: {Noop, ForceTokens, Backtrack, ForceOutput, ToolCalls, EmitError, Steer},
    Added: {Noop, ForceTokens, Backtrack, ForceOutput, ToolCalls, EmitError, Steer},
}
ACTIONS = {
    Noop: lambda: Noop(), AdjustedPrefill: lambda: AdjustedPrefill([1], 0), ForceTokens: lambda: ForceTokens([1]),
    Backtrack: lambda: Backtrack(1), AdjustedLogits: lambda: AdjustedLogits(None), ForceOutput: lambda: ForceOutput([1]),
    ToolCalls: lambda: ToolCalls({}), EmitError: lambda: EmitError("e"), Steer: lambda: Steer(3, 2.0),
}
EVENTS = {
    Prefilled: lambda: Prefilled("r", 0, 4), ForwardPass: lambda: ForwardPass("r", 0, NumpyTensor(np.zeros((1, 8)))),
    Sampled: lambda: Sampled("r", 0, 3), Added: lambda: Added("r", 0, [3], False),
}


@pytest.mark.parametrize("event_cls", list(EVENTS))
@pytest.mark.parametrize("action_cls", list(ACTIONS))
def test_validation_table_accepts_exactly_the_allowed_pairs(event_cls, action_cls):
    event, action = EVENTS[event_cls](), ACTIONS[action_cls]()
    if action_cls in ALLOWED[event_cls]:
        assert validate_action(event, action) is action
    else:
        with pytest.raises(InvalidActionError, match=f"Action {action_cls.__name__} not permitted"):
            validate_action(event, action)


def test_validation_table_has_the_original_24_cells_plus_steer_on_the_three_step_events():
    assert sum(len(v) for v in ALLOWED_ACTIONS.values()) == 24 + 3
    assert [e for e, allowed in ALLOWED_ACTIONS.items() if Steer in allowed] == [ForwardPass, Sampled, Added]


def test_none_becomes_noop_and_a_string_is_invalid():
    assert isinstance(validate_action(Sampled("r", 0, 1), None), Noop)
    with pytest.raises(ValueError):  # InvalidActionError is a ValueError
        validate_action(Sampled("r", 0, 1), "ForceTokens")


def test_event_subclass_is_unsupported():
    class MySampled(Sampled):
        pass

    with pytest.raises(InvalidActionError, match="Unsupported event type MySampled"):
        validate_action(MySampled("r", 0, 1), Noop())


def test_events_take_new_internals_as_optional_keywords():
    fp = ForwardPass("r", 1, NumpyTensor(np.zeros((1, 4))))
    assert fp.hidden_states is None and fp.attention_patterns is None and fp.layer is None and fp.input_ids is None
    pre = Prefilled("r", 0, 8, None, hidden_states="h", layer=3, input_ids=[1])
    assert pre.context_info == {} and pre.layer == 3
    added = Added("r", 0, (1, 2), True)
    assert added.added_tokens == [1, 2]


def test_actions_normalise_like_the_original():
    assert Backtrack("3").n == 3 and Backtrack(1).tokens is None and Backtrack(1, []).tokens == []
    assert ForceTokens((1, 2)).tokens == [1, 2]
    action = ForceTokens([1])
    action._source = "m"  # the engine sets private attributes on returned actions
    assert action._source == "m"


def test_top_k_logprob_is_2d_sorted_and_normalised():
    logits = np.array([[0.0, 3.0, 1.0, 2.0]], dtype=np.float32)
    lp, idx = ForwardPass("r", 0, NumpyTensor(logits)).top_k_logprob(2)
    assert idx.tolist() == [[1, 3]]
    expected = logits[0] - np.log(np.exp(logits[0]).sum())
    np.testing.assert_allclose(lp[0], expected[[1, 3]], rtol=1e-6)
    with pytest.raises(ValueError):
        ForwardPass("r", 0, NumpyTensor(logits)).top_k_logprob(5)
    with pytest.raises(ValueError):
        ForwardPass("r", 0, NumpyTensor(logits[0])).top_k_logprob(1)


def test_action_builder_checks_events_and_keyword_names():
    fp = ForwardPass("r", 0, NumpyTensor(np.zeros((1, 4))))
    b = ActionBuilder(fp)
    assert b.force_tokens(tokens=[1, "2"]).tokens == [1, 2]
    bt = b.backtrack(steps=2, tokens=[5])
    assert (bt.n, bt.tokens) == (2, [5])
    assert b.backtrack(steps=1, tokens=[]).tokens is None
    assert b.adjust_logits().logits is fp.logits
    with pytest.raises(InvalidActionError, match="'adjust_prefill' not permitted for event type ForwardPass"):
        b.adjust_prefill(tokens=[1])
    pre = ActionBuilder(Prefilled("r", 0, 1))
    assert pre.adjust_prefill(tokens=[1, 2]).max_steps == 0
    with pytest.raises(InvalidActionError):
        pre.force_tokens(tokens=[1])
    with pytest.raises(ValueError):
        pre.force_output("text")  # int() of a str, as in the original (F22)


def test_mod_decorator_wraps_two_and_three_argument_handlers():
    @mod
    def three(event, actions, tokenizer):
        return actions.force_tokens([tokenizer])

    @mod
    def two(event, actions):
        return actions.noop()

    sampled = Sampled("r", 0, 1)
    assert three(sampled, 7).tokens == [7]
    assert isinstance(two(sampled), Noop)
    assert three.__name__ == "three" and hasattr(three, "__wrapped__")
    assert not hasattr(mod, "__wrapped__") and not hasattr(create_mod, "__wrapped__")


def test_mod_decorator_surfaces_a_handlers_own_type_error_without_running_it_twice():
    runs = []

    @mod
    def buggy(event, actions, tokenizer):
        runs.append(1)
        return None + 1

    with pytest.raises(TypeError, match="unsupported operand"):
        buggy(Sampled("r", 0, 1))
    assert runs == [1]


def test_mod_decorator_retries_with_two_arguments_when_the_signature_allows_both():
    calls = []

    @mod
    def flexible(event, actions, tokenizer=None):
        calls.append(tokenizer)
        if tokenizer is not None:
            raise TypeError("tokenizer not wanted")

    assert isinstance(flexible(Sampled("r", 0, 1), "tok"), Noop)
    assert calls == ["tok", None]


def test_mod_validates_its_result():
    @mod
    def wrong(event, actions, tokenizer):
        return AdjustedLogits(None)

    with pytest.raises(InvalidActionError):
        wrong(Sampled("r", 0, 1))


def test_create_mod_has_no_fallback_and_is_named_mod():
    handler = create_mod(lambda event, actions, tokenizer: None)
    assert handler.__name__ == "_mod"
    assert isinstance(handler(Sampled("r", 0, 1)), Noop)


def test_tokenize_contract():
    class Enc:
        def encode(self, text, add_special_tokens=False):
            return np.array([len(text), int(add_special_tokens)])

    assert tokenize("abc", Enc()) == [3, 0]
    assert tokenize("abc", lambda text: {"input_ids": (1, 2)}) == [1, 2]
    with pytest.raises(RuntimeError, match="Tokenizer is required"):
        tokenize("x", None)

    class Broken:
        def encode(self, *a, **k):
            raise KeyError("x")

    with pytest.raises(RuntimeError, match="Tokenizer failed to encode text"):
        tokenize("x", Broken())


# --------------------------------------------------------------------- values an action may carry

VOCAB = 10


def test_token_ids_are_ints_in_the_vocabulary():
    from mods.validation import check_token_ids

    assert check_token_ids([0, np.int64(3), np.array(9)], VOCAB) == [0, 3, 9]
    assert check_token_ids(np.arange(3), VOCAB) == [0, 1, 2]


@pytest.mark.parametrize("ids,field,fragment", [
    ([-1], "ForceTokens.tokens[0]", "must be a token id in [0, 10), got -1."),
    ([1, VOCAB], "ForceTokens.tokens[1]", "must be a token id in [0, 10), got 10."),
    ([2.0], "ForceTokens.tokens[0]", "must be an int token id, got 2.0."),
    ([True], "ForceTokens.tokens[0]", "must be an int token id, got True."),
    ("12", "ForceTokens.tokens", "must be a list of token ids, got '12'."),
])
def test_bad_token_ids_are_refused_naming_the_field(ids, field, fragment):
    from mods.validation import InvalidActionValue, check_token_ids

    with pytest.raises(InvalidActionValue) as info:
        check_token_ids(ids, VOCAB, field="ForceTokens.tokens")
    assert str(info.value) == f"`{field}` {fragment}"
    assert info.value.parameter == field and isinstance(info.value, (InvalidActionError, ValueError))


def test_finite_logits_with_some_masked_are_accepted():
    from mods.validation import check_logits

    logits = np.zeros((1, VOCAB), dtype=np.float32)
    logits[0, 1:] = -np.inf
    check_logits(logits, vocab=VOCAB)
    check_logits(NumpyTensor(logits[0]))
    check_logits(np.arange(VOCAB))  # integers are numbers too


@pytest.mark.parametrize("make,fragment", [
    (lambda a: a * np.nan, "must not contain NaN, got 10 NaN of 10 values."),
    (lambda a: np.where(np.arange(VOCAB) == 3, np.nan, a), "must not contain NaN, got 1 NaN of 10 values."),
    (lambda a: np.where(np.arange(VOCAB) == 3, np.inf, a), "must not contain +inf, got 1 of 10 values."),
    (lambda a: a - np.inf, "must leave at least one finite logit, got -inf everywhere."),
    (lambda a: a[:0].reshape(1, 0), "must not be empty, got shape [1, 0]."),
    (lambda a: a[:5], "must have shape [10] or [1, 10], got [5]."),
    (lambda a: np.array(["x"] * VOCAB), "must be an array of numbers, got dtype <U1."),
])
def test_logits_that_cannot_be_sampled_from_are_refused(make, fragment):
    from mods.validation import InvalidActionValue, check_logits

    with pytest.raises(InvalidActionValue) as info:
        check_logits(make(np.zeros(VOCAB)), vocab=None if "empty" in fragment else VOCAB)
    assert str(info.value) == f"`AdjustedLogits.logits` {fragment}"


def test_token_temp_allows_none_zero_for_greedy_and_positive_numbers():
    from mods.validation import check_token_temp

    assert [check_token_temp(t) for t in (None, 0, 0.7, np.float32(2))] == [None, 0.0, 0.7, 2.0]


@pytest.mark.parametrize("temp", [-0.5, float("nan"), float("inf"), "1", True])
def test_bad_token_temp_is_refused(temp):
    from mods.validation import InvalidActionValue, check_token_temp

    with pytest.raises(InvalidActionValue, match=r"^`AdjustedLogits.token_temp` must be None"):
        check_token_temp(temp)


def test_check_action_values_checks_every_value_field_of_each_action():
    from mods.validation import InvalidActionValue, check_action_values

    for good in (ForceTokens([1]), ForceOutput([2]), AdjustedPrefill([3], 0), Backtrack(1), Backtrack(0, [4]),
                 AdjustedLogits(np.zeros(VOCAB), 0), Noop(), EmitError("e"), ToolCalls({})):
        check_action_values(good, VOCAB)
    bad = {
        ForceTokens([-1]): "ForceTokens.tokens[0]", ForceOutput([VOCAB]): "ForceOutput.tokens[0]",
        AdjustedPrefill([-2], 0): "AdjustedPrefill.tokens[0]", Backtrack(-1): "Backtrack.n",
        Backtrack(1, [-3]): "Backtrack.tokens[0]", AdjustedLogits(np.zeros(VOCAB), -1.0): "AdjustedLogits.token_temp",
        AdjustedLogits(np.full(VOCAB, np.nan)): "AdjustedLogits.logits",
    }
    for action, field in bad.items():
        with pytest.raises(InvalidActionValue) as info:
            check_action_values(action, VOCAB)
        assert info.value.parameter == field, action
    check_action_values(AdjustedLogits(np.full(VOCAB, np.nan)), VOCAB, logits=False)  # checked elsewhere
