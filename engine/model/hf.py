"""HuggingFaceBackend: transformers' causal LM run over a paged KV cache, many requests a forward.

Never ``model.generate``: mods intervene between every forward pass. The model is called with our
own cache view (:class:`~engine.model.kv_cache.BatchCacheView`), explicit ``position_ids`` and a
ready 4-D boolean mask (one per kind of layer where some layers slide: :mod:`engine.model.masks`),
so transformers builds neither a mask nor a cache of its own; its attention
modules write each row's keys/values into that row's blocks. The internals rows ask for come from
:mod:`engine.model.capture`; block tables, reservations and the prefix cache from
:mod:`engine.model.kv_blocks`.

A step's rows are grouped by how many tokens they feed: every one-token row (decode) shares one
forward; a row feeding several tokens (a prefill, or a forced chunk) is a prefill-shaped forward of
its own. Shapes: ``ids (B, q)``, ``mask (B, 1, q, kv)``, logits ``(B, V)`` float32.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Sequence

import torch

from engine.config import BackendConfig
from engine.errors import ContextOverflowError, InvalidRequestError, QueueFullError
from engine.model.backend import ForwardRow, ModelInfo, RowOutput, top_logprobs
from engine.model.capture import (
    CAPTURE_KWARG,
    AttentionCapture,
    CapturePlan,
    RowCapture,
    check_layer,
    ensure_attention_registered,
    hidden_states_index,
    split_rows,
)
from engine.model.devices import resolve_device, resolve_dtype
from engine.model.graphs import GraphKey, StaticDecode, batch_bucket, length_bucket
from engine.model.hook_names import resid_post
from engine.model.kv_blocks import KVBlocks
from engine.model.kv_cache import BatchCacheView, PagedKVCache, cache_argument
from engine.model.loading import load_model_and_tokenizer
from engine.model.masks import AttentionMasks
from engine.model.taps import taps_of

__all__ = ["HuggingFaceBackend"]


class HuggingFaceBackend:
    def __init__(self, config: BackendConfig | None = None) -> None:
        self.model: Any = None
        self.blocks: KVBlocks | None = None
        self._lock = threading.Lock()
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
        self._static_decode = self._graph_capture or mode in ("static", "compile")
        bs = config.kv_block_size
        max_blocks = -(-(config.kv_cache_tokens or config.max_batch * self._max_sequence) // bs) + 1  # + scratch
        # graphs hold the pool's addresses: a static pool is allocated whole, once
        blocks = max_blocks if self._static_decode else -(-config.max_batch * config.initial_cache_tokens // bs) + 1
        self.cache = PagedKVCache(num_layers=self.info.num_layers, kv_heads=self.info.num_key_value_heads,
                                  head_dim=head_dim, block_size=bs, blocks=blocks, max_blocks=max_blocks,
                                  dtype=self.dtype, device=self.device)
        rows_mb = config.prefix_cache_rows_mb
        self.blocks = KVBlocks(self.cache, rows_budget=None if rows_mb is None else rows_mb * 2**20)
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

    # ------------------------------------------------------------------------------------ blocks

    def acquire(self, request_id: str) -> None:
        with self._lock:
            if request_id in self.blocks:
                raise InvalidRequestError(f"request {request_id!r} already holds a block table",
                                          parameter="request_id", value=request_id)
            if len(self.blocks) >= self.max_batch:
                raise QueueFullError(f"all {self.max_batch} batch places are taken; wait for a request to finish")
            self.blocks.add(request_id)

    def release(self, request_id: str) -> None:
        """Free the request's blocks (cached prefix blocks stay indexed until evicted)."""
        with self._lock:
            self.blocks.remove(request_id)

    def reserve(self, request_id: str, tokens: int) -> bool:
        """Reserve KV blocks for ``tokens`` positions of the request; False: the pool's
        reservations are full, the request must wait (:mod:`engine.model.kv_blocks`)."""
        with self._lock:
            return self.blocks.reserve(request_id, tokens)

    def reuse_prefix(self, request_id: str, prompt: Sequence[int], plan: CapturePlan) -> tuple[int, Any] | None:
        """Before its first forward: the request starts from the longest cached prefix of
        ``prompt`` whose captured internals cover ``plan`` (a prompt's prefill plan). Returns the
        reused length and the :class:`~engine.model.capture.RowCapture` a forward of those tokens
        would have given, or None; either way the request's full blocks are cached from now on."""
        with self._lock:
            return self.blocks.lookup(request_id, prompt, plan)

    def cache_stats(self) -> dict[str, Any]:
        """Blocks used and free, and the prefix cache's hit rate (tokens reused / prompt tokens)."""
        with self._lock:
            return self.blocks.as_dict()

    # ----------------------------------------------------------------------------------- forward

    def forward(self, rows: Sequence[ForwardRow]) -> list[RowOutput]:
        """Decode rows (one token each) share one forward — a replayed graph when they fit one;
        every prefill-shaped row (a prompt, a forced chunk) shares another, left-padded."""
        outputs: list[RowOutput | None] = [None] * len(rows)
        for row in rows:
            if not row.tokens:
                raise InvalidRequestError(f"request {row.request_id!r} has no token to feed", parameter="tokens")
        for single in (True, False):
            group = [i for i, r in enumerate(rows) if (len(r.tokens) == 1) == single]
            if group:
                for i, out in zip(group, self._run([rows[i] for i in group])):
                    outputs[i] = out
        return outputs  # type: ignore[return-value]

    def _tables(self, rows: Sequence[ForwardRow]) -> list[list[int]]:
        """Each row's block table, with blocks for the positions it feeds (positions from its
        start on are forgotten first: a Backtrack is a position move)."""
        tables = []
        for row in rows:
            if row.request_id not in self.blocks:
                raise InvalidRequestError(f"request {row.request_id!r} holds no block table", parameter="request_id",
                                          value=row.request_id)
            tables.append(list(self.blocks.prepare(row.request_id, row.start, len(row.tokens))))
        return tables

    def _record(self, rows: Sequence[ForwardRow], outputs: Sequence[RowOutput]) -> None:
        for row, out in zip(rows, outputs):
            self.blocks.record(row.request_id, row.start, row.tokens, out.captured, row.steer is not None)

    def _static_fits(self, rows: Sequence[ForwardRow]) -> bool:
        """One-token rows, no steering: the static/graph decode path."""
        return self._static_decode and len(rows[0].tokens) == 1 and all(r.steer is None for r in rows)

    def _run_static(self, rows: Sequence[ForwardRow], tables: list[list[int]]) -> list[RowOutput]:
        plans = [r.plan for r in rows]
        hidden_layers = tuple(sorted({layer for p in plans for layer in p.hidden_layers}))
        attention_layers = tuple(sorted({layer for p in plans for layer in p.attention_layers}))
        starts = [r.start for r in rows]
        key = GraphKey(batch_bucket(len(rows), self.max_batch), length_bucket(max(starts) + 1, self._max_sequence),
                       hidden_layers, attention_layers)
        decode = self._graphs.get(key)
        if decode is None:
            decode = self._graphs[key] = StaticDecode(self.model, self.cache, key, capture=self._graph_capture,
                                                      pool=self._graph_pool, compile=self._compile_decode)
            self.graph_stats["graphs"] = len(self._graphs)
        out = decode.run([r.tokens[0] for r in rows], starts, tables)
        self.graph_stats["static_steps"] += 1
        outputs = []
        values, indices = out.top
        for b, row in enumerate(rows):
            end = row.start + 1
            plan = row.plan
            captured = RowCapture({layer: out.hidden[layer][b:b + 1] for layer in plan.hidden_layers},  # (1, d)
                                  {layer: out.patterns[layer][b][:, :, :end]  # (h, 1, kv)
                                   for layer in plan.attention_layers})
            outputs.append(RowOutput(out.logits[b], captured, (values[b], indices[b])))
        return outputs

    def _run(self, rows: Sequence[ForwardRow]) -> list[RowOutput]:
        """One forward of ``rows`` (each ``q_b`` tokens, left-padded to the longest)."""
        lengths = [len(r.tokens) for r in rows]
        starts = [r.start for r in rows]
        end = max(s + n for s, n in zip(starts, lengths))
        if end > self._max_sequence:
            raise ContextOverflowError(f"a request must fit {self._max_sequence} positions, needs {end}",
                                       parameter="max_sequence", value=end)
        with self._lock:
            tables = self._tables(rows)
        if self._static_fits(rows):
            with torch.inference_mode():
                outputs = self._run_static(rows, tables)
        else:
            outputs = self._run_eager(rows, tables)
        with self._lock:
            self._record(rows, outputs)
        return outputs

    def _run_eager(self, rows: Sequence[ForwardRow], tables: list[list[int]]) -> list[RowOutput]:
        lengths = [len(r.tokens) for r in rows]
        starts = [r.start for r in rows]
        self.graph_stats["eager_steps"] += 1
        q = max(lengths)
        view, positions = BatchCacheView.build(self.cache, tables, starts, lengths)  # positions (B, q)
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
        with torch.inference_mode(), self._steering(rows):
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                             logits_to_keep=1, **cache_argument(self.model, view), **kwargs)
        logits = out.logits[:, -1].float()  # (B, V): the last column is every row's newest real token
        values, indices = top_logprobs(logits)
        hidden_index = {layer: hidden_states_index(layer) for layer in hidden_layers}
        captured = split_rows(out, plans, capture, hidden_index, [s + n for s, n in zip(starts, lengths)], lengths)
        return [RowOutput(logits[b], captured[b], (values[b], indices[b])) for b in range(len(rows))]

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

    def capture(self, input_ids: Sequence[int], names: Sequence[str], *, out: Any = None) -> dict[str, Any]:
        from engine.model.named_capture import capture

        return capture(self._taps, input_ids, names, out=out, model_id=self.info.model_id)

    def shutdown(self) -> None:
        if self.blocks is not None:
            self.blocks.clear()
        self.model = self._taps = None
