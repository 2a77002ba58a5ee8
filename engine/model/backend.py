"""The Backend protocol: the model runner the step loop drives, and the typed batch it runs.

A backend holds the model, its tokenizer and the tensors of a paged KV cache, and nothing about
requests or blocks: which request holds which block, what is reserved, which prefix is cached and
what is evicted are the scheduler's (:mod:`engine.core.kv_manager`). Once per step the scheduler
hands it a :class:`ForwardBatch` — every row to feed (the tokens a request has not fed yet, the
position of the first, the request's block table, what to capture, whether its payload needs the
logits' top log-probs and whether its draw is the row's argmax) plus the pool's size and the block copies to make first — and
:meth:`Backend.execute` runs it and returns a :class:`ForwardOutput`. Positions are data: a
request that backtracked simply feeds from an earlier position again; the runner never learns why.

Shapes (``d`` hidden size, ``V`` logits width, ``q`` tokens fed, ``kv`` the request's context):
:class:`RowOutput` logits ``(V,)`` float32 for the position after the last fed token;
internals per :class:`~engine.model.capture.RowCapture`. Tensors stay on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from engine.config import BackendConfig
from engine.model.capture import CapturePlan, RowCapture
from engine.model.hook_names import BLOCK_HOOKS, GLOBAL_HOOKS, HookSet
from engine.model.vocab_search import first_max_ids, vocab_topk_ids

__all__ = ["Backend", "ModelInfo", "KVLayout", "ForwardRow", "ForwardBatch", "ForwardOutput", "RowOutput", "TokenScores",
           "ForwardRecord", "DeferredArgmax", "FORWARD_TOP_K", "top_logprobs", "vocab_topk_ids"]

# Every forward's most likely next tokens, which observability payloads record per ForwardPass.
# Computed once for the whole batch (inside the replayed graph on a GPU): per request, a
# log-softmax and a top-k over a 128k vocabulary are two more launches and host work on every row.
FORWARD_TOP_K = 20


def top_logprobs(logits: Any, k: int = FORWARD_TOP_K) -> tuple[Any, Any]:
    """``logits (B, V)`` → the ``k`` largest log-probabilities ``(B, k)`` and their ids ``(B, k)``.
    (The top logits less a ``logsumexp`` would skip writing the ``(B, V)`` log-softmax, but on a
    CPU ``logsumexp`` alone costs three times the fused ``log_softmax``, and it rounds differently.)"""
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = min(k, logp.shape[-1])
    if logp.device.type != "cpu":
        return logp.topk(k, dim=-1)
    indices = vocab_topk_ids(logp, k)
    return logp.gather(1, indices), indices


@dataclass(frozen=True)
class ModelInfo:
    """Dimensions read from the loaded model's config (never hard-coded)."""

    model_id: str
    vocab_size: int  # logits width V (may exceed len(tokenizer))
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    family: str | None = None  # engine/model/families.py (None: a stand-in backend with no model)
    block_hooks: tuple[str, ...] = BLOCK_HOOKS  # the per-block names this model computes
    model_hooks: tuple[str, ...] = GLOBAL_HOOKS  # and its model-wide ones

    @property
    def hooks(self) -> HookSet:
        """The names this model computes (every name of the vocabulary for a stand-in backend)."""
        return HookSet(tuple(self.block_hooks), tuple(self.model_hooks))


@dataclass(frozen=True)
class KVLayout:
    """The runner's paged KV pool as the scheduler's KV manager sees it: ``block_size``
    positions per block, ``blocks`` allocated now (block 0, the scratch block, included), at most
    ``max_blocks`` (a static pool, which CUDA graphs need at fixed addresses, starts whole), and
    ``block_bytes`` of keys and values per block over every layer."""

    block_size: int
    blocks: int
    max_blocks: int
    block_bytes: int


@dataclass(frozen=True)
class ForwardRow:
    """One request's part of a step's forward: feed ``tokens`` at positions ``start, start+1, …``
    (the keys/values before ``start`` are already in the request's blocks). ``table``: the
    request's block table, covering every position up to ``start + len(tokens)``; ``top``: the
    logits' top log-probs are wanted (the request's payload records them); ``argmax``: the
    runner finds the row's greedy choice (:attr:`ForwardOutput.argmax`)."""

    request_id: str
    start: int
    tokens: tuple[int, ...]
    plan: CapturePlan = CapturePlan()
    steer: Any = None  # (d,) added to this row's residual stream after ``steer_layer`` (SAE steering)
    steer_layer: int | None = None
    table: Sequence[int] = ()
    top: bool = True
    # its draw is the row's argmax as the forward left it (greedy; no penalty, bias, ban, grammar or
    # held-back stop token; no mod, or one lent the row in place whose writes the draw ignores): a
    # CPU runner finds it with the forward, as vLLM's and nano-vllm's runners sample
    argmax: bool = False
    # a prompt being scored: ``targets[j]`` is the token after position ``start + j``; the row's
    # output then carries each target's log-prob (and the ``score_top_k`` best alternatives)
    targets: tuple[int, ...] | None = None
    score_top_k: int = 0
    # with ``argmax``: its mod handed the row back last step, so the argmax found before the mod is
    # likely never read; a runner that can recompute the batch's logits may leave it unfound
    # (ForwardOutput.deferred), which saves a pass over the row's vocabulary each step
    defer_argmax: bool = False


@dataclass(frozen=True)
class TokenScores:
    """A scored row's ``logprobs[j]`` = log p(``targets[j]`` | the tokens up to position
    ``start + j``) under the model's own distribution, and ``top[j]`` its ``score_top_k`` best
    ``(id, logprob)``. Plain Python data."""

    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class ForwardBatch:
    """What one step runs: ``rows`` (each request at most once), the blocks the pool must hold
    first (``num_blocks``; it only grows) and the copy-on-write copies ``(source block, destination
    block, positions)`` to make before anything is written."""

    rows: tuple[ForwardRow, ...]
    num_blocks: int = 0
    copies: tuple[tuple[int, int, int], ...] = ()

    def only(self, index: int) -> "ForwardBatch":
        """Row ``index`` alone (the pool and copies already seen to): to find the row at fault
        when a whole batch's forward fails."""
        return ForwardBatch((self.rows[index],), self.num_blocks)


class RowOutput:
    """One row of a forward: ``logits (V,)`` float32 for the position after its last fed token,
    ``captured`` its own internals, ``top`` the logits' ``FORWARD_TOP_K`` log-probs ``(k,)`` and
    ids ``(k,)`` (None when not asked). A row of a :class:`ForwardOutput` makes its tensor views
    only when they are read: a step hands every row its output, and most rows' logits are only
    ever read by the batched sampler, through :attr:`source`."""

    __slots__ = ("_batch", "index", "_logits", "captured", "_top")

    @property
    def scores(self) -> "TokenScores | None":
        """A scored row's per-position log-probs (its ForwardRow had ``targets``), else None."""
        batch = self._batch
        return None if batch is None or batch.scores is None else batch.scores[self.index]

    def __init__(self, logits: Any, captured: RowCapture, top: tuple[Any, Any] | None, *,
                 batch: "ForwardOutput | None" = None, index: int = 0) -> None:
        self._batch, self.index = batch, index
        self._logits, self.captured, self._top = logits, captured, top

    @property
    def logits(self) -> Any:
        if self._logits is None and self._batch is not None:
            self._logits = self._batch.logits[self.index]
        return self._logits

    @property
    def top(self) -> tuple[Any, Any] | None:
        if self._top is None and self._batch is not None and self._batch.top is not None:
            values, ids = self._batch.top
            self._top = (values[self.index], ids[self.index])
        return self._top

    def host_logits(self, in_place: bool = False) -> Any:
        """The batch's :class:`~engine.model.tensor.HostLogits` with this row in it: the one host
        copy of the step's logits that every mod reading its request's logits shares (None for a
        row on its own). ``in_place``: the caller vouches that nothing reads this row after its
        one mod but the draw, its argmax (:meth:`HostLogits.share`)."""
        batch = self._batch
        if batch is None:
            return None
        host = batch.host
        if host is None:
            from engine.model.tensor import HostLogits

            host = HostLogits(batch.logits)
            object.__setattr__(batch, "host", host)
        if in_place:
            host.share(self.index)
        else:
            host.add(self.index)
        return host

    @property
    def source(self) -> tuple[Any, int] | None:
        """``(logits (B, V) of the whole batch, this row's index)``, or None for a row on its own."""
        return (self._batch.logits, self.index) if self._batch is not None else None

    @property
    def argmax(self) -> int | None:
        """The row's first maximum, when its runner found it (it asked: :attr:`ForwardRow.argmax`)."""
        found = self._batch.argmax if self._batch is not None else None
        return None if found is None else found[self.index]

    @property
    def argmax_deferred(self) -> bool:
        """Its runner left its asked-for argmax unfound (:attr:`ForwardRow.defer_argmax`):
        :meth:`deferred_argmax` finds it from the logits recomputed."""
        batch = self._batch
        return batch is not None and batch.deferred is not None and self.index in batch.deferred.rows

    def deferred_argmax(self) -> int:
        """The first maximum of the row as its forward made it, though the row itself may hold a
        mod's writes since (:class:`DeferredArgmax`); only for a row whose argmax was deferred."""
        return self._batch.deferred.argmax(self.index)  # type: ignore[union-attr]

    @property
    def batch_top(self) -> tuple[Any, Any] | None:
        """The whole batch's ``(values (B, k), ids (B, k))`` top log-probs, when computed."""
        return self._batch.top if self._batch is not None else None

    @property
    def top_source(self) -> tuple[Any, Any, int] | None:
        """``(values (B, k), ids (B, k), this row's index)`` of the batch's top log-probs (None when
        not asked): what a payload keeps, without a view per row per step."""
        if self._batch is not None:
            top = self._batch.top
            return None if top is None else (top[0], top[1], self.index)
        return None if self._top is None else (self._top[0][None], self._top[1][None], 0)


@dataclass(frozen=True)
class ForwardOutput:
    """A batch's outputs in row order: ``logits (B, V)`` float32; ``top`` the ``(B, k)`` top
    log-probs and ids (rows that did not ask may hold anything; None when no row asked);
    ``captured`` each row's own internals."""

    logits: Any
    top: tuple[Any, Any] | None
    captured: tuple[RowCapture, ...]
    host: Any = field(default=None, compare=False, repr=False)  # HostLogits, once a row's mods may read it
    scores: tuple[TokenScores | None, ...] | None = None  # per row, for rows fed with targets
    # on a CPU, the first maximum (a Python int) of each row that asked (ForwardRow.argmax), None
    # for each row that did not (its draw may not be its argmax); None when no row asked
    argmax: list[int | None] | None = None
    deferred: "DeferredArgmax | None" = field(default=None, compare=False, repr=False)

    def rows(self) -> list[RowOutput]:
        return [RowOutput(None, c, None, batch=self, index=b) for b, c in enumerate(self.captured)]


class DeferredArgmax:
    """The argmax of rows a runner left unfound (:attr:`ForwardRow.defer_argmax`), found on demand
    from the batch's logits recomputed exactly as its forward made them (the same head on the
    same input), since the rows themselves may hold what a mod lent them in place wrote since. A
    row's mod that hands it back (the usual edit-and-return) makes its draw the argmax of what it
    handed back, and then nothing is recomputed; one that does not costs the batch one head
    multiplication and one search, for every deferred row together, once."""

    __slots__ = ("rows", "_recompute", "_found")

    def __init__(self, rows: frozenset[int], recompute: Callable[[], torch.Tensor]) -> None:
        self.rows, self._recompute = rows, recompute
        self._found: dict[int, int] | None = None

    def argmax(self, row: int) -> int:
        if self._found is None:
            order = sorted(self.rows)
            self._found = dict(zip(order, first_max_ids(self._recompute(), rows=order)))
        return self._found[row]


@dataclass(frozen=True)
class ForwardRecord:
    """The tokens one forward read and their hidden states, for SAE encoding.

    ``hidden[layer]`` is ``(len(token_ids), d)``, on the model's device; the tokens sit at
    positions ``start_position, start_position + 1, …``.
    """

    start_position: int
    token_ids: tuple[int, ...]
    hidden: dict[int, Any]


@runtime_checkable
class Backend(Protocol):
    """Everything the engine asks of a model runtime. ``reference_model`` is the one way to the
    model object itself, and only for *independent* references — a benchmark's plain-transformers
    baseline, a test's ``generate``/``output_hidden_states`` — never for serving: a runtime whose
    model is not a transformers module has none to give."""

    info: ModelInfo
    config: BackendConfig
    device: Any  # torch.device the model's tensors live on (samplers' generators, logits edits)

    def tokenizer(self) -> Any: ...

    @property
    def max_batch(self) -> int:
        """How many requests one step may run."""
        ...

    @property
    def max_sequence(self) -> int:
        """The most positions one request may use (prompt + generated)."""
        ...

    @property
    def kv_layout(self) -> KVLayout:
        """The paged pool the scheduler's KV manager hands out blocks of."""
        ...

    def execute(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one step's forward: grow the pool to ``batch.num_blocks``, make ``batch.copies``,
        then feed every row, writing its keys/values into its table's blocks."""
        ...

    def embed(self, token_ids: Sequence[Sequence[int]], *, layer: int | None = None, pool: str = "mean",
              batch_size: int = 16) -> Any:
        """``(len(token_ids), d)`` float32 numpy embeddings of plain-text token ids (one list per
        text), from fresh forwards that use no slot: the final normed hidden states, or the
        residual stream after block ``layer``, pooled by ``"mean"`` or ``"last"``
        (:mod:`engine.model.embeddings`)."""
        ...

    def embed_batches(self, token_ids: Sequence[Sequence[int]], *, layer: int | None = None, pool: str = "mean",
                      batch_size: int = 16, max_tokens: int | None = None) -> Any:
        """:meth:`embed` a batch per ``next()`` (each at most ``max_tokens`` padded tokens, but
        always one text; yields the tokens it fed), returning the embeddings: the units the step
        loop schedules (arguments are checked when it is called, before any forward)."""
        ...

    def capture(self, input_ids: Sequence[int], names: Sequence[str], *, out: Any = None) -> dict[str, Any]:
        """``{name: tensor}`` (batch dimension dropped, forward order) of every internal matching
        ``names`` (globs) in one fresh forward over ``input_ids`` that uses no slot; with ``out``,
        also written there (:mod:`engine.model.named_capture`)."""
        ...

    @property
    def reference_model(self) -> Any:
        """The underlying transformers model, for independent references only (see the class)."""
        ...

    def shutdown(self) -> None: ...
