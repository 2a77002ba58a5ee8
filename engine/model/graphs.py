"""The decode forward on static buffers, captured once per shape as a CUDA graph and replayed.

On a GPU the eager forward is bound by Python and kernel launches, not by the model: an 8B and a
135M model run at the same ~30 tokens/s. A replayed graph launches the whole forward at once.
Graphs need every tensor the forward touches at a fixed address and every shape fixed, so one
:class:`StaticDecode` exists per :class:`GraphKey` — batch bucket (1, 2, 4, …, ``max_batch``),
attended-length bucket (a power of two, at most ``max_sequence``) and the capture plan (which
hidden states and attention patterns the graph writes out):

* inputs are static device tensors updated in place before each replay: token ids ``(B, 1)``,
  positions ``(B, 1)`` and the rows' block tables ``(B, ceil(kv_len / block_size))``; the slots
  written and read and the causal mask are computed from them *inside* the graph, so a Backtrack
  (an earlier position) or a newly allocated block needs no recapture and nothing inside reads
  back to the host;
* rows ``n … B-1`` of a bucket are padding whose tables point at the scratch block no request
  owns (as do the warm-up and capture runs), so padding never touches a live request's cache;
* outputs — logits ``(B, V)``, their top log-probs and ids ``(B, k)``, each captured layer's
  residual stream ``(B, d)``, each captured layer's newest attention row ``(B, heads, L)`` — are
  static too: :meth:`StaticDecode.run`
  copies them out before the next replay can overwrite them. A changed plan selects another graph;
  it never drops a capture.

``capture=False`` runs exactly the same static-buffer code eagerly (the CPU tests' path, and the
fallback when capture is unavailable); prefill and multi-token forced chunks always run eagerly.
``compile=True`` runs that code through ``torch.compile`` (inductor, fixed shapes; the prepacked
GEMMs of :mod:`engine.model.prepack` stay opaque calls in it): fused elementwise work and no
per-op dispatch make a single-stream CPU step faster, but every decode shape compiles once per
machine (kept on disk, :mod:`engine.model.compile_cache`) and is traced again at its first use in
every process, so eager stays the CPU default (README: "The forward on a CPU" has the figures). A
shape whose compile fails decodes eagerly, with identical outputs.

With a paged kernel (:mod:`engine.model.paged_attention`) the graph's attention reads the pool in
place through the static tables, the rows' context lengths computed from the static positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine.model.backend import top_logprobs
from engine.model.capture import CAPTURE_KWARG, AttentionCapture, hidden_states_index
from engine.model.kv_cache import (SCRATCH_BLOCK, BatchCacheView, PagedKVCache, cache_argument, read_slots,
                                   write_slots)
from engine.model.masks import AttentionMasks
from engine.model.paged_attention import PAGED_KWARG, PagedBatch, PagedCacheView, PagedKernel

__all__ = ["GraphKey", "StaticDecode", "batch_bucket", "length_bucket"]

log = logging.getLogger("raylens.graphs")

MIN_LENGTH_BUCKET = 64


def batch_bucket(n: int, max_batch: int) -> int:
    """The smallest power of two ≥ ``n`` (or ``max_batch`` when that is smaller)."""
    bucket = 1
    while bucket < n:
        bucket *= 2
    return min(bucket, max_batch)


def length_bucket(n: int, capacity: int) -> int:
    """The smallest power of two ≥ ``n`` positions, at least :data:`MIN_LENGTH_BUCKET`, at most
    ``capacity`` (the positions one request may use)."""
    bucket = MIN_LENGTH_BUCKET
    while bucket < n:
        bucket *= 2
    return min(bucket, capacity)


@dataclass(frozen=True)
class GraphKey:
    batch: int
    kv_len: int
    hidden_layers: tuple[int, ...]
    attention_layers: tuple[int, ...]


class StaticDecode:
    """Static buffers (and on CUDA the captured graph) of one decode shape."""

    def __init__(self, model: Any, cache: PagedKVCache, key: GraphKey, *, capture: bool, pool: Any = None,
                 compile: bool = False, paged: PagedKernel | None = None) -> None:
        self.model, self.key, self.cache = model, key, cache
        self.masks = AttentionMasks.of(model)  # model families: sliding layers get their own mask
        device = cache.device
        b, length = key.batch, key.kv_len
        self.blocks = -(-length // cache.block_size)
        # one (B, 2 + blocks) buffer, filled by one host→device copy per step: each row's token id,
        # position and block table (all zeros — the scratch block — for warm-up and capture runs)
        self.inputs = torch.full((b, 2 + self.blocks), SCRATCH_BLOCK, dtype=torch.long, device=device)
        self.ids = self.inputs[:, 0:1]  # (B, 1)
        self.positions = self.inputs[:, 1:2]  # (B, 1)
        self.tables = self.inputs[:, 2:]  # (B, blocks)
        self.key_positions = torch.arange(length, device=device)  # (L,)
        self.paged = paged  # a kernel reading the pool in place (engine/model/paged_attention.py), or None
        self.query_starts = torch.arange(b + 1, dtype=torch.int32, device=device)  # (B+1,): one query per row
        self.attention = AttentionCapture({layer: list(range(b)) for layer in key.attention_layers}, b, False) \
            if key.attention_layers else None
        self.graph = None
        self.capture_error: str | None = None
        self.compile_error: str | None = None
        self._step = _compiled(self._forward) if compile else self._forward
        try:
            self.outputs = self._step()  # first run: allocations, lazy initialisation, the compile
        except Exception as err:
            if not compile:
                raise
            self._step, self.compile_error = self._forward, f"{type(err).__name__}: {err}"
            log.warning("torch.compile failed for %s (%s); decoding this shape eagerly", key, self.compile_error)
            self.outputs = self._forward()
        if capture:
            try:
                self._capture(pool)
            except Exception as err:  # this shape stays on the static-buffer eager path, as the CPU runs it
                self.graph, self.capture_error = None, f"{type(err).__name__}: {err}"
                log.warning("CUDA graph capture failed for %s (%s); decoding this shape eagerly", key,
                            self.capture_error)

    def _forward(self) -> "DecodeOutputs":
        mask = self.masks.build(self.key_positions, self.positions)  # (B, 1, 1, L), per layer type where needed
        bs = self.cache.block_size
        view: Any = BatchCacheView(self.cache, write_slots(self.tables, self.positions, bs),
                                   read_slots(self.tables, self.key.kv_len, bs), self.key.kv_len)
        kwargs: dict[str, Any] = {}
        if self.paged is not None:
            batch = PagedBatch.for_decode(self.paged, self.tables, self.positions, self.query_starts,
                                          self.key.kv_len, view.read_index)
            view, kwargs[PAGED_KWARG] = PagedCacheView(self.cache, view.write_index, batch), batch
        if self.key.hidden_layers:
            kwargs["output_hidden_states"] = [hidden_states_index(layer) for layer in self.key.hidden_layers]
        if self.attention is not None:
            self.attention.patterns = {}
            kwargs[CAPTURE_KWARG] = self.attention
        out = self.model(input_ids=self.ids, position_ids=self.positions, attention_mask=mask, use_cache=True,
                         logits_to_keep=1, **cache_argument(self.model, view), **kwargs)
        logits = out.logits[:, -1].float()  # (B, V)
        hidden = {layer: out.hidden_states[hidden_states_index(layer)][:, -1] for layer in self.key.hidden_layers}
        patterns = dict(self.attention.patterns) if self.attention is not None else {}  # (B, h, 1, L)
        return DecodeOutputs(logits, top_logprobs(logits), hidden, patterns)

    def _capture(self, pool: Any) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on a side stream, as CUDA graph capture requires
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs = self._forward()
        self.graph = graph

    def run(self, tokens: Sequence[int], starts: Sequence[int], tables: Sequence[Sequence[int]]) -> "DecodeOutputs":
        """Rows ``0 … len(tokens)-1`` feed one token each at ``starts`` into their ``tables``;
        returns copies of the outputs' first ``n`` rows, taken before the next replay can
        overwrite them."""
        n, b, nb = len(tokens), self.key.batch, self.blocks
        host = [[t, s] + list(table[:nb]) + [SCRATCH_BLOCK] * (nb - len(table[:nb]))
                for t, s, table in zip(tokens, starts, tables)]
        host += [[0, 0] + [SCRATCH_BLOCK] * nb] * (b - n)
        self.inputs.copy_(torch.tensor(host, dtype=torch.long))
        if self.graph is not None:
            self.graph.replay()
            out = self.outputs
        else:
            out = self._step()
        return DecodeOutputs(out.logits[:n].clone(), (out.top[0][:n].clone(), out.top[1][:n].clone()),
                             {k: v[:n].clone() for k, v in out.hidden.items()},
                             {k: v[:n].clone() for k, v in out.patterns.items()})


# Every StaticDecode compiles the same function (its ``_forward``) for its own shape; dynamo keeps at
# most ``recompile_limit`` (8) compiled versions of one function and runs the next shape eagerly,
# silently. A run meets batch buckets × length buckets × capture plans: room for that many.
MAX_COMPILED_SHAPES = 64


def _compiled(forward: Any) -> Any:
    compiled = torch.compile(forward, dynamic=False)

    def step() -> "DecodeOutputs":
        with torch._dynamo.config.patch(recompile_limit=MAX_COMPILED_SHAPES):
            return compiled()
    return step


@dataclass(frozen=True)
class DecodeOutputs:
    logits: torch.Tensor  # (B, V) float32
    top: tuple[torch.Tensor, torch.Tensor]  # top log-probs (B, k) and their ids (B, k)
    hidden: dict[int, torch.Tensor]  # layer → (B, d)
    patterns: dict[int, torch.Tensor]  # layer → (B, h, 1, L)
