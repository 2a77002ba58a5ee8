"""Ranked candidates on the embedded model, checked against an independent transformers forward."""

from __future__ import annotations

import pytest
import torch

LOGPROB_TOL = 2e-3  # float32 noise between a batched step and one full forward, summed over tokens

PROMPT = "Give me a word that rhymes with cat."


def _model_logprob(engine, prompt_ids, token_ids):
    """Sum of log-softmax(logits) of ``token_ids`` after ``prompt_ids``: one plain forward."""
    with torch.inference_mode():
        logits = engine.backend.reference_model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids)
    return sum(float(logp[start - 1 + i, t]) for i, t in enumerate(token_ids))


def test_candidates_are_ranked_by_the_models_own_log_probability(engine):
    prompt_ids = engine.encode(PROMPT)
    cands = engine.candidates(input_ids=prompt_ids, n=6, temperature=1.0, top_p=1.0, top_k=0, max_tokens=6,
                              seed=0, ignore_eos=True)
    assert len(cands) == 6
    assert [c.log_prob for c in cands] == sorted((c.log_prob for c in cands), reverse=True)
    assert len({tuple(c.token_ids) for c in cands}) > 1, "positive control: the samples should differ"
    for cand in cands:
        reference = _model_logprob(engine, prompt_ids, cand.token_ids)
        assert abs(cand.log_prob - reference) < LOGPROB_TOL, (
            f"candidate {cand.text!r}: log_prob {cand.log_prob:.5f} vs an independent forward {reference:.5f}")
        assert cand.text == engine.tokenizer.decode(cand.token_ids, skip_special_tokens=True)


def test_log_prob_covers_exactly_token_ids_the_stop_token_included(engine):
    prompt_ids = engine.encode(PROMPT)
    free = engine.candidates(input_ids=prompt_ids, n=4, temperature=1.0, top_p=1.0, top_k=0, max_tokens=6,
                             seed=0, ignore_eos=True)
    # a stop token the seeded sampling reaches mid-answer: the same seeds stop there on the next run
    ref = next(c.token_ids for c in free if c.token_ids[2] not in c.token_ids[:2])
    stopped = engine.candidates(input_ids=prompt_ids, n=4, temperature=1.0, top_p=1.0, top_k=0, max_tokens=6,
                                seed=0, ignore_eos=True, stop_tokens=[ref[2]])
    cand = next(c for c in stopped if c.token_ids[:3] == ref[:3])  # positive control: it stopped there
    assert cand.finish_reason == "stop" and cand.token_ids == ref[:3], cand
    assert cand.text == engine.tokenizer.decode(ref[:2], skip_special_tokens=True)  # text: without the stop token
    reference = _model_logprob(engine, prompt_ids, cand.token_ids)
    assert abs(cand.log_prob - reference) < LOGPROB_TOL, (cand.log_prob, reference)
    without_stop = _model_logprob(engine, prompt_ids, cand.token_ids[:-1])
    assert abs(cand.log_prob - without_stop) > 10 * LOGPROB_TOL, "the stop token's log-prob must be counted"


def test_truncated_sampling_scores_under_the_renormalised_distribution(engine):
    prompt_ids = engine.encode(PROMPT)
    cands = engine.candidates(input_ids=prompt_ids, n=4, temperature=0.8, top_k=5, top_p=1.0, max_tokens=5,
                              seed=3, ignore_eos=True)
    with torch.inference_mode():
        for cand in cands:
            logits = engine.backend.reference_model(torch.tensor([prompt_ids + cand.token_ids])).logits[0].float()
            total = 0.0
            for i, token in enumerate(cand.token_ids):
                scores = logits[len(prompt_ids) - 1 + i] / 0.8
                kth = scores.topk(5).values[-1]
                scores = scores.masked_fill(scores < kth, float("-inf"))
                total += float(torch.log_softmax(scores, dim=-1)[token])
            assert abs(cand.log_prob - total) < LOGPROB_TOL, (cand.log_prob, total)
            # the truncated distribution gives each kept token more mass than the full one
            assert cand.log_prob >= _model_logprob(engine, prompt_ids, cand.token_ids) - LOGPROB_TOL


def test_candidates_are_reproducible_and_ran_as_one_batch(engine):
    before = engine.loop.stats.steps
    a = engine.candidates(PROMPT, n=4, temperature=0.9, max_tokens=5, seed=11, ignore_eos=True)
    steps = engine.loop.stats.steps - before
    b = engine.candidates(PROMPT, n=4, temperature=0.9, max_tokens=5, seed=11, ignore_eos=True)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    # one at a time, 4 candidates of 5 tokens take at least 20 steps; as one batch about 5
    assert steps < 4 * 5, f"{steps} steps for 4 candidates of 5 tokens: they did not share steps"


def test_bad_n_is_a_clear_error(engine):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="`n` must be an integer"):
        engine.candidates(PROMPT, n=0)


def test_the_candidates_command_prints_ranked_json(capsys):
    import json

    from pipelines.cli import main

    code = main(["candidates", "--prompt", PROMPT, "-n", "3", "--temperature", "0.8", "--max-tokens", "4", "--json"])
    assert code == 0
    cands = json.loads(capsys.readouterr().out)
    assert len(cands) == 3 and [c["log_prob"] for c in cands] == sorted((c["log_prob"] for c in cands), reverse=True)
    assert all(isinstance(c["token_ids"], list) and c["text"] is not None for c in cands)
