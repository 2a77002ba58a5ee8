"""HuggingFaceBackend: a manual token loop over a transformers causal LM with a KV cache.

Never ``model.generate``: mods intervene between every forward pass. Each request owns a
``DynamicCache``; Backtrack uses the cache's own ``crop`` (built for assisted decoding), never
hand-sliced key/value tensors. The internals events carry come from :mod:`engine.model.capture`.

Shapes (``d`` hidden size, ``h`` query heads, ``q`` tokens fed in one forward, ``kv`` tokens in
context, ``V`` logits width): logits ``(V,)`` float32 per forward; hidden states ``(q, d)`` at
prefill and ``(1, d)`` per step; attention ``(h, q, kv)`` at prefill and ``(h, 1, kv)`` per step.
Tensors stay on the model's device; they reach the host only when a mod calls ``to_numpy()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mods.types import Added, ContextInfo, ForwardPass, Prefilled, Sampled

from engine.config import BackendConfig
from engine.model.devices import resolve_device, resolve_dtype
from engine.errors import ContextOverflowError, InvalidRequestError, TokenOutOfVocabularyError
from engine.model.capture import (
    Captured,
    CapturePlan,
    check_layer,
    ensure_attention_registered,
    forward_kwargs,
    read_captured,
)
from engine.model.loading import load_model_and_tokenizer
from engine.model.sampling import SamplingParams, make_generator, sample
from engine.model.tensor import TensorShim
from engine.model.backend import ForwardRecord, ModelInfo

__all__ = ["HuggingFaceBackend"]


@dataclass
class _Sequence:
    """One request's tokens, cache and the outputs of its newest forward pass."""

    tokens: list[int]
    cache: Any
    generator: torch.Generator
    cached: int = 0  # tokens whose keys/values are in ``cache``
    logits: torch.Tensor | None = None  # (V,) for the position after token ``cached - 1``
    captured: Captured = field(default_factory=Captured)
    record: ForwardRecord | None = None  # the newest forward, until the loop takes it


class HuggingFaceBackend:
    def __init__(self, config: BackendConfig | None = None) -> None:
        self._sequences: dict[str, _Sequence] = {}
        self.model: Any = None
        if config is not None:
            self.load_model(config.model_id, config)

    # ----------------------------------------------------------------------------------- loading

    def load_model(self, model_id: str, config: BackendConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        attn = ensure_attention_registered() if config.extract_attention else "sdpa"
        self.model, self._tokenizer = load_model_and_tokenizer(
            model_id, cache_dir=config.model_cache_dir, device=self.device, dtype=self.dtype,
            attn_implementation=attn, hf_token=config.hf_token,
        )
        mc = self.model.config
        self.layer = check_layer(config.hidden_state_layer, mc.num_hidden_layers)
        self.info = ModelInfo(
            model_id=model_id,
            vocab_size=int(self.model.get_output_embeddings().out_features),
            hidden_size=int(mc.hidden_size),
            num_layers=int(mc.num_hidden_layers),
            num_attention_heads=int(mc.num_attention_heads),
            num_key_value_heads=int(getattr(mc, "num_key_value_heads", mc.num_attention_heads)),
            max_context=int(getattr(mc, "max_position_embeddings", 0) or 2**31 - 1),
            eos_token_ids=self._eos_ids(),
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
        )
        self._extra_hidden_layers: tuple[int, ...] = ()

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
    def attention_implementation(self) -> str:
        return self.model.config._attn_implementation

    def set_capture(self, *, hidden_states: bool, attention: bool) -> None:
        """Switch what events carry without reloading: attention off returns every layer to plain SDPA."""
        self.config = dataclasses.replace(self.config, extract_hidden_states=hidden_states,
                                          extract_attention=attention)
        self.model.set_attn_implementation(ensure_attention_registered() if attention else "sdpa")

    def capture_hidden_layers(self, layers: Sequence[int]) -> None:
        """Also keep these layers' hidden states each forward (e.g. for an SAE on another layer)."""
        self._extra_hidden_layers = tuple(check_layer(layer, self.info.num_layers, parameter="layer")
                                          for layer in layers)
        # (records are kept only while someone asked for extra layers: nobody else takes them)

    def _plan(self, *, newest_row_only: bool) -> CapturePlan:
        hidden = tuple(dict.fromkeys(
            ((self.layer,) if self.config.extract_hidden_states else ()) + self._extra_hidden_layers))
        attention = self.layer if self.config.extract_attention else None
        return CapturePlan(hidden, attention, newest_row_only)

    # --------------------------------------------------------------------------------- requests

    def _check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        vocab = self.info.vocab_size
        out = [int(t) for t in ids]
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise TokenOutOfVocabularyError(
                f"`{what}` must hold token ids in [0, {vocab}), got {bad[:5]}", parameter=what, value=bad[:5])
        return out

    def _sequence(self, request_id: str) -> _Sequence:
        try:
            return self._sequences[request_id]
        except KeyError:
            raise InvalidRequestError(f"request {request_id!r} has no prefill on this backend",
                                      parameter="request_id", value=request_id) from None

    def _forward(self, seq: _Sequence, plan: CapturePlan) -> None:
        """Feed every token not yet in the cache; keep logits and internals of the newest."""
        start = seq.cached
        new = seq.tokens[start:]
        ids = torch.tensor([new], dtype=torch.long, device=self.device)  # (1, q)
        kwargs, capture = forward_kwargs(plan)
        with torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=seq.cache, use_cache=True, logits_to_keep=1, **kwargs)
        seq.cached = len(seq.tokens)
        seq.logits = out.logits[0, -1].float()  # (V,)
        seq.captured = read_captured(out, plan, capture)
        seq.record = ForwardRecord(start, tuple(new), seq.captured.hidden) if self._extra_hidden_layers else None

    def _shim(self, tensor: torch.Tensor | None) -> TensorShim | None:
        return TensorShim(tensor) if tensor is not None else None

    def prefill(self, request_id: str, input_ids: Sequence[int], max_steps: int, *,
                context_info: Any = None, seed: int | None = None) -> Prefilled:
        from transformers import DynamicCache

        ids = self._check_ids(input_ids, "input_ids")
        if not ids:
            raise InvalidRequestError("the prompt must hold at least one token", parameter="input_ids", value=[])
        if len(ids) >= self.info.max_context:
            raise ContextOverflowError(
                f"the prompt must be shorter than the model's context of {self.info.max_context} tokens, "
                f"got {len(ids)}; shorten it", parameter="input_ids", value=len(ids))
        previous = self._sequences.get(request_id)
        generator = previous.generator if previous is not None else make_generator(seed, self.device)
        seq = _Sequence(ids, DynamicCache(config=self.model.config), generator)
        self._sequences[request_id] = seq
        self._forward(seq, self._plan(newest_row_only=False))
        hidden = seq.captured.hidden.get(self.layer)
        return Prefilled(
            request_id, 0, max_steps,
            context_info if context_info is not None else ContextInfo(request_id, ids, max_steps),
            hidden_states=self._shim(hidden),  # (seq, d)
            attention_patterns=self._shim(seq.captured.attention),  # (h, seq, seq)
            layer=self.layer,
            input_ids=list(ids),
        )

    def forward_pass(self, request_id: str, step: int) -> ForwardPass:
        seq = self._sequence(request_id)
        if seq.cached < len(seq.tokens) or seq.logits is None:
            self._forward(seq, self._plan(newest_row_only=True))
        hidden = seq.captured.hidden.get(self.layer)
        attention = seq.captured.attention
        return ForwardPass(
            request_id, step, TensorShim(seq.logits[None, :]),  # (1, V)
            hidden_states=self._shim(hidden[-1:] if hidden is not None else None),  # (1, d)
            attention_patterns=self._shim(attention[:, -1:, :] if attention is not None else None),  # (h, 1, kv)
            layer=self.layer,
            input_ids=list(seq.tokens),
        )

    def sample(self, request_id: str, step: int, logits: Any, params: SamplingParams) -> Sampled:
        seq = self._sequence(request_id)
        tensor = logits.tensor if isinstance(logits, TensorShim) else logits
        return Sampled(request_id, step, sample(tensor, params, seq.generator))

    def add_token(self, request_id: str, step: int, tokens: Sequence[int], forced: bool) -> Added:
        seq = self._sequence(request_id)
        ids = self._check_ids(tokens, "tokens")
        seq.tokens.extend(ids)
        return Added(request_id, step, ids, forced)

    def rewind_kv_cache(self, request_id: str, n: int) -> None:
        """Drop the newest ``n`` tokens; the next forward re-feeds the last kept token if needed."""
        seq = self._sequence(request_id)
        if n <= 0:
            return
        if n >= len(seq.tokens):
            raise InvalidRequestError(f"cannot rewind {n} tokens of a {len(seq.tokens)}-token sequence",
                                      parameter="n", value=n)
        del seq.tokens[-n:]
        keep = len(seq.tokens)
        if seq.cached > keep:  # keep keys/values of all but the last kept token, which is fed again
            seq.cache.crop(-(seq.cached - (keep - 1)))
            seq.cached = keep - 1
            seq.logits = None

    def sequence_length(self, request_id: str) -> int:
        return len(self._sequence(request_id).tokens)

    def get_hidden_states(self, request_id: str, layer: int) -> TensorShim | None:
        """Hidden states of the newest forward at ``layer``: ``(seq, d)`` after prefill, ``(1, d)`` after a step."""
        return self._shim(self._sequence(request_id).captured.hidden.get(layer))

    def get_attention_patterns(self, request_id: str, layer: int) -> TensorShim | None:
        if layer != self.layer:
            return None
        return self._shim(self._sequence(request_id).captured.attention)

    def take_forward_record(self, request_id: str) -> ForwardRecord | None:
        seq = self._sequence(request_id)
        record, seq.record = seq.record, None
        return record

    def release(self, request_id: str) -> None:
        self._sequences.pop(request_id, None)

    def shutdown(self) -> None:
        self._sequences.clear()
        self.model = None
