"""OpenAI's sampling fields without the model: the request's checks (the same error whichever door)
and the batched sampler's math — logit_bias, presence/frequency penalties, the step's suppressed
ids (min_tokens) and a grammar's packed mask — each against a hand computation, with the plain
greedy rows still on the batch's one argmax."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.inputs import GenerationRequest
from engine.errors import InvalidRequestError
from engine.model.sampling import SampleRow, SamplingParams, TokenCounts, make_generator, sample_rows, unpack_mask

V = 8


def req(**fields):
    return GenerationRequest(prompt="hi", **fields)


# ------------------------------------------------------------------------------- request checks


def test_logit_bias_reads_string_keys_as_token_ids():
    assert req(logit_bias={"5": 3, 7: -100, "12": 0.5}).logit_bias == {5: 3.0, 7: -100.0, 12: 0.5}


@pytest.mark.parametrize("bias, named", [
    ({"a": 1}, "`logit_bias` keys must be token ids"),
    ({-1: 1}, "`logit_bias` keys must be token ids"),
    ({3: 101}, r"`logit_bias\[3\]` must be a number in \[-100, 100\]"),
    ({3: float("nan")}, r"`logit_bias\[3\]` must be a number"),
    ({3: True}, r"`logit_bias\[3\]` must be a number"),
    ([1, 2], "`logit_bias` must be an object"),
])
def test_bad_logit_bias_is_refused_naming_it(bias, named):
    with pytest.raises(InvalidRequestError, match=named):
        req(logit_bias=bias)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_must_be_in_minus_two_to_two(field):
    assert getattr(req(**{field: -2}), field) == -2
    for bad in (2.5, -3, "1", True, float("nan")):
        with pytest.raises(InvalidRequestError, match=f"`{field}` must be a number in \\[-2, 2\\]"):
            req(**{field: bad})


def test_min_tokens_is_a_non_negative_int_at_most_max_tokens():
    assert req(min_tokens=3, max_tokens=3).min_tokens == 3
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidRequestError, match="`min_tokens` must be an integer >= 0"):
            req(min_tokens=bad)
    with pytest.raises(InvalidRequestError, match=r"`min_tokens` must be <= max_tokens \(2\), got 5"):
        req(min_tokens=5, max_tokens=2)


TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},)


def test_tool_choice_shapes():
    for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        assert req(tools=TOOLS, tool_choice=choice).tool_choice == choice
    with pytest.raises(InvalidRequestError, match="`tool_choice` must be one of none, auto, required"):
        req(tools=TOOLS, tool_choice="always")
    with pytest.raises(InvalidRequestError, match="`tool_choice` must not be 'required' without `tools`"):
        req(tool_choice="required")
    with pytest.raises(InvalidRequestError, match=r"`tool_choice.function.name` must name one of `tools` "
                                                  r"\(get_weather\), got 'other'"):
        req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "other"}})
    with pytest.raises(InvalidRequestError, match="`parallel_tool_calls` must be true or false"):
        req(parallel_tool_calls="yes")
    assert req(parallel_tool_calls=False).parallel_tool_calls is False


def test_response_format_extensions_need_their_text():
    assert req(response_format={"type": "regex", "regex": "a+"}).response_format["regex"] == "a+"
    assert req(response_format={"type": "grammar", "grammar": "start: \"x\""}).response_format["type"] == "grammar"
    with pytest.raises(InvalidRequestError, match="`response_format.regex` must be a non-empty string"):
        req(response_format={"type": "regex"})
    with pytest.raises(InvalidRequestError, match="`response_format.type` must be one of text, json_object, "
                                                  "json_schema, regex, grammar"):
        req(response_format={"type": "xml"})


# -------------------------------------------------------------------------------- sampler math


def draw(logits, params, *, seed, logprobs=-1, generated=None, history=None, **row):
    """One row drawn; ``generated``/``history``: token lists, counted as the request state does."""
    counted = {name: TokenCounts(tokens, len(logits), torch.device("cpu")).counts
               for name, tokens in (("generated", generated), ("history", history)) if tokens is not None}
    return sample_rows([SampleRow(torch.tensor(logits, dtype=torch.float32), params,
                                  make_generator(seed, torch.device("cpu")), logprobs=logprobs, **counted, **row)])[0]


PEAKED = [0.0, 0.0, 0.0, 8.0, 0.0, 0.0, 0.0, 0.0]  # token 3 carries ~99.8% of the mass at temperature 1


def test_logit_bias_minus_100_bans_and_plus_100_forces_at_temperature_1():
    plain = SamplingParams(temperature=1.0)
    assert sum(draw(PEAKED, plain, seed=s).token == 3 for s in range(50)) >= 45  # positive control
    banned = SamplingParams(temperature=1.0, logit_bias=((3, -100.0),))
    assert all(draw(PEAKED, banned, seed=s).token != 3 for s in range(50))
    flat = [0.0] * V
    assert len({draw(flat, plain, seed=s).token for s in range(50)}) > 3  # positive control: it spreads
    forced = SamplingParams(temperature=1.0, logit_bias=((6, 100.0),))
    assert all(draw(flat, forced, seed=s).token == 6 for s in range(50))


def test_logit_bias_is_added_to_the_logits():
    logits = [0.5, -1.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    params = SamplingParams(temperature=0.0, logit_bias=((1, 4.0), (2, -0.5)))
    top = dict(draw(logits, params, seed=0, logprobs=V).top)
    expected = torch.log_softmax(torch.tensor(logits) + torch.tensor([0, 4.0, -0.5, 0, 0, 0, 0, 0]), -1)
    assert max(abs(top[i] - float(expected[i])) for i in range(V)) < 1e-5 * max(1.0, float(expected.abs().max()))


def test_presence_and_frequency_penalties_follow_openais_rule():
    logits = [1.0, 2.0, 0.5, 3.0, 0.0, 1.5, 0.2, 0.1]
    generated = [3, 3, 3, 1, 5]
    params = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4)
    got = dict(draw(logits, params, seed=0, logprobs=V, generated=generated).top)
    counts = [generated.count(i) for i in range(V)]
    hand = [logits[i] - 0.4 * counts[i] - 0.7 * (counts[i] > 0) for i in range(V)]
    norm = math.log(sum(math.exp(x) for x in hand))
    assert max(abs(got[i] - (hand[i] - norm)) for i in range(V)) < 1e-5 * max(1.0, abs(norm))
    # the penalties change the choice: the repeated argmax (3) loses to the next best, and a
    # negative penalty makes a generated token (5: 1.5 + 2.0 > 3.0) the choice
    assert draw(logits, SamplingParams(temperature=0.0), seed=0, generated=generated).token == 3
    heavy = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert draw(logits, heavy, seed=0, generated=generated).token != 3
    assert draw(logits, SamplingParams(temperature=0.0, presence_penalty=-2.0), seed=0, generated=[5]).token == 5


def test_repetition_penalty_matches_transformers_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = [1.0, -2.0, 0.5, 3.0, 0.0, 1.5, -0.2, 0.1]
    history = [3, 3, 1, 6, 0]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.7)
    got = dict(draw(logits, params, seed=0, logprobs=V, history=history).top)
    expected = torch.log_softmax(RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([history]),
                                                                       torch.tensor([logits]))[0], -1)
    assert max(abs(got[i] - float(expected[i])) for i in range(V)) < 1e-5
    plain = dict(draw(logits, SamplingParams(temperature=0.0), seed=0, logprobs=V).top)
    assert abs(plain[3] - got[3]) > 0.1  # positive control: the penalty moved the repeated token


def test_token_counts_follow_tokens_joining_and_leaving():
    counts = TokenCounts([3, 3, 1, 99], 8, torch.device("cpu"))  # 99: no logit, not counted
    assert counts.counts.tolist() == [0, 1, 0, 2, 0, 0, 0, 0]
    counts.add([5, 3])
    counts.remove([3, 1])
    assert counts.counts.tolist() == [0, 0, 0, 2, 0, 1, 0, 0]


def test_suppressed_ids_are_not_drawn_this_step():
    params = SamplingParams(temperature=0.0)
    assert draw(PEAKED, params, seed=0).token == 3
    assert draw(PEAKED, params, seed=0, suppress=(3,)).token != 3
    sampled = SamplingParams(temperature=1.0)
    assert all(draw(PEAKED, sampled, seed=s, suppress=(3, 0)).token not in (3, 0) for s in range(30))


def packed(allowed: set[int], vocab: int = V) -> torch.Tensor:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_unpack_mask_reads_bit_t_mod_32_of_word_t_div_32_bit_31_included():
    allowed = {0, 5, 31, 32, 63, 70}
    got = unpack_mask(packed(allowed, 80)[None, :], 80)[0]
    assert set(torch.nonzero(got).flatten().tolist()) == allowed


def test_a_grammar_mask_limits_greedy_and_sampled_draws():
    mask = packed({1, 5})
    assert draw(PEAKED, SamplingParams(temperature=0.0), seed=0, mask=mask).token in (1, 5)
    draws = {draw([0.0] * V, SamplingParams(temperature=1.0, top_k=1), seed=s, mask=mask).token for s in range(30)}
    assert draws <= {1, 5}  # top-k runs after the mask: it picks among the allowed tokens
    spread = {draw([0.0] * V, SamplingParams(temperature=1.0), seed=s, mask=mask).token for s in range(30)}
    assert spread == {1, 5}


def test_plain_greedy_rows_stay_on_the_fast_path_and_batches_mix():
    plain = SampleRow(torch.tensor(PEAKED), SamplingParams(0.0), make_generator(0, torch.device("cpu")))
    assert plain.plain
    for extra in ({"suppress": (3,)}, {"mask": packed({1})}, {"logprobs": 0}):
        assert not SampleRow(torch.tensor(PEAKED), SamplingParams(0.0), plain.generator, **extra).plain
    for params in (SamplingParams(0.0, logit_bias=((1, 1.0),)), SamplingParams(0.0, presence_penalty=0.5),
                   SamplingParams(1.0)):
        assert not SampleRow(torch.tensor(PEAKED), params, plain.generator).plain
    rows = [plain, SampleRow(torch.tensor(PEAKED), SamplingParams(0.0), plain.generator, mask=packed({6})),
            SampleRow(torch.tensor(PEAKED), SamplingParams(0.0, logit_bias=((3, -100.0),)), plain.generator)]
    tokens = [r.token for r in sample_rows(rows)]
    assert tokens[0] == 3 and tokens[1] == 6 and tokens[2] != 3


def test_seeded_draws_repeat_with_every_field_on():
    params = SamplingParams(temperature=0.9, top_p=0.95, logit_bias=((2, 1.5),), presence_penalty=0.3,
                            frequency_penalty=0.2)
    logits = [0.3, 0.1, 0.2, 0.9, 0.4, 0.0, 0.8, 0.5]
    first = [draw(logits, params, seed=s, generated=[3, 6], mask=packed({2, 3, 4, 6})).token for s in range(20)]
    again = [draw(logits, params, seed=s, generated=[3, 6], mask=packed({2, 3, 4, 6})).token for s in range(20)]
    assert first == again and set(first) <= {2, 3, 4, 6} and len(set(first)) > 1
