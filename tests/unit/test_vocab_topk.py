"""The forward's top-k log-probs come from an exact two-stage top-k on the CPU: the same values and
ids as one ``topk`` over the whole vocabulary (ties aside, which ``topk`` orders freely too)."""

from __future__ import annotations

import pytest
import torch

from engine.model.backend import top_logprobs, vocab_topk_ids


@pytest.mark.parametrize("vocab", [49_152, 50_257, 128_256, 300])  # whole chunks, a tail, a small vocabulary
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_two_stage_topk_matches_one_topk(vocab, rows):
    generator = torch.Generator().manual_seed(vocab + rows)
    logits = torch.randn(rows, vocab, generator=generator) * 4
    logits[0, -1] = 50.0  # the very last id (in the tail where there is one) is a row's best
    values, ids = top_logprobs(logits)
    expected = torch.log_softmax(logits, dim=-1).topk(20, dim=-1)
    assert torch.equal(ids, expected.indices)
    assert torch.equal(values, expected.values)
    assert ids[0, 0] == vocab - 1


def test_clustered_best_scores_and_ties():
    """The k best all in one chunk, in two, and rows of equal scores: every id returned has its
    rank's value, and the values are topk's."""
    scores = torch.full((4, 49_152), -5.0)
    scores[0, 1000:1020] = torch.arange(20, dtype=torch.float32)  # all twenty in one chunk
    scores[1, ::2457] = 3.0  # twenty-one ids tie for best, spread over chunks
    scores[2, :] = float("-inf")
    scores[2, 77] = 0.0  # one finite score
    scores[3, 256 * 7:256 * 8] = 1.0  # a whole chunk ties
    ids = vocab_topk_ids(scores, 20)
    expected = scores.topk(20, dim=-1).values
    assert torch.equal(scores.gather(1, ids), expected)
    assert ids[0].tolist() == list(range(1019, 999, -1))
    assert ids[2, 0] == 77
    assert len(set(ids[1].tolist())) == 20 and all(i % 2457 == 0 for i in ids[1].tolist())
