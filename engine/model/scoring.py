"""Scoring a token sequence: each token's log-probability given the tokens before it, in one forward.

What generation reports is the log-prob of each *generated* token under the distribution it was
drawn from; a prompt's own tokens are never sampled, so their log-probs need the model's logits at
every prompt position. That is one fresh forward pass over the whole sequence (no KV cache, no
batch slot: like embeddings and captures it runs beside the step loop, never inside it), read as
``log_softmax(logits[i - 1])[token_i]`` — the model's own distribution, no temperature, top-k or
top-p. The first token has nothing before it, so it has no log-prob (``None``, as OpenAI's legacy
completions report it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine.errors import InvalidRequestError
from engine.model.named_capture import check_input_ids

__all__ = ["SequenceScores", "score", "score_positions", "MAX_SCORE_TOP_K"]

MAX_SCORE_TOP_K = 20
_CHUNK = 256  # positions whose vocabulary-wide log-softmax is held at once: (256, vocab) float32


@dataclass(frozen=True)
class SequenceScores:
    """Per-position scores of ``token_ids`` (length T).

    ``logprobs[i]``: log p(token_i | token_0..i-1); ``logprobs[0]`` is None. ``top[i]``: the
    ``top_k`` most likely ``(id, logprob)`` at position ``i`` (the distribution ``token_i`` was
    scored under), best first; ``top[0]`` is ``()``. Plain Python data: crosses Ray unchanged.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


def score(model: Any, token_ids: Sequence[int], *, top_k: int = 0) -> SequenceScores:
    """One fresh forward of ``model`` (a transformers causal LM) over ``token_ids``; see the module
    docstring. ``top_k`` in ``[0, MAX_SCORE_TOP_K]``: alternatives per position."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_SCORE_TOP_K:
        raise InvalidRequestError(f"`top_k` must be an integer in [0, {MAX_SCORE_TOP_K}], got {top_k!r}",
                                  parameter="top_k", value=top_k)
    ids = check_input_ids(model, token_ids)
    device = next(model.parameters()).device
    tensor = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    with torch.inference_mode():
        logits = model(input_ids=tensor, use_cache=False).logits[0]  # (T, V)
    targets = tensor[0, 1:]  # (T - 1,): token i + 1 is scored by position i's logits
    chosen: list[float] = []
    top: list[tuple[tuple[int, float], ...]] = [()]
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, _CHUNK):
            stop = min(start + _CHUNK, len(ids) - 1)
            logp = torch.log_softmax(logits[start:stop].float(), dim=-1)  # (C, V)
            chosen.extend(logp.gather(1, targets[start:stop, None])[:, 0].tolist())
            if top_k:
                values, indices = logp.topk(top_k, dim=-1)  # (C, k)
                top.extend(tuple(zip(row_ids, row_values)) for row_ids, row_values
                           in zip(indices.tolist(), values.tolist()))
            else:
                top.extend(() for _ in range(stop - start))
    return SequenceScores(tuple(ids), (None, *chosen), tuple(top))


def score_positions(logits: torch.Tensor, targets: Sequence[int], top_k: int) -> Any:
    """``logits (q, V)`` of a fed chunk's positions → a :class:`~engine.model.backend.TokenScores`
    of ``targets`` (the token after each position; at most ``q``), in ``_CHUNK`` positions of
    vocabulary-wide log-softmax at a time."""
    from engine.model.backend import TokenScores

    n = len(targets)
    chosen: list[float] = []
    top: list[tuple[tuple[int, float], ...]] = []
    wanted = torch.tensor(list(targets), dtype=torch.long, device=logits.device)
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        logp = torch.log_softmax(logits[start:stop].float(), dim=-1)  # (C, V)
        chosen.extend(logp.gather(1, wanted[start:stop, None])[:, 0].tolist())
        if top_k:
            values, indices = logp.topk(top_k, dim=-1)  # (C, k)
            top.extend(tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(indices.tolist(), values.tolist()))
        else:
            top.extend(() for _ in range(stop - start))
    return TokenScores(tuple(chosen), tuple(top))
