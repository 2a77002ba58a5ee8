"""Choosing the next tokens: pure functions of logits, parameters and per-request generators.

The filters: banned ids, OpenAI's ``logit_bias`` and presence/frequency penalties (over the
generated tokens), transformers' repetition penalty rule (over the prompt and generated tokens;
both penalties read counts the request keeps, :class:`TokenCounts`), the step's suppressed ids
(stop tokens before ``min_tokens``), a structured request's grammar mask, then transformers'
temperature, top-k and top-p — so top-k/top-p choose among tokens the grammar allows. Randomness comes only from each request's
``torch.Generator``, never from the global RNG, so a seeded request draws the same tokens whatever
else shares its batch.

:func:`sample_rows` serves a whole step: greedy rows share one ``argmax``; each sampling row draws
with its own generator; every chosen id stays on the device until one host read at the end (the
only sync a plain step needs: mods receive the sampled id as a Python int).

Log-probabilities (for streaming clients and ranked candidates) are those of the distribution the
token was drawn from: the processed scores' log-softmax (temperature, top-k and top-p applied and
renormalised). A greedy row reports the log-softmax of its processed logits at temperature 1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["SamplingParams", "SampleRow", "SampleResult", "TokenCounts", "sample", "sample_rows", "make_generator",
           "unpack_mask"]


@dataclass(frozen=True)
class SamplingParams:
    """``temperature = 0``: greedy. ``top_k = 0`` / ``top_p = 1``: filter off. ``banned``: ids that
    are never drawn. ``repetition_penalty``: transformers' rule (1.0 = off). ``logit_bias``:
    ``(id, bias)`` pairs added to the logits. ``presence_penalty``/``frequency_penalty``: OpenAI's
    rule over the generated tokens, ``logit[j] -= frequency * count[j] + presence * (count[j] > 0)``."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    banned: tuple[int, ...] = ()
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_history(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def needs_generated(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain(self) -> bool:
        """Nothing changes the logits before temperature (the greedy fast path's condition)."""
        return not (self.banned or self.logit_bias or self.needs_history or self.needs_generated)


@functools.lru_cache(maxsize=256)
def _warpers(temperature: float, top_k: int, top_p: float):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = LogitsProcessorList()
    if temperature not in (0.0, 1.0):
        chain.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        chain.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p))
    return chain


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def unpack_mask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(M, W)`` int32 packed bitmask -> ``(M, vocab)`` bool, True where the token is allowed
    (bit ``t % 32`` of word ``t // 32``: the layout xgrammar and llguidance both fill)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (M, W, 32)
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _processed(scores: torch.Tensor, params: SamplingParams, history: torch.Tensor | None,
               row: "SampleRow | None" = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``scores (1, V)`` float32 after every filter before temperature (a copy when changed), then
    the warpers unless greedy. ``allowed (V,)`` bool: the row's grammar mask, unpacked."""
    if params.banned:
        scores = scores.clone()
        scores[0, list(params.banned)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=scores.device)
        bias = torch.tensor([b for _, b in params.logit_bias], dtype=scores.dtype, device=scores.device)
        scores = scores.clone()
        scores[0].index_add_(0, ids, bias)
    counts = row.generated if row is not None else None
    if params.needs_generated and counts is not None:
        counts = counts.to(scores.dtype)  # (V,)
        scores = scores - (params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(scores.dtype))
    if params.needs_history and history is not None:
        # transformers' RepetitionPenaltyLogitsProcessor over the tokens present so far: a token
        # seen before has its logit divided by the penalty, or multiplied when negative
        penalty = params.repetition_penalty
        seen = (history > 0)[None, :]
        scores = torch.where(seen, torch.where(scores < 0, scores * penalty, scores / penalty), scores)
    if row is not None and row.suppress:
        scores = scores.clone()
        scores[0, list(row.suppress)] = float("-inf")
    if allowed is not None:
        scores = scores.masked_fill(~allowed[None, :], float("-inf"))
    if params.greedy:
        return scores
    return _warpers(params.temperature, params.top_k, params.top_p)(None, scores)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from ``logits`` ``(V,)`` or ``(1, V)`` (one host read)."""
    return sample_rows([SampleRow(logits, params, generator)])[0].token


class TokenCounts:
    """How often each id occurs in a token sequence, as a ``(V,)`` float32 tensor on the logits'
    device, kept up to date as tokens join and leave. The penalties read it every step; counting
    the whole sequence again each step would make a request's per-step work grow with its length.
    Ids outside ``[0, V)`` have no logit to penalise and are not counted."""

    def __init__(self, tokens: Sequence[int], vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.add(tokens)

    def add(self, tokens: Sequence[int]) -> None:
        self._shift(tokens, 1.0)

    def remove(self, tokens: Sequence[int]) -> None:
        self._shift(tokens, -1.0)

    def _shift(self, tokens: Sequence[int], by: float) -> None:
        ids = [t for t in tokens if 0 <= t < self.vocab]
        if ids:
            self.counts.index_add_(0, torch.tensor(ids, dtype=torch.long, device=self.device),
                                   torch.full((len(ids),), by, dtype=torch.float32, device=self.device))


@dataclass(frozen=True)
class SampleRow:
    logits: torch.Tensor  # (V,) or (1, V)
    params: SamplingParams
    generator: torch.Generator
    history: torch.Tensor | None = None  # (V,) counts of the request's tokens so far (repetition penalty)
    logprobs: int = -1  # -1: none; 0: the chosen token's; k > 0: also the k most likely
    generated: torch.Tensor | None = None  # (V,) counts of the generated tokens (presence/frequency penalties)
    suppress: tuple[int, ...] = ()  # ids not drawn this step (stop tokens before min_tokens)
    mask: torch.Tensor | None = None  # (ceil(V/32),) int32 packed: the tokens a grammar allows next

    @property
    def plain(self) -> bool:
        """Greedy with nothing to apply: served by the batch's one argmax."""
        return (self.params.greedy and self.params.plain and not self.suppress and self.mask is None
                and self.logprobs < 0)


@dataclass(frozen=True)
class SampleResult:
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None


def _host_read(*tensors: torch.Tensor) -> list[list[Any]]:
    """``[t.tolist() for t in tensors]`` in one wait for the device, with the GIL released: while
    the step's forward runs, other threads (results being built, HTTP handlers, Ray) get the
    interpreter."""
    if tensors and tensors[0].device.type == "cuda":
        hosts = [t.to("cpu", non_blocking=True) for t in tensors]  # into pinned memory
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # releases the GIL while it waits
        return [h.tolist() for h in hosts]
    return [t.tolist() for t in tensors]


def sample_rows(rows: Sequence[SampleRow]) -> list[SampleResult]:
    """One token per row; ids and asked-for log-probs reach the host in one read (log-probs of all
    rows that ask are computed as one batch on the device)."""
    chosen: list[torch.Tensor] = [None] * len(rows)  # type: ignore[list-item]
    scores: list[torch.Tensor | None] = [None] * len(rows)
    plain_greedy = [i for i, r in enumerate(rows) if r.plain]
    if plain_greedy:
        stacked = torch.stack([rows[i].logits.reshape(-1) for i in plain_greedy])  # (G, V)
        ids = torch.argmax(stacked, dim=-1)
        for j, i in enumerate(plain_greedy):
            chosen[i] = ids[j]
    masked = [i for i, r in enumerate(rows) if r.mask is not None]
    allowed: dict[int, torch.Tensor] = {}
    if masked:  # every grammar row's mask unpacked in one batch: (M, W) int32 -> (M, V) bool
        device, vocab = rows[masked[0]].logits.device, rows[masked[0]].logits.shape[-1]
        packed = torch.stack([rows[i].mask.reshape(-1) for i in masked])  # type: ignore[union-attr]
        unpacked = unpack_mask(packed.to(device), vocab)
        allowed = {i: unpacked[j] for j, i in enumerate(masked)}
    for i, row in enumerate(rows):
        if chosen[i] is not None:
            continue
        s = _processed(row.logits.reshape(1, -1).float(), row.params, row.history, row, allowed.get(i))  # (1, V)
        scores[i] = s
        if row.params.greedy:
            chosen[i] = torch.argmax(s, dim=-1)[0]
        else:
            probs = torch.softmax(s, dim=-1)
            chosen[i] = torch.multinomial(probs, num_samples=1, generator=row.generator)[0, 0]
    ids = torch.stack(chosen)  # (B,)
    asking = [i for i, r in enumerate(rows) if r.logprobs >= 0]
    if not asking:
        (tokens,) = _host_read(ids)  # the step's one host read
        return [SampleResult(int(t)) for t in tokens]
    logp = torch.log_softmax(torch.cat([scores[i] for i in asking]), dim=-1)  # type: ignore[misc]  # (N, V)
    picked = logp.gather(1, ids[asking].unsqueeze(1))[:, 0]  # (N,)
    k = min(max(rows[i].logprobs for i in asking), logp.shape[-1])
    top_v, top_i = logp.topk(k, dim=-1) if k > 0 else (picked[:, None], ids[asking][:, None])  # (N, k)
    tokens, picked_h, top_vh, top_ih = _host_read(ids, picked, top_v, top_i)  # the step's one host read
    where = {i: j for j, i in enumerate(asking)}
    results = []
    for i, row in enumerate(rows):
        if row.logprobs < 0:
            results.append(SampleResult(int(tokens[i])))
            continue
        j = where[i]
        top = tuple(zip(top_ih[j][:row.logprobs], top_vh[j][:row.logprobs])) if row.logprobs > 0 else None
        results.append(SampleResult(int(tokens[i]), float(picked_h[j]), top))
    return results
