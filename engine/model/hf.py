"""HuggingFaceBackend: transformers' causal LM run over a paged KV cache, many requests a forward.

Never ``model.generate``: mods intervene between every forward pass. The model is called with our
own cache view (:class:`~engine.model.kv_cache.BatchCacheView`), explicit ``position_ids`` and a
ready 4-D boolean mask (one per kind of layer where some layers slide: :mod:`engine.model.masks`),
so transformers builds neither a mask nor a cache of its own; its attention
modules write each row's keys/values into that row's blocks. The internals rows ask for come from
:mod:`engine.model.capture`. It is a model runner: it holds the model and the KV pool's tensors and
no request or block state — each step's :class:`~engine.model.backend.ForwardBatch` brings every
row's block table, the pool's size and the copies to make (the scheduler's KV manager decides
them, :mod:`engine.core.kv_manager`).

On a CPU the linear layers run on oneDNN-prepacked weights (:mod:`engine.model.prepack`); where a
paged kernel serves the model (CUDA) attention reads the KV pool in place instead of a gathered
copy (:mod:`engine.model.paged_attention`).

A step's rows are grouped by how many tokens they feed: every one-token row (decode) shares one
forward; a row feeding several tokens (a prefill, or a forced chunk) is a prefill-shaped forward of
its own. Shapes: ``ids (B, q)``, ``mask (B, 1, q, kv)``, logits ``(B, V)`` float32.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import torch

from engine.config import BackendConfig
from engine.errors import ContextOverflowError, InvalidRequestError
from engine.model.backend import DeferredArgmax, ForwardBatch, ForwardOutput, ForwardRow, KVLayout, ModelInfo, top_logprobs
from engine.model.scoring import score_positions
from engine.model.capture import (
    CAPTURE_KWARG,
    AttentionCapture,
    RowCapture,
    check_layer,
    ensure_attention_registered,
    hidden_states_index,
    split_rows,
)
from engine.model.compile_cache import use_compile_cache
from engine.model.devices import resolve_device, resolve_dtype
from engine.model.gathered_rows import GatheredRows
from engine.model.graphs import GraphKey, StaticDecode, batch_bucket, length_bucket
from engine.model.head_replay import HeadReplay
from engine.model.hook_names import resid_post
from engine.model.kv_cache import BatchCacheView, PagedKVCache, cache_argument
from engine.model.loading import load_model_and_tokenizer
from engine.model.masks import AttentionMasks
from engine.model.paged_attention import PAGED_KWARG, PagedBatch, PagedCacheView, select_kernel
from engine.model.prepack import prepack_linears
from engine.model.taps import taps_of
from engine.model.vocab_search import first_max_ids

__all__ = ["HuggingFaceBackend"]

log = logging.getLogger("raylens.backend")


def _asked_argmax(logits: torch.Tensor, rows: Sequence[ForwardRow], top: tuple[Any, Any] | None,
                  replay: HeadReplay | None = None) -> tuple[list[int | None] | None, DeferredArgmax | None]:
    """The first maximum of a forward's ``logits (B, V)`` of each of its ``rows`` that asked
    (``ForwardRow.argmax``; None for a row that did not), on a CPU; None when no row asked, and
    elsewhere (a GPU's sampler finds its own, with no host read here). ``top``: the batch's top
    log-probs when the forward computed them (payloads sent, or log-probs asked for), which give
    every row's argmax but a tied one's with no second pass over the vocabulary (at 64 rows ×
    49,152: 0.02 ms against the pass's 0.3-0.6). With ``replay`` (an eager forward's head input
    kept), the rows that may defer theirs (``ForwardRow.defer_argmax``) are left None and found on
    demand (the second value; :mod:`engine.model.head_replay`)."""
    if logits.device.type != "cpu" or not any(r.argmax for r in rows):
        return None, None
    deferred = None
    if replay is not None and top is None:
        if any(r.defer_argmax for r in rows):  # (a mod-free batch asks none: no set built)
            later = frozenset(b for b, r in enumerate(rows) if r.argmax and r.defer_argmax)
            deferred = replay.deferred(logits, later) if later else None
    if deferred is None:
        return [found if row.argmax else None for found, row in zip(first_max_ids(logits, top), rows)], None
    now = [b for b, r in enumerate(rows) if r.argmax and b not in deferred.rows]
    if not now:
        return [None] * len(rows), deferred
    if 2 * len(now) < len(rows):  # a few rows: gathered and searched
        picked = dict(zip(now, first_max_ids(logits, None, now)))
    else:  # most of the batch: searched in place
        every = first_max_ids(logits)
        picked = {b: every[b] for b in now}
    return [picked.get(b) for b in range(len(rows))], deferred


class HuggingFaceBackend:
    def __init__(self, config: BackendConfig | None = None) -> None:
        self.model: Any = None
        self._head_replay: HeadReplay | None = None
        if config is not None:
            self.load_model(config.model_id, config)

    # ----------------------------------------------------------------------------------- loading

    def load_model(self, model_id: str, config: BackendConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model, self._tokenizer = load_model_and_tokenizer(
            model_id, cache_dir=config.model_cache_dir, device=self.device, dtype=self.dtype,
            attn_implementation=ensure_attention_registered(), hf_token=config.hf_token,
        )
        # oneDNN-packed linear weights on a CPU (engine/model/prepack.py); before the taps, which
        # hook modules and never read a forward
        self.prepacked = prepack_linears(self.model, batch_hint=config.max_batch) \
            if config.weight_prepack == "auto" else 0
        self._taps = taps_of(self.model)  # every named internal's module, resolved once for this model
        self._masks = AttentionMasks.of(self.model, self._taps.family)  # model families: sliding layers' masks
        mc = self.model.config
        self.layer = check_layer(config.hidden_state_layer, mc.num_hidden_layers)
        max_context = int(getattr(mc, "max_position_embeddings", 0) or 2**31 - 1)
        self.info = ModelInfo(
            model_id=model_id,
            vocab_size=int(self.model.get_output_embeddings().out_features),
            hidden_size=int(mc.hidden_size),
            num_layers=int(mc.num_hidden_layers),
            num_attention_heads=int(mc.num_attention_heads),
            num_key_value_heads=int(getattr(mc, "num_key_value_heads", mc.num_attention_heads)),
            max_context=max_context,
            eos_token_ids=self._eos_ids(),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            family=self._taps.family.name, block_hooks=self._taps.hooks.block, model_hooks=self._taps.hooks.model,
        )
        self._max_sequence = min(config.max_sequence or max_context, max_context)
        head_dim = int(getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads)
        mode = config.graph_decode
        self._graph_capture = mode == "auto" and self.device.type == "cuda"
        self._compile_decode = mode == "compile"
        if self._compile_decode:  # compiled kernels kept on disk: built once per machine
            self.compile_cache = use_compile_cache(config.compile_cache_dir)
        self._static_decode = self._graph_capture or mode in ("static", "compile")
        bs = config.kv_block_size
        max_blocks = -(-(config.kv_cache_tokens or config.max_batch * self._max_sequence) // bs) + 1  # + scratch
        # graphs hold the pool's addresses: a static pool is allocated whole, once
        blocks = max_blocks if self._static_decode else -(-config.max_batch * config.initial_cache_tokens // bs) + 1
        self.cache = PagedKVCache(num_layers=self.info.num_layers, kv_heads=self.info.num_key_value_heads,
                                  head_dim=head_dim, block_size=bs, blocks=blocks, max_blocks=max_blocks,
                                  dtype=self.dtype, device=self.device)
        self._kv_layout = KVLayout(bs, self.cache.num_blocks, max_blocks, self.cache.block_nbytes())
        # a kernel that reads the pool in place, where one serves this model here (else each step gathers)
        self.paged_kernel, self.paged_reason = select_kernel(
            config.paged_attention, device=self.device, dtype=self.dtype, block_size=bs,
            softcapped=getattr(mc, "attn_logit_softcapping", None) is not None)
        log.info("attention: %s", self.paged_reason)
        # on a CPU with no paged kernel, the rows an eager forward gathers are kept for the next
        # (engine/model/gathered_rows.py): each decode step then copies only the newest positions
        self._gathered = GatheredRows(self.cache) if self.device.type == "cpu" and self.paged_kernel is None else None
        # on a CPU, an eager forward's head input is kept so that its logits can be recomputed: a row
        # whose mod hands it back each step then needs no argmax before its mod (engine/model/head_replay.py)
        self._head_replay = HeadReplay(self.model) if self.device.type == "cpu" and not self._static_decode else None
        self._graphs: dict[GraphKey, StaticDecode] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self._graph_capture else None
        self.graph_stats = {"static_steps": 0, "eager_steps": 0, "graphs": 0}

    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for source in (self._tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            for value in source if isinstance(source, (list, tuple)) else [source]:
                if value is not None and int(value) not in ids:
                    ids.append(int(value))
        return tuple(ids)

    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def reference_model(self) -> Any:
        """The transformers model itself: for independent references only (see :class:`Backend`)."""
        return self.model

    @property
    def attention_implementation(self) -> str:
        return self.model.config._attn_implementation

    @property
    def max_batch(self) -> int:
        return self.config.max_batch

    @property
    def max_sequence(self) -> int:
        return self._max_sequence

    @property
    def kv_layout(self) -> KVLayout:
        return self._kv_layout

    # ----------------------------------------------------------------------------------- forward

    def execute(self, batch: ForwardBatch) -> ForwardOutput:
        """Grow the pool and make the batch's copies, then run its rows: decode rows (one token
        each) share one forward — a replayed graph when they fit one; every prefill-shaped row (a
        prompt, a forced chunk) shares another, left-padded. Outputs in row order."""
        rows = batch.rows
        for row in rows:
            if not row.tokens:
                raise InvalidRequestError(f"request {row.request_id!r} has no token to feed", parameter="tokens")
            if len(row.table) * self.cache.block_size < row.start + len(row.tokens):
                raise InvalidRequestError(f"request {row.request_id!r}'s block table must cover position "
                                          f"{row.start + len(row.tokens) - 1}, got {len(row.table)} blocks",
                                          parameter="table", value=len(row.table))
        if batch.num_blocks > self.cache.num_blocks:
            self.cache.grow(batch.num_blocks)
        for source, destination, length in batch.copies:
            self.cache.copy_block(source, destination, length)
        # decode rows, prefill-shaped rows, and rows being scored (their every position's logits)
        kinds = [2 if r.targets is not None else 0 if len(r.tokens) == 1 else 1 for r in rows]
        groups = [g for g in ([i for i, k in enumerate(kinds) if k == kind] for kind in (0, 1, 2)) if g]
        outs = [self._run([rows[i] for i in group]) for group in groups]
        if len(outs) == 1:
            return outs[0]
        order = [i for group in groups for i in group]
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        inverse = inverse.to(self.device)
        logits = torch.cat([o.logits for o in outs]).index_select(0, inverse)
        top = None
        if any(o.top is not None for o in outs):
            parts = [o.top if o.top is not None else top_logprobs(o.logits) for o in outs]
            top = (torch.cat([p[0] for p in parts]).index_select(0, inverse),
                   torch.cat([p[1] for p in parts]).index_select(0, inverse))
        argmax = None
        if any(o.argmax is not None for o in outs):
            found = [a for o in outs for a in (o.argmax if o.argmax is not None else [None] * len(o.captured))]
            argmax = [found[position] for position in inverse.tolist()]
            # a row whose argmax its group deferred is searched now: the joined logits are a copy
            missing = [i for i, row in enumerate(rows) if row.argmax and argmax[i] is None]
            if missing:
                for i, best in zip(missing, first_max_ids(logits, None, missing)):
                    argmax[i] = best
        joined = [c for o in outs for c in o.captured]  # in group order
        joined_scores = [s for o in outs for s in (o.scores or (None,) * len(o.captured))]
        captured: list[Any] = [None] * len(order)
        scores: list[Any] = [None] * len(order)
        for position, i in enumerate(order):
            captured[i], scores[i] = joined[position], joined_scores[position]
        return ForwardOutput(logits, top, tuple(captured),
                             scores=tuple(scores) if any(s is not None for s in scores) else None, argmax=argmax)

    def _static_fits(self, rows: Sequence[ForwardRow]) -> bool:
        """One-token rows, no steering: the static/graph decode path."""
        return (self._static_decode and len(rows[0].tokens) == 1 and rows[0].targets is None
                and all(r.steer is None for r in rows))

    def _run_static(self, rows: Sequence[ForwardRow]) -> ForwardOutput:
        plans = [r.plan for r in rows]
        hidden_layers = tuple(sorted({layer for p in plans for layer in p.hidden_layers}))
        attention_layers = tuple(sorted({layer for p in plans for layer in p.attention_layers}))
        starts = [r.start for r in rows]
        key = GraphKey(batch_bucket(len(rows), self.max_batch), length_bucket(max(starts) + 1, self._max_sequence),
                       hidden_layers, attention_layers)
        decode = self._graphs.get(key)
        if decode is None:
            decode = self._graphs[key] = StaticDecode(self.model, self.cache, key, capture=self._graph_capture,
                                                      pool=self._graph_pool, compile=self._compile_decode,
                                                      paged=self.paged_kernel)
            self.graph_stats["graphs"] = len(self._graphs)
        if self._gathered is not None:  # it writes the pool past the rows kept gathered
            self._gathered.forget()
        out = decode.run([r.tokens[0] for r in rows], starts, [r.table for r in rows])
        self.graph_stats["static_steps"] += 1
        captured = tuple(RowCapture({layer: out.hidden[layer][b:b + 1] for layer in row.plan.hidden_layers},  # (1, d)
                                    {layer: out.patterns[layer][b][:, :, :row.start + 1]  # (h, 1, kv)
                                     for layer in row.plan.attention_layers})
                         for b, row in enumerate(rows))
        logits = out.logits[:len(rows)]
        top = tuple(t[:len(rows)] for t in out.top)
        return ForwardOutput(logits, top, captured, argmax=_asked_argmax(logits, rows, top)[0])

    def _run(self, rows: Sequence[ForwardRow]) -> ForwardOutput:
        """One forward of ``rows`` (each ``q_b`` tokens, left-padded to the longest)."""
        end = max(r.start + len(r.tokens) for r in rows)
        if end > self._max_sequence:
            raise ContextOverflowError(f"a request must fit {self._max_sequence} positions, needs {end}",
                                       parameter="max_sequence", value=end)
        if self._static_fits(rows):
            with torch.inference_mode():
                return self._run_static(rows)
        return self._run_eager(rows)

    def _run_eager(self, rows: Sequence[ForwardRow]) -> ForwardOutput:
        lengths = [len(r.tokens) for r in rows]
        starts = [r.start for r in rows]
        self.graph_stats["eager_steps"] += 1
        q = max(lengths)
        view, positions = BatchCacheView.build(self.cache, [r.table for r in rows], starts, lengths,  # (B, q)
                                               self._gathered)
        ids = torch.tensor([[0] * (q - len(r.tokens)) + list(r.tokens) for r in rows], dtype=torch.long,
                           device=self.device)  # (B, q)
        key_pos = torch.arange(view.kv_len, device=self.device)
        # (B, 1, q, kv) causal per row, sliding where a layer slides (engine/model/masks.py; model families)
        mask = self._masks.build(key_pos, positions)
        plans = [r.plan for r in rows]
        hidden_layers = sorted({layer for p in plans for layer in p.hidden_layers})
        kwargs: dict[str, Any] = {}
        if hidden_layers:
            kwargs["output_hidden_states"] = [hidden_states_index(layer) for layer in hidden_layers]
        capture = AttentionCapture.for_rows(plans)
        if capture is not None:
            kwargs[CAPTURE_KWARG] = capture
        scoring = rows[0].targets is not None  # execute() runs scored rows as a group of their own
        cache: Any = view
        if self.paged_kernel is not None:  # the kernel reads the pool in place; nothing is gathered
            paged = PagedBatch.for_rows(self.paged_kernel, view.tables, starts, lengths, view.read_index)
            cache = PagedCacheView(self.cache, view.write_index, paged)
            kwargs[PAGED_KWARG] = paged
        replay = self._head_replay
        if replay is not None:
            replay.arm()
        with torch.inference_mode(), self._steering(rows):
            try:
                out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                                 logits_to_keep=0 if scoring else 1, **cache_argument(self.model, cache), **kwargs)
            except BaseException:
                if self._gathered is not None:  # its layers were left half refreshed
                    self._gathered.forget()
                if replay is not None:
                    replay.disarm()
                raise
            logits = out.logits[:, -1].float()  # (B, V): the last column is every row's newest real token
            top = top_logprobs(logits) if any(r.top for r in rows) else None
            argmax, deferred = _asked_argmax(logits, rows, top, replay)
            if replay is not None:
                replay.disarm()
            scores = tuple(score_positions(out.logits[b, q - len(r.tokens):], r.targets, r.score_top_k)  # type: ignore[arg-type]
                           for b, r in enumerate(rows)) if scoring else None
        hidden_index = {layer: hidden_states_index(layer) for layer in hidden_layers}
        captured = split_rows(out, plans, capture, hidden_index, [s + n for s, n in zip(starts, lengths)], lengths)
        return ForwardOutput(logits, top, tuple(captured), scores=scores, argmax=argmax, deferred=deferred)

    @contextlib.contextmanager
    def _steering(self, rows: Sequence[ForwardRow]):
        """While rows steer: the write tap of their layer's ``hook_resid_post`` adds each row's
        vector ``(d,)`` to the residual stream the block outputs (rows without a steer add zeros)."""
        steered = [r for r in rows if r.steer is not None]  # delta (B, 1, d) broadcasts over q
        if not steered:
            yield
            return
        layers = {r.steer_layer for r in steered}
        if len(layers) != 1 or None in layers:
            raise InvalidRequestError("rows of one forward must steer at one layer", parameter="steer_layer")
        layer = check_layer(layers.pop(), self.info.num_layers, parameter="steer_layer")  # type: ignore[arg-type]
        delta = torch.zeros(len(rows), 1, self.info.hidden_size, dtype=self.dtype, device=self.device)  # (B, 1, d)
        for b, row in enumerate(rows):
            if row.steer is not None:
                delta[b, 0] = row.steer.to(device=self.device, dtype=self.dtype)
        with self._taps.write(resid_post(layer), lambda resid: resid + delta):
            yield

    # ------------------------------------------------------------------ fresh forwards (no slots)

    def embed(self, token_ids: Sequence[Sequence[int]], *, layer: int | None = None, pool: str = "mean",
              batch_size: int = 16) -> Any:
        from engine.model.embeddings import embed

        return embed(self._taps, token_ids, pad_id=self._tokenizer.pad_token_id, layer=layer, pool=pool,
                     batch_size=batch_size)

    def embed_batches(self, token_ids: Sequence[Sequence[int]], *, layer: int | None = None, pool: str = "mean",
                      batch_size: int = 16, max_tokens: int | None = None) -> Any:
        from engine.model.embeddings import embed_batches

        return embed_batches(self._taps, token_ids, pad_id=self._tokenizer.pad_token_id, layer=layer, pool=pool,
                             batch_size=batch_size, max_tokens=max_tokens)

    def capture(self, input_ids: Sequence[int], names: Sequence[str], *, out: Any = None) -> dict[str, Any]:
        from engine.model.named_capture import capture

        return capture(self._taps, input_ids, names, out=out, model_id=self.info.model_id)

    def shutdown(self) -> None:
        self.model = self._taps = None  # type: ignore[assignment]  # shut down: nothing uses them after
