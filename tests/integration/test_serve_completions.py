"""``POST /v1/completions`` and ``n > 1`` over a real loopback server, through the ``openai`` client.

References are independent: prompt log-probs against a forward of the backend's reference model
done here with transformers directly; generated text against the in-process engine (same
weights, greedy); choice ``i`` of a seeded ``n``-choice request against a one-choice request
seeded ``seed + i``.
"""

from __future__ import annotations

import pytest

from tests.serve_helpers import mod_payload, openai_client, openai_server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(engine):
    with openai_server(engine, allow_mod_registration=True, max_new_tokens=64, request_timeout_s=120) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server, timeout=120) as c:
        yield c


def reference_logprobs(engine, ids):
    """log p(token_i | tokens before it) for i >= 1, and the log-softmax rows, from the reference
    model run here (not through the engine's scoring code)."""
    import torch

    model = engine.backend.reference_model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))], logp


def test_echo_logprobs_equal_an_independent_forward(client, engine, model_id):
    ids = engine.tokenizer(PROMPT)["input_ids"]
    reply = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    (choice,) = reply.choices
    assert choice.text == PROMPT and reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 0
    lp = choice.logprobs
    expected, logp = reference_logprobs(engine, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before the first token
    assert lp.token_logprobs[1:] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    for i in range(1, len(ids)):
        values, best = logp[i - 1].topk(3)
        assert list(lp.top_logprobs[i].values()) == pytest.approx(values.tolist(), rel=1e-4, abs=1e-5)
        assert list(lp.top_logprobs[i]) == [engine.tokenizer.decode([t]) for t in best.tolist()]
    assert "".join(lp.tokens) == PROMPT
    assert [PROMPT[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens


def test_echoed_tokens_of_multibyte_text_concatenate_to_it(client, engine, model_id):
    text = "Café ☕ naïve 日本語 — ok"
    ids = engine.tokenizer(text)["input_ids"]
    assert len(ids) > len(text.split())  # control: characters here span several byte-level tokens
    for prompt in (text, ids):
        (choice,) = client.completions.create(model=model_id, prompt=prompt, max_tokens=0, echo=True,
                                              logprobs=0).choices
        assert choice.text == text and "".join(choice.logprobs.tokens) == text
        assert len(choice.logprobs.tokens) == len(ids)
        assert [text[o:o + len(t)] for o, t in zip(choice.logprobs.text_offset, choice.logprobs.tokens)] \
            == choice.logprobs.tokens


def test_token_id_prompt_scores_like_the_text(client, engine, model_id):
    ids = engine.tokenizer(PROMPT)["input_ids"]
    by_text = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    by_ids = client.completions.create(model=model_id, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert by_ids.choices[0].text == PROMPT
    assert by_ids.choices[0].logprobs.token_logprobs == by_text.choices[0].logprobs.token_logprobs


def test_greedy_completion_equals_the_engine_and_continues_the_echo(client, engine, model_id):
    ids = engine.tokenizer(PROMPT)["input_ids"]
    expected = engine.generate(input_ids=ids, max_tokens=6, temperature=0)
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0)
    assert plain.choices[0].text == expected.output_text
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == len(expected.output_ids)
    echoed = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                       logprobs=1)
    choice = echoed.choices[0]
    assert choice.text == PROMPT + expected.output_text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + len(expected.output_ids)
    assert [choice.text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    # greedy: each generated token's log-prob is the model's own, as scoring the whole text says
    full = ids + list(expected.output_ids)
    scored, _ = reference_logprobs(engine, full)
    assert lp.token_logprobs[1:] == pytest.approx(scored, rel=1e-3, abs=1e-4)
    for i in range(len(ids), len(full)):  # and it is the best one
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], rel=1e-4, abs=1e-5)


def test_streamed_completion_concatenates_to_the_plain_one(client, model_id):
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[0].choices[0].text == PROMPT  # the echo comes first
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 3, "tokens must arrive one by one"
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_stop_string_cuts_the_completion(client, model_id):
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0)
    text = plain.choices[0].text
    stop = text.split()[1]
    cut = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_prompt_list_owns_index_ranges_and_seeded_choices_are_candidates(client, model_id):
    prompts = ["Once upon a time", "My favourite food is"]
    reply = client.completions.create(model=model_id, prompt=prompts, max_tokens=8, temperature=1.0, n=3, seed=11)
    assert [c.index for c in reply.choices] == list(range(6))
    again = client.completions.create(model=model_id, prompt=prompts, max_tokens=8, temperature=1.0, n=3, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]  # seeded: reproducible
    first = [c.text for c in reply.choices[:3]]
    assert len(set(first)) > 1, "distinct seeds must give distinct choices"
    used = 0
    for p, prompt in enumerate(prompts):
        for i in range(3):  # choice i of prompt p is the one-choice request seeded seed + i
            alone = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=1.0, seed=11 + i)
            assert alone.choices[0].text == reply.choices[3 * p + i].text
            used += alone.usage.completion_tokens
    assert reply.usage.completion_tokens == used  # summed over choices
    assert reply.usage.prompt_tokens == sum(client.completions.create(model=model_id, prompt=p, max_tokens=0,
                                                                      echo=True).usage.prompt_tokens for p in prompts)


def test_chat_n_choices_are_one_seeded_batch(client, model_id):
    messages = [{"role": "user", "content": "Say one word."}]
    reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=1.0, n=3,
                                           seed=3, logprobs=True)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    used = 0
    for i, choice in enumerate(reply.choices):
        alone = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=1.0,
                                               seed=3 + i)
        assert alone.choices[0].message.content == choice.message.content
        assert len(choice.logprobs.content) > 0
        used += alone.usage.completion_tokens
    assert reply.usage.completion_tokens == used  # summed over choices; the prompt counted once
    assert reply.usage.prompt_tokens == alone.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=1.0,
                                                 n=3, seed=3, stream=True))
    for i, choice in enumerate(reply.choices):
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert streamed == choice.message.content
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2]


def test_mod_by_model_suffix_runs_on_completions(client, server, model_id):
    import httpx

    assert httpx.post(f"{server}/v1/mods", json=mod_payload("shout"), timeout=60).status_code == 200
    plain = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=10, temperature=0)
    forced = client.completions.create(model=f"{model_id}/shout", prompt=PROMPT, max_tokens=10, temperature=0)
    assert forced.choices[0].text == " [FORCED]" and plain.choices[0].text != " [FORCED]"
    chunks = list(client.completions.create(model=f"{model_id}/shout", prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True))
    shown = ""
    for chunk in chunks:  # apply the stream's erasures as a client following `removed` would
        (choice,) = chunk.choices
        removed = (choice.model_extra or {}).get("removed", 0)
        if removed:
            shown = ""  # the mod replaced every streamed token
        shown += choice.text
    assert shown == " [FORCED]"


@pytest.mark.parametrize("fields, param", [
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"logprobs": 6}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"logit_bias": {"42": 500}}, "logit_bias[42]"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[10**9]]}, "prompt[0][0]"),
    ({"temperature": -1}, "temperature"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_fields_are_400_naming_the_field(server, model_id, fields, param):
    import httpx

    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 2, **fields}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "must" in error["message"]
    control = httpx.post(f"{server}/v1/completions", json={"model": model_id, "prompt": PROMPT, "max_tokens": 2},
                         timeout=60)
    assert control.status_code == 200


def test_ignore_eos_runs_to_max_tokens(client, engine, model_id):
    messages = [{"role": "user", "content": "Hi!"}]
    natural = client.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0)
    assert natural.choices[0].finish_reason == "stop"  # control: it ends at EOS on its own
    forced = client.chat.completions.create(model=model_id, messages=messages, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 24


def test_health_and_version_still_answer(server):
    import httpx

    assert httpx.get(f"{server}/health").json()["ok"] is True
    assert isinstance(httpx.get(f"{server}/version").json()["version"], str)
