"""Choosing the next token: a pure function of logits, parameters and a per-request generator.

The filters are transformers' own warpers (temperature, then top-k, then top-p — the order
``generate`` applies them in). Randomness comes only from the request's ``torch.Generator``,
never from the global RNG, so concurrent requests stay reproducible under their seeds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "sample", "make_generator"]


@dataclass(frozen=True)
class SamplingParams:
    """``temperature = 0``: greedy. ``top_k = 0`` / ``top_p = 1``: filter off."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@functools.lru_cache(maxsize=64)
def _warpers(params: SamplingParams):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = LogitsProcessorList()
    if params.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopPLogitsWarper(params.top_p))
    return chain


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from ``logits`` ``(V,)`` or ``(1, V)``.

    ``int(...)`` synchronises with the device once per token; unavoidable, since mods receive
    the sampled id as a Python int.
    """
    scores = logits.reshape(1, -1)
    if params.greedy:
        return int(torch.argmax(scores, dim=-1))
    scores = _warpers(params)(None, scores.float())
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=generator))
