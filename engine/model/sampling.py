"""Choosing the next tokens: pure functions of logits, parameters and per-request generators.

The filters: banned ids, OpenAI's ``logit_bias`` and presence/frequency penalties (over the
generated tokens), transformers' repetition penalty rule (over the prompt and generated tokens;
both penalties read counts the request keeps, :class:`TokenCounts`), the step's suppressed ids
(stop tokens before ``min_tokens``), a structured request's grammar mask, then transformers'
temperature, top-k and top-p — so top-k/top-p choose among tokens the grammar allows. Randomness comes only from each request's
``torch.Generator``, never from the global RNG, so a seeded request draws the same tokens whatever
else shares its batch.

:func:`sample_rows` serves a whole step as a batch: greedy rows share one ``argmax``; every filter
is one op over the rows it applies to; each sampling row draws with its own generator; every
chosen id stays on the device until one host read at the end (the only sync a plain step needs:
mods receive the sampled id as a Python int).

Log-probabilities (for streaming clients and ranked candidates) are those of the distribution the
token was drawn from: the processed scores' log-softmax (temperature, top-k and top-p applied and
renormalised). A greedy row reports the log-softmax of its processed logits at temperature 1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine.model.vocab_search import first_max_ids, row_max

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
    """One row to draw from: ``logits (V,)`` or ``(1, V)``, or ``source`` — ``(logits (B, V) of a
    whole forward, the row's index)`` — for a row drawn from a batch's own logits (no per-row
    view or copy until a filter must change them)."""

    logits: torch.Tensor | None
    params: SamplingParams
    generator: torch.Generator
    history: torch.Tensor | None = None  # (V,) counts of the request's tokens so far (repetition penalty)
    logprobs: int = -1  # -1: none; 0: the chosen token's; k > 0: also the k most likely
    generated: torch.Tensor | None = None  # (V,) counts of the generated tokens (presence/frequency penalties)
    suppress: tuple[int, ...] = ()  # ids not drawn this step (stop tokens before min_tokens)
    mask: torch.Tensor | None = None  # (ceil(V/32),) int32 packed: the tokens a grammar allows next
    source: tuple[torch.Tensor, int] | None = None
    # (values (B, k), ids (B, k)) of the source's logits, sorted, when the forward computed them
    # (what payloads record): a plain greedy row's token is then its first id, not a new argmax
    top: tuple[torch.Tensor, torch.Tensor] | None = None
    argmax: torch.Tensor | int | None = None  # the logits' argmax (an int or 0-d) when already known (a mod's AdjustedLogits)

    @property
    def plain(self) -> bool:
        """Greedy with nothing to apply: served by the batch's one argmax."""
        return (self.params.greedy and self.params.plain and not self.suppress and self.mask is None
                and self.logprobs < 0)

    def row_logits(self) -> torch.Tensor:
        """``(V,)``: this row's logits."""
        if self.logits is not None:
            return self.logits.reshape(-1)
        batch, index = self.source  # type: ignore[misc]
        return batch[index]


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


def _gather(rows: Sequence[SampleRow], which: Sequence[int]) -> torch.Tensor:
    """``(len(which), V)`` float32: the logits of those rows, in that order — one ``index_select``
    for rows of one batch's logits (the whole batch itself when they are all of it, in order),
    a stack for rows of their own."""
    sources = {id(source[0]) for i in which if (source := rows[i].source) is not None}
    if len(sources) == 1 and all(rows[i].source is not None for i in which):
        batch = rows[which[0]].source[0]  # type: ignore[index]
        indices = [rows[i].source[1] for i in which]  # type: ignore[index]
        if indices == list(range(batch.shape[0])):
            return batch.float()
        return batch.index_select(0, torch.tensor(indices, device=batch.device)).float()
    return torch.stack([rows[i].row_logits() for i in which]).float()


def _argmax(rows: Sequence[SampleRow], which: Sequence[int]) -> torch.Tensor:
    """``(len(which),)`` each row's argmax. A row that knows it (a mod's adjusted logits, checked
    in one pass that found it) takes it; rows of one CPU batch whose forward computed its top
    log-probs take the best of them (no pass over the vocabulary); a row whose two best are
    equal is searched and takes ``argmax``'s choice (the first such id), as :func:`torch.topk`
    orders ties freely.
    Only the rows left (logits of their own, such as a prompt fed in chunks and joined) are read
    whole: one such row among many costs one row's pass, not every row's."""
    known = [i for i in which if rows[i].argmax is not None]
    if known:
        given = [rows[i].argmax for i in known]
        device = rows[known[0]].row_logits().device  # every known row's logits are on the engine's device
        out = (torch.tensor(given, device=device) if all(isinstance(a, int) for a in given)
               else torch.stack([torch.as_tensor(a, device=device) for a in given]))  # ints and 0-d tensors mixed
        rest = [i for i in which if rows[i].argmax is None]
        return _merged(which, [(known, out), (rest, _argmax(rows, rest))]) if rest else out
    batch = next((rows[i].source[0] for i in which  # type: ignore[index]
                  if rows[i].top is not None and rows[i].source is not None), None)
    ranked = [] if batch is None or batch.device.type != "cpu" else \
        [i for i in which if rows[i].top is not None and (source := rows[i].source) is not None and source[0] is batch]
    if not ranked:
        return row_max(_gather(rows, which))[1]
    if len(ranked) < len(which):
        taken = set(ranked)
        rest = [i for i in which if i not in taken]
        return _merged(which, [(ranked, _argmax_from_top(rows, ranked)), (rest, row_max(_gather(rows, rest))[1])])
    return _argmax_from_top(rows, which)


def _argmax_from_top(rows: Sequence[SampleRow], which: Sequence[int]) -> torch.Tensor:
    """The argmax of rows of one CPU batch whose forward computed its top log-probs, read off them
    (a tied row searched whole: :func:`first_max_ids`)."""
    batch = rows[which[0]].source[0]  # type: ignore[index]
    return torch.tensor(first_max_ids(batch, rows[which[0]].top, [rows[i].source[1] for i in which]))  # type: ignore[index]


def _merged(which: Sequence[int], parts: Sequence[tuple[Sequence[int], torch.Tensor]]) -> torch.Tensor:
    """The ids of ``parts`` (row positions, their ids), each a subset of ``which``, in ``which``'s order."""
    device = parts[0][1].device
    chosen = torch.empty(len(which), dtype=torch.long, device=device)
    position = {i: j for j, i in enumerate(which)}
    for members, ids in parts:
        chosen[[position[i] for i in members]] = ids.to(device)
    return chosen


def _pairs(rows: Sequence[SampleRow], which: Sequence[int], ids_of) -> tuple[list[int], list[int]]:
    """``(row positions, token ids)`` of every ``ids_of(row)`` entry, for one indexed write."""
    at, ids = [], []
    for j, i in enumerate(which):
        for t in ids_of(rows[i]):
            at.append(j)
            ids.append(t)
    return at, ids


def _filters(scores: torch.Tensor, rows: Sequence[SampleRow], which: Sequence[int]) -> torch.Tensor:
    """Every filter before temperature, applied to ``scores (M, V)`` (the rows ``which``) in
    place, in the module docstring's order, each as one batched op."""
    device = scores.device
    at, ids = _pairs(rows, which, lambda r: r.params.banned)
    if at:
        scores[at, ids] = float("-inf")
    biased = [(j, i) for j, i in enumerate(which) if rows[i].params.logit_bias]
    if biased:
        at = [j for j, i in biased for _ in rows[i].params.logit_bias]
        ids = [t for _, i in biased for t, _ in rows[i].params.logit_bias]
        bias = torch.tensor([b for _, i in biased for _, b in rows[i].params.logit_bias], dtype=scores.dtype,
                            device=device)
        scores.index_put_((torch.tensor(at, device=device), torch.tensor(ids, device=device)), bias,
                          accumulate=True)
    counted = [(j, rows[i]) for j, i in enumerate(which) if rows[i].params.needs_generated and rows[i].generated is not None]
    if counted:
        at_t = torch.tensor([j for j, _ in counted], device=device)
        counts = torch.stack([r.generated for _, r in counted]).to(scores.dtype)  # (C, V)
        frequency = torch.tensor([r.params.frequency_penalty for _, r in counted], dtype=scores.dtype, device=device)
        presence = torch.tensor([r.params.presence_penalty for _, r in counted], dtype=scores.dtype, device=device)
        scores[at_t] = scores[at_t] - (frequency[:, None] * counts + presence[:, None] * (counts > 0).to(scores.dtype))
    repeated = [(j, rows[i]) for j, i in enumerate(which) if rows[i].params.needs_history and rows[i].history is not None]
    if repeated:
        # transformers' RepetitionPenaltyLogitsProcessor over the tokens present so far: a token
        # seen before has its logit divided by the penalty, or multiplied when negative
        at_t = torch.tensor([j for j, _ in repeated], device=device)
        seen = torch.stack([r.history for _, r in repeated]) > 0  # (R, V)
        penalty = torch.tensor([r.params.repetition_penalty for _, r in repeated], dtype=scores.dtype,
                               device=device)[:, None]
        part = scores[at_t]
        scores[at_t] = torch.where(seen, torch.where(part < 0, part * penalty, part / penalty), part)
    at, ids = _pairs(rows, which, lambda r: r.suppress)
    if at:
        scores[at, ids] = float("-inf")
    masked = [(j, rows[i]) for j, i in enumerate(which) if rows[i].mask is not None]
    if masked:  # every grammar row's mask unpacked in one batch: (M, W) int32 -> (M, V) bool
        packed = torch.stack([r.mask.reshape(-1) for _, r in masked]).to(device)  # type: ignore[union-attr]
        allowed = unpack_mask(packed, scores.shape[-1])
        at_t = torch.tensor([j for j, _ in masked], device=device)
        scores[at_t] = scores[at_t].masked_fill(~allowed, float("-inf"))
    return scores


def sample_rows(rows: Sequence[SampleRow]) -> list[SampleResult]:
    """One token per row, the whole batch at once: plain greedy rows share one ``argmax`` over
    their logits (no copy when they are a whole forward's rows); the others are gathered once
    and every filter is one batched op over them; rows drawing at random (each with its own
    generator) are warped in groups of equal temperature, top-k and top-p. Ids and asked-for
    log-probs reach the host in one read. Each row gets what it would get drawn alone."""
    n = len(rows)
    plain = [i for i, r in enumerate(rows) if r.plain]
    parts: list[tuple[list[int], torch.Tensor]] = []  # (row positions, their ids on device)
    if plain:
        parts.append((plain, _argmax(rows, plain)))
    rest = [i for i in range(n) if not rows[i].plain]
    asking: list[int] = []
    logp = None
    if rest:
        scores = _filters(_gather(rows, rest).clone(), rows, rest)  # (M, V): our copy, changed in place
        greedy = [j for j, i in enumerate(rest) if rows[i].params.greedy]
        if greedy:
            parts.append(([rest[j] for j in greedy], row_max(scores[greedy])[1]))
        drawing = [j for j, i in enumerate(rest) if not rows[i].params.greedy]
        groups: dict[tuple[float, int, float], list[int]] = {}
        for j in drawing:
            p = rows[rest[j]].params
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(j)
        for (temperature, top_k, top_p), members in groups.items():
            index = torch.tensor(members, device=scores.device)
            warped = _warpers(temperature, top_k, top_p)(None, scores.index_select(0, index))
            scores[index] = warped
            probs = torch.softmax(warped, dim=-1)
            drawn = [torch.multinomial(probs[k:k + 1], num_samples=1, generator=rows[rest[j]].generator)[0, 0]
                     for k, j in enumerate(members)]
            parts.append(([rest[j] for j in members], torch.stack(drawn)))
        asking_j = [j for j, i in enumerate(rest) if rows[i].logprobs >= 0]
        asking = [rest[j] for j in asking_j]
        if asking_j:
            logp = torch.log_softmax(scores[asking_j], dim=-1)  # (N, V)
    device = parts[0][1].device
    ids = torch.empty(n, dtype=torch.long, device=device)
    for where, values in parts:
        ids[torch.tensor(where, device=device)] = values
    if not asking:
        (tokens,) = _host_read(ids)  # the step's one host read
        return [SampleResult(int(t)) for t in tokens]
    picked = logp.gather(1, ids[asking].unsqueeze(1))[:, 0]  # type: ignore[union-attr]  # (N,)
    k = min(max(rows[i].logprobs for i in asking), logp.shape[-1])  # type: ignore[union-attr]
    top_v, top_i = logp.topk(k, dim=-1) if k > 0 else (picked[:, None], ids[asking][:, None])  # type: ignore[union-attr]
    tokens, picked_h, top_vh, top_ih = _host_read(ids, picked, top_v, top_i)  # the step's one host read
    position = {i: j for j, i in enumerate(asking)}
    results = []
    for i, row in enumerate(rows):
        if row.logprobs < 0:
            results.append(SampleResult(int(tokens[i])))
            continue
        j = position[i]
        top = tuple(zip(top_ih[j][:row.logprobs], top_vh[j][:row.logprobs])) if row.logprobs > 0 else None
        results.append(SampleResult(int(tokens[i]), float(picked_h[j]), top))
    return results
