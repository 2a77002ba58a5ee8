"""The units of the jobs the step loop schedules (:mod:`engine.core.jobs`): embeddings, prompt
scoring and named capture, each a generator run on the loop's thread, one unit per ``next()``.

* embeddings: a batch of texts per unit, at most the step's token budget of padded tokens (a text
  longer than the budget is a unit of its own); the model's fresh forwards, no KV cache;
* scoring: the prompt's chunks over KV blocks of its own, reserved from the scheduler's KV manager
  (a prompt waits while the pool has no room, and its blocks go back when it ends, is cancelled or
  times out); each chunk is at most the step's token budget;
* named capture: one fresh forward (its hooks see every internal of it at once).
"""

from __future__ import annotations

from typing import Any, Sequence

from engine.core.jobs import Work
from engine.errors import QueueFullError
from engine.model.backend import ForwardBatch, ForwardRow
from engine.model.scoring import SequenceScores

__all__ = ["embed_work", "score_work", "capture_work"]


def embed_work(loop: Any, batches: Work) -> Work:
    """``batches``: the backend's ``embed_batches`` generator; run as it is, a batch a unit."""
    return (yield from batches)


def score_work(loop: Any, job_id: str, token_ids: Sequence[int], top_k: int) -> Work:
    """Each token's log-prob given the tokens before it (the first: None) and its ``top_k`` best
    alternatives: the prompt fed in chunks of the step's budget over blocks of its own."""
    kv, runner, budget = loop.scheduler.kv, loop.runner, loop.scheduler.max_step_tokens
    ids = [int(t) for t in token_ids]
    if len(ids) > kv.capacity_tokens:
        raise QueueFullError(f"`input_ids` must fit the KV cache's {kv.capacity_tokens} positions to be scored, got "
                             f"{len(ids)}; raise backend.kv_cache_tokens", parameter="input_ids", value=len(ids))
    kv.add(job_id)
    try:
        while not kv.reserve(job_id, len(ids)):  # the pool is reserved by running requests: wait a step
            yield 0
        logprobs: list[float | None] = [None]
        top: list[tuple[tuple[int, float], ...]] = [()]
        position = 0
        while position < len(ids):
            n = min(budget, len(ids) - position)
            chunk = ids[position:position + n]
            table = kv.prepare(job_id, position, n)
            row = ForwardRow(job_id, position, tuple(chunk), table=table, top=False,
                             targets=tuple(ids[position + 1:position + n + 1]), score_top_k=top_k)
            out = runner.execute(ForwardBatch((row,), kv.num_blocks, kv.take_copies())).rows()[0]
            kv.record(job_id, position, chunk, out.captured, False)
            scores = out.scores
            logprobs.extend(scores.logprobs)
            top.extend(scores.top)
            position += n
            yield n
        return SequenceScores(tuple(ids), tuple(logprobs), tuple(top))
    finally:
        kv.remove(job_id)


def capture_work(loop: Any, input_ids: Sequence[int], names: Sequence[str], out: Any) -> Work:
    """One named capture: every internal matching ``names`` of one fresh forward."""
    result = loop.runner.capture(input_ids, names, out=out)
    yield len(input_ids)
    return result
