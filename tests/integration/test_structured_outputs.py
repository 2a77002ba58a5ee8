"""Structured outputs and OpenAI's sampling fields on the embedded model, through
``Engine.generate``: JSON-schema outputs that parse and validate at temperature > 0 for several
schemas and seeds — alone, beside a mod that adjusts logits, with a mod that backtracks (the
grammar rolls back) and with a mod whose forced tokens leave the grammar (they bypass it) — the
regex extension, enforced tool choices, logit_bias, ignore_eos/min_tokens, and refusals that name
what cannot be enforced before anything runs."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import numpy as np
import pytest

from engine.core.result import FinishReason
from engine.errors import InvalidRequestError, TokenOutOfVocabularyError
from mods import Added, ForwardPass, mod

pytestmark = pytest.mark.slow

PROMPT = "Describe a small animal as JSON."
SCHEMAS = {
    "enum+int": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
        "required": ["colour", "legs"], "additionalProperties": False},
    "short strings": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "cute": {"type": "boolean"}},
        "required": ["name", "cute"], "additionalProperties": False},
    "array+anyOf": {"type": "object", "properties": {
        "sizes": {"type": "array", "items": {"enum": ["S", "M", "L"]}, "minItems": 1, "maxItems": 3},
        "weight": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 99}, {"type": "null"}]}},
        "required": ["sizes", "weight"], "additionalProperties": False},
}
SEEDS = (0, 1, 2)
MAX_TOKENS = 48


def json_schema(schema, name="animal"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def assert_valid(result, schema):
    assert result.finish_reason is FinishReason.STOP, (result.finish_reason, result.output_text, result.error)
    jsonschema.validate(json.loads(result.output_text), schema)


def noisy_logits():
    """A mod adding fixed Gaussian noise (scale 4) to every step's logits: it changes which of the
    allowed tokens win, and the grammar still holds."""
    rng = np.random.default_rng(0)

    @mod
    def noisy(event, actions, tokenizer):
        if isinstance(event, ForwardPass):
            logits = event.logits.to_numpy()
            logits = logits + rng.normal(0.0, 4.0, logits.shape).astype(logits.dtype)
            return actions.adjust_logits(type(event.logits).from_numpy(logits))
        return None

    return noisy


def backtrack_once(at_step: int, n: int):
    fired: list[int] = []

    @mod
    def backtracker(event, actions, tokenizer):
        if isinstance(event, Added) and event.step == at_step and not fired:
            fired.append(event.step)
            return actions.backtrack(steps=n)
        return None

    return backtracker, fired


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_outputs_parse_and_validate_across_seeds(engine, name):
    schema = SCHEMAS[name]
    outputs = set()
    for seed in SEEDS:
        result = engine.generate(prompt=PROMPT, response_format=json_schema(schema), temperature=1.0, top_p=0.95,
                                 seed=seed, max_tokens=MAX_TOKENS)
        assert_valid(result, schema)
        outputs.add(result.output_text)
        if seed == SEEDS[0]:
            again = engine.generate(prompt=PROMPT, response_format=json_schema(schema), temperature=1.0, top_p=0.95,
                                    seed=seed, max_tokens=MAX_TOKENS)
            assert again.output_ids == result.output_ids  # seeded: the same draws
    assert len(outputs) > 1, "the seeds gave one output: the test does not sample"


def test_without_the_grammar_the_same_request_is_not_that_json(engine):
    """Positive control: the prompt alone does not make the model write the schema's object."""
    free = [engine.generate(prompt=PROMPT, temperature=1.0, top_p=0.95, seed=s, max_tokens=MAX_TOKENS)
            for s in SEEDS]
    for result in free:
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(result.output_text), SCHEMAS["enum+int"])


@pytest.mark.parametrize("name", ["enum+int", "array+anyOf"])
def test_a_mod_that_adjusts_logits_and_the_grammar_both_apply(engine, name):
    schema = SCHEMAS[name]
    for seed in SEEDS[:2]:
        plain = engine.generate(prompt=PROMPT, response_format=json_schema(schema), temperature=0.8, seed=seed,
                                max_tokens=MAX_TOKENS)
        adjusted = engine.generate(prompt=PROMPT, response_format=json_schema(schema), temperature=0.8, seed=seed,
                                   max_tokens=MAX_TOKENS, mods=[noisy_logits()])
        assert_valid(adjusted, schema)
        assert sum(type(a).__name__ == "AdjustedLogits" for a in adjusted.actions) == len(adjusted.sequence_ids)
        assert adjusted.output_ids != plain.output_ids  # the mod's adjustment took effect too


@pytest.mark.parametrize("at_step, n", [(4, 3), (6, 6)])
def test_a_backtrack_rolls_the_grammar_back_and_the_output_stays_valid(engine, at_step, n):
    schema = SCHEMAS["short strings"]
    for seed in SEEDS[:2]:
        backtracker, fired = backtrack_once(at_step, n)
        result = engine.generate(prompt=PROMPT, response_format=json_schema(schema), temperature=1.0, seed=seed,
                                 max_tokens=MAX_TOKENS, mods=[backtracker])
        assert fired and [type(a).__name__ for a in result.actions] == ["Backtrack"]
        assert_valid(result, schema)
        # the erased tokens were drawn again from the rolled-back grammar: more were generated than kept
        assert result.metadata["steps"] > len(result.sequence_ids)


def test_forced_tokens_outside_the_grammar_bypass_it_and_it_resumes_once_erased(engine, tokenizer):
    schema = SCHEMAS["enum+int"]
    note = tokenizer.encode(" (thinking)", add_special_tokens=False)

    @mod
    def note_then_erase(event, actions, tok):
        if isinstance(event, ForwardPass) and event.step == 0:
            return actions.force_tokens(note)
        if isinstance(event, Added) and event.step == 1:
            return actions.backtrack(steps=len(note) + 1)  # the note and the one token drawn after it
        return None

    @mod
    def note_and_keep(event, actions, tok):
        if isinstance(event, ForwardPass) and event.step == 0:
            return actions.force_tokens(note)
        return None

    erased = engine.generate(prompt=PROMPT, response_format=json_schema(schema), temperature=0.7, seed=3,
                             max_tokens=MAX_TOKENS, mods=[note_then_erase])
    assert_valid(erased, schema)
    kept = engine.generate(prompt=PROMPT, response_format=json_schema(schema), temperature=0.7, seed=3,
                           max_tokens=16, mods=[note_and_keep])
    assert kept.output_ids[:len(note)] == note and kept.finish_reason is not FinishReason.ERROR


def test_the_regex_extension(engine):
    pattern = r"(yes|no), because [a-z ]{3,24}\."
    for seed in SEEDS:
        result = engine.generate(prompt="Is the sky blue? Answer yes or no and why.", temperature=1.0, seed=seed,
                                 response_format={"type": "regex", "regex": pattern}, max_tokens=MAX_TOKENS)
        assert result.finish_reason is FinishReason.STOP and re.fullmatch(pattern, result.output_text), \
            result.output_text


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def assert_tool_call(result, names):
    assert result.finish_reason is FinishReason.TOOL_CALLS and result.output_text == "", result.error
    [call] = result.tool_calls
    name = call["function"]["name"]
    assert name in names and call["type"] == "function" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])
    return name


def test_tool_choice_required_and_named_turn_the_output_into_a_valid_tool_call(engine):
    question = "What is the weather in Paris right now?"
    auto = engine.generate(prompt=question, tools=TOOLS, tool_choice="auto", temperature=0.0, max_tokens=24)
    assert auto.finish_reason is not FinishReason.TOOL_CALLS and auto.tool_calls is None  # positive control
    for seed in SEEDS[:2]:
        required = engine.generate(prompt=question, tools=TOOLS, tool_choice="required", temperature=0.8, seed=seed,
                                   max_tokens=MAX_TOKENS)
        assert_tool_call(required, {"get_weather", "get_time"})
        named = engine.generate(prompt=question, tools=TOOLS, temperature=0.8, seed=seed, max_tokens=MAX_TOKENS,
                                tool_choice={"type": "function", "function": {"name": "get_time"}},
                                parallel_tool_calls=False)
        assert assert_tool_call(named, {"get_time"}) == "get_time"


def test_logit_bias_changes_the_output(engine, tokenizer):
    prompt = "What is the capital of France?"
    base = engine.generate(prompt=prompt, temperature=0.0, max_tokens=8)
    banned = engine.generate(prompt=prompt, temperature=0.0, max_tokens=8, logit_bias={str(base.output_ids[0]): -100})
    assert banned.output_ids[0] != base.output_ids[0]
    target = tokenizer.encode(" Bonjour", add_special_tokens=False)[0]
    pushed = engine.generate(prompt=prompt, temperature=1.0, seed=5, max_tokens=4, logit_bias={target: 100})
    assert pushed.output_ids == [target] * 4
    with pytest.raises(TokenOutOfVocabularyError, match="`logit_bias` keys must be token ids <"):
        engine.generate(prompt=prompt, logit_bias={10 ** 7: 1})


def test_ignore_eos_and_min_tokens_keep_generating_past_the_models_end(engine):
    prompt = "What is the capital of France?"
    base = engine.generate(prompt=prompt, temperature=0.0, max_tokens=24)
    assert base.finish_reason is FinishReason.STOP and len(base.sequence_ids) < 20  # positive control
    ignoring = engine.generate(prompt=prompt, temperature=0.0, max_tokens=24, ignore_eos=True)
    assert ignoring.finish_reason is FinishReason.LENGTH and len(ignoring.sequence_ids) == 24
    held = engine.generate(prompt=prompt, temperature=0.0, max_tokens=24, min_tokens=20)
    stops = engine.processor.eos_token_ids
    assert not any(t in stops for t in held.sequence_ids[:20]) and len(held.sequence_ids) >= 20


def test_penalties_change_a_repetitive_output(engine):
    prompt = "Repeat the word 'cat' many times."
    base = engine.generate(prompt=prompt, temperature=0.0, max_tokens=16)
    penalised = engine.generate(prompt=prompt, temperature=0.0, max_tokens=16, frequency_penalty=2.0,
                                presence_penalty=2.0)
    assert penalised.output_ids != base.output_ids
    assert len(set(penalised.sequence_ids)) >= len(set(base.sequence_ids))


def test_structured_and_plain_requests_share_a_batch(engine):
    schema = SCHEMAS["enum+int"]
    results: dict[int, object] = {}

    def run(i):
        kwargs = {"response_format": json_schema(schema)} if i % 2 == 0 else {}
        results[i] = engine.generate(prompt=PROMPT, temperature=0.9, seed=i, max_tokens=MAX_TOKENS, **kwargs)

    before = engine.loop.stats.steps
    with engine.loop.admission_held():
        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
    for t in threads:
        t.join(timeout=300)
    for i in range(0, 6, 2):
        assert_valid(results[i], schema)
    tokens = sum(len(r.sequence_ids) for r in results.values())
    assert engine.loop.stats.steps - before < tokens  # they were batched


def test_what_cannot_be_enforced_is_refused_naming_it_before_anything_runs(engine):
    steps = engine.loop.stats.steps
    for schema, named in [({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
                          ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if")]:
        with pytest.raises(InvalidRequestError, match=f"response_format.json_schema.schema.*{named}") as err:
            engine.generate(prompt=PROMPT, response_format=json_schema(schema))
        assert err.value.parameter == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError, match="`tool_choice` must be tools whose parameters"):
        engine.generate(prompt=PROMPT, tool_choice="required", tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "not": {"required": ["x"]}}}}])
    assert engine.loop.stats.steps == steps


def test_the_structured_bench_reports_both_sides_and_the_grammars_share(engine):
    from pipelines.bench.structured_outputs import format_structured, run_structured_bench

    report = run_structured_bench(engine, concurrency=(2,), new_tokens=4, repeats=1)
    [row] = report["rows"]
    assert row["concurrency"] == 2 and row["free_tok_s"] > 0 and row["json_schema_tok_s"] > 0
    assert report["grammar_host_ms_per_token"] > 0 and 0 < row["grammar_share_of_free_step"]
    assert "| json_schema / free |" in format_structured(report)


def test_the_grammar_library_bench_sorts_every_feature(engine):
    from pipelines.bench.grammar_libraries import FEATURES, SCHEMAS, run_grammar_library_bench

    info = engine.backend.info
    xgr, llg = run_grammar_library_bench(engine.tokenizer, info.vocab_size, sorted(info.eos_token_ids))
    for result in (xgr, llg):
        assert set(result.compile_ms) == set(SCHEMAS) and set(result.features) == set(FEATURES)
        assert all(v > 0 for v in result.mask_us_per_step.values())
        assert result.features["minLength/maxLength"] == "enforced"  # positive control of the probe
    assert llg.features["uniqueItems"].startswith("refused") and "uniqueItems" in llg.features["uniqueItems"]
