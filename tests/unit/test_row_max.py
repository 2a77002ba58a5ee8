"""row_max: each row's maximum and its first index, as ``max(dim=-1)`` gives them — by numpy's
``argmax`` for a float32 CPU batch, in two ``amax`` stages for other dtypes (the index-tracking
reduction costs twenty times an ``amax``). Every case runs on both paths."""

import pytest
import torch

from engine.model.vocab_search import row_max


# float32 takes numpy's argmax, float64 the two amax stages
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64])


def _same(scores: torch.Tensor) -> None:
    values, indices = row_max(scores)
    assert indices.dtype == torch.long and values.dtype == scores.dtype
    want_values, want_indices = scores.max(dim=-1)
    assert torch.equal(values, want_values)
    assert torch.equal(indices, want_indices), (indices, want_indices)


@DTYPES
@pytest.mark.parametrize("vocab", [49152, 49152 + 77, 1000, 513, 300, 7])
def test_random_rows_match_max(vocab, dtype):
    torch.manual_seed(vocab)
    _same(torch.randn(9, vocab, dtype=dtype))


@DTYPES
def test_ties_take_the_first_maximum_across_chunks_and_the_tail(dtype):
    v = 256 * 8 + 40
    scores = torch.randn(6, v, dtype=dtype)
    scores[0, [700, 300, 1900]] = 50.0  # equal maxima in three chunks: the first (300)
    scores[1, [256 * 8 + 5, 256 * 8 + 30]] = 50.0  # only in the tail, twice: the first of them
    scores[2, [256 * 8 + 5, 1000]] = 50.0  # in a chunk and in the tail: the chunk's comes first
    scores[3, [3, 4, 5]] = 50.0  # adjacent in one chunk
    scores[4] = float("-inf")  # nothing finite: index 0, as max gives it
    scores[5, [10, 11]] = 0.0
    scores[5, 10] = -0.0  # -0.0 == 0.0: the first of them
    scores[5] = torch.where(scores[5] > 0, -scores[5], scores[5])
    _same(scores)


@DTYPES
def test_lone_row_of_a_whole_chunk_vocabulary_and_a_max_at_each_end(dtype):
    scores = torch.randn(2, 256 * 4, dtype=dtype)
    scores[0, 0] = 9.0
    scores[1, -1] = 9.0
    _same(scores)


@DTYPES
def test_nan_and_inf_values_are_reported_for_the_caller_to_refuse(dtype):
    scores = torch.randn(3, 256 * 3, dtype=dtype)
    scores[0, 17] = float("nan")
    scores[1, 600] = float("inf")
    values, indices = row_max(scores)
    assert torch.isnan(values[0]) and values[1] == float("inf") and int(indices[1]) == 600
    assert torch.equal(values[2:], scores[2:].max(dim=-1).values)
    assert torch.equal(indices[2:], scores[2:].max(dim=-1).indices)


def test_a_float32_batch_that_is_a_strided_view_or_needs_grad_is_read_in_place():
    """The numpy path reads the tensor's own memory: a column slice (rows not contiguous) and a
    tensor that requires grad give what ``max`` gives."""
    scores = torch.randn(5, 2000)
    _same(scores[:, 100:1900])
    _same(scores[::2])
    grad = torch.randn(3, 700, requires_grad=True)
    values, indices = row_max(grad)
    want = grad.detach().max(dim=-1)
    assert torch.equal(values, want.values) and torch.equal(indices, want.indices)


# ------------------------------------------------------------------ first_max_ids from the top log-probs


def _first_max(scores: torch.Tensor) -> list[int]:
    return [int(scores[i].numpy().argmax()) for i in range(scores.shape[0])]  # numpy keeps the first


def test_first_max_ids_from_the_top_log_probs_match_a_whole_search_and_search_only_unclear_rows(monkeypatch):
    """A row whose best log-prob is strictly above its second takes its best id; a tie (exact, or
    two scores the log-softmax rounded together), a NaN row and a row with +inf are searched whole
    — and only those rows."""
    import engine.model.vocab_search as vs
    from engine.model.backend import top_logprobs

    torch.manual_seed(0)
    v = 49152 + 77
    scores = torch.randn(8, v) * 4
    scores[1, [900, 30]] = 60.0  # an exact tie: the first id, 30, though topk may list 900 first
    scores[2] = 0.0  # a flat row (log-probs near -log V) with two best one ulp apart: the
    scores[2, 7] = 1.0  # log-softmax rounds them to one log-prob, and the row is searched
    scores[2, 400] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    scores[3, 5] = float("nan")
    scores[4, 6] = float("inf")
    scores[5] = float("-inf")
    scores[5, 123] = -3.0  # one finite score
    scores[6, v - 1] = 80.0  # in the tail past the last whole chunk
    top = top_logprobs(scores)
    assert top[0][2, 0] == top[0][2, 1] and top[1][2, 0] == 400  # (the case: topk lists 400 first)
    searched: list[int] = []
    real = vs.row_max
    monkeypatch.setattr(vs, "row_max", lambda s: (searched.append(s.shape[0]), real(s))[1])
    got = vs.first_max_ids(scores, top)
    assert got[:3] + got[4:] == _first_max(scores[:3]) + _first_max(scores[4:])
    assert got[1] == 30 and got[2] == 7 and got[4] == 6 and got[5] == 123 and got[6] == v - 1
    assert searched == [4]  # rows 1, 2, 3 and 4, in one search; the other four from the top
    assert isinstance(got[0], int)


def test_first_max_ids_without_a_usable_top_search_every_row():
    from engine.model.backend import top_logprobs
    from engine.model.vocab_search import first_max_ids

    torch.manual_seed(1)
    scores = torch.randn(3, 1000)
    want = _first_max(scores)
    assert first_max_ids(scores) == want
    assert first_max_ids(scores, top_logprobs(scores, k=1)) == want  # one log-prob a row: no second to compare
    assert first_max_ids(scores, top_logprobs(scores[:2])) == want  # not this batch's rows
