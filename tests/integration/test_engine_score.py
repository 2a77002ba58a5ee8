"""``Engine.score``: each token's log-prob given the tokens before it, from one fresh forward beside
the step loop, against a forward of the reference model done here with transformers directly."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ContextOverflowError, InvalidRequestError, TokenOutOfVocabularyError

pytestmark = pytest.mark.slow

TEXT = "Water boils at one hundred degrees Celsius at sea level."


def test_scores_equal_an_independent_forward(engine):
    ids = engine.tokenizer(TEXT)["input_ids"]
    scores = engine.score(ids, top_k=4)
    with torch.no_grad():
        logits = engine.backend.reference_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)  # (T, V)
    assert scores.token_ids == tuple(ids) and scores.logprobs[0] is None and scores.top[0] == ()
    expected = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert list(scores.logprobs[1:]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for i in range(1, len(ids)):
        values, best = logp[i - 1].topk(4)
        assert [t for t, _ in scores.top[i]] == best.tolist()
        assert [v for _, v in scores.top[i]] == pytest.approx(values.tolist(), rel=1e-5, abs=1e-6)
    assert all(len(row) == 0 for row in engine.score(ids).top)  # top_k 0: no alternatives


def test_scoring_beside_a_running_generation_leaves_it_unchanged(engine):
    baseline = engine.generate(TEXT, max_tokens=12, temperature=0)
    handle = engine.submit(TEXT, max_tokens=12, temperature=0)
    ids = engine.tokenizer(TEXT)["input_ids"]
    scored = [engine.score(ids) for _ in range(3)]  # while the step loop runs the request
    assert handle.result(timeout=300).output_ids == baseline.output_ids
    assert scored[0] == scored[1] == scored[2]


@pytest.mark.parametrize("ids, top_k, error", [
    ([], 0, InvalidRequestError),
    ([1, 10**9], 0, TokenOutOfVocabularyError),
    ([1, 2], 21, InvalidRequestError),
    ([1, 2], True, InvalidRequestError),
    ([1] * 9000, 0, ContextOverflowError),
])
def test_bad_input_is_a_typed_error(engine, ids, top_k, error):
    with pytest.raises(error):
        engine.score(ids, top_k=top_k)
