"""Ranked candidates: n sampled completions of one prompt, best first by summed log-probability.

A prover's policy (or any search over completions) samples n continuations and ranks them by how
likely the sampling distribution made them. All n run as one batch through the step loop (n rows
of one step, each with its own generator seeded ``seed + i``), so n = 8 costs about one request's
steps, not eight.

``token_ids`` are the tokens the model read after the prompt, a stop token it sampled included
(as vLLM's outputs include it): ending there is part of the choice. ``text`` is the answer's text
(without the stop token). ``log_prob`` is the sum, over exactly ``token_ids``, of each token's
log-probability under the distribution it was drawn from: temperature, top-k and top-p applied
and renormalised — with temperature 1 and no truncation, the model's own log-softmax. Tokens a mod
forced carry no sampling probability and add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from engine.config import choice_seed
from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.core.inputs import GenerationRequest
    from engine.engine import Engine

__all__ = ["Candidate", "generate_candidates"]

MAX_CANDIDATES = 256


@dataclass(frozen=True)
class Candidate:
    text: str
    token_ids: list[int]
    log_prob: float
    finish_reason: str


def generate_candidates(engine: "Engine", request: "GenerationRequest", *, n: int,
                        seed: int | None) -> list[Candidate]:
    """``n`` completions of one request, sorted by ``log_prob``, highest first (ties keep
    sampling order); candidate ``i`` is the request seeded ``seed + i`` (modulo 2**64:
    :func:`~engine.config.choice_seed`), id ``<request_id>-i``."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CANDIDATES:
        raise InvalidRequestError(f"`n` must be an integer in [1, {MAX_CANDIDATES}], got {n!r}", parameter="n",
                                  value=n)
    if request.top_logprobs not in (None, 0):
        raise InvalidRequestError("`top_logprobs` is not taken by candidates", parameter="top_logprobs")
    base = request.request_id
    handles = [engine.submit(request.replace(seed=choice_seed(seed, i), top_logprobs=0,
                                             request_id=None if base is None else f"{base}-{i}"))
               for i in range(n)]
    out = []
    for handle in handles:
        result = handle.result()
        scores: Sequence[float | None] = result.token_logprobs or []
        # sequence_ids and token_logprobs are aligned: one entry per token read, the stop token included
        out.append(Candidate(result.output_text, list(result.sequence_ids),
                             float(sum(lp for lp in scores if lp is not None)), str(result.finish_reason)))
    order = sorted(range(n), key=lambda i: -out[i].log_prob)
    return [out[i] for i in order]
