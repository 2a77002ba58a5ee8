"""The input processor is the one home of what needs the model: the stop set, the context rule,
vocabulary checks and defaults. Checked on the embedded model's engine."""

from __future__ import annotations

import pytest

from engine.core.inputs import GenerationRequest
from engine.errors import ContextOverflowError, TokenOutOfVocabularyError


def test_the_stop_set_is_eos_plus_stop_tokens_unless_eos_is_ignored(engine):
    eos = frozenset(engine.backend.info.eos_token_ids)
    assert eos, "positive control: the embedded model has EOS ids"
    process = engine.processor.process
    assert process(GenerationRequest(prompt="hi")).stop_ids == eos
    assert process(GenerationRequest(prompt="hi", stop_tokens=[5])).stop_ids == eos | {5}
    assert process(GenerationRequest(prompt="hi", stop_tokens=[5], ignore_eos=True)).stop_ids == {5}


def test_defaults_come_from_the_config_and_a_servers_cap_bounds_the_default(engine):
    gen = engine.config.generation
    req = engine.processor.process(GenerationRequest(prompt="hi"))
    assert req.max_tokens == gen.max_tokens and req.sampling.temperature == gen.temperature
    capped = engine.processor.process(GenerationRequest(prompt="hi", max_tokens_cap=3))
    assert capped.max_tokens == min(gen.max_tokens, 3)
    assert engine.processor.process(GenerationRequest(prompt="hi", max_tokens=2, max_tokens_cap=3)).max_tokens == 2


def test_token_ids_are_checked_against_the_vocabulary(engine):
    vocab = engine.backend.info.vocab_size
    for field in ("input_ids", "stop_tokens", "banned_tokens"):
        fields = {"input_ids": [1, vocab]} if field == "input_ids" else {"prompt": "hi", field: [vocab]}
        with pytest.raises(TokenOutOfVocabularyError) as err:
            engine.processor.process(GenerationRequest(**fields))
        assert err.value.parameter.startswith(field)
    assert engine.processor.process(GenerationRequest(input_ids=[1, vocab - 1])).input_ids == (1, vocab - 1)


def test_a_prompt_that_cannot_fit_is_refused_by_the_one_context_rule(engine):
    limit = engine.processor.limit
    assert limit == min(engine.backend.info.max_context, engine.backend.max_sequence)
    with pytest.raises(ContextOverflowError, match=f"shorter than {limit} tokens") as err:
        engine.processor.process(GenerationRequest(input_ids=[1] * limit))
    assert err.value.parameter == "input_ids"
    assert len(engine.processor.process(GenerationRequest(input_ids=[1] * (limit - 1))).input_ids) == limit - 1


def test_a_banned_list_covering_the_whole_vocabulary_is_refused(engine):
    from engine.errors import InvalidRequestError

    vocab = engine.backend.info.vocab_size
    with pytest.raises(InvalidRequestError, match="must leave at least one token") as err:
        engine.processor.process(GenerationRequest(prompt="hi", banned_tokens=list(range(vocab))))
    assert err.value.parameter == "banned_tokens"
    allowed = engine.processor.process(GenerationRequest(prompt="hi", banned_tokens=list(range(vocab - 1))))
    assert len(allowed.sampling.banned) == vocab - 1  # one left: fine
