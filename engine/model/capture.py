"""Every model internal a step forward exposes, captured through one plan keyed by name.

Consumers subscribe by name in the TransformerLens vocabulary (:mod:`engine.model.hook_names`):
mod events take ``blocks.{L}.hook_resid_post`` and ``blocks.{L}.attn.hook_pattern`` of the
configured layer, the SAE hand-off takes ``blocks.{S}.hook_resid_post`` of its SAE's layer, a
streaming client may take every layer's pattern. A request's :class:`CapturePlan` is the union of
its subscriptions; a batched forward honours each row's plan and hands each row back only its own
tensors (:class:`RowCapture`).

Hidden states
    transformers numbers hidden states from the embedding output: ``hidden_states[0]`` is the
    input of layer 0 and ``hidden_states[layer + 1]`` the residual stream after ``layer`` (for the
    last layer, after the final norm — transformers ties it to ``last_hidden_state``).
    :func:`hidden_states_index` is the only place that ``+ 1`` is written. We ask transformers for
    just the indices some row needs (``output_hidden_states=[i, ...]``).

Attention patterns
    Fast kernels (SDPA, flash) never materialise the softmax, and ``output_attentions=True`` would
    force the slow eager path on *every* layer. Instead the model runs with
    :data:`ATTENTION_IMPLEMENTATION`, registered through transformers' ``AttentionInterface``:
    every layer calls SDPA as usual (a soft-capped layer, Gemma 2's, computes eager attention's
    arithmetic instead: no SDPA kernel soft-caps), and a layer some row asked for also computes
    the post-softmax pattern of just those rows from their post-RoPE queries and cached keys —
    for decode steps only the newest query row, ``(heads, 1, kv)``. No module hook is involved, so concurrent forwards
    cannot see each other's captures; with nothing asked, the wrapper costs one dict lookup.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from engine.errors import InvalidRequestError, LayerOutOfRangeError
from engine.model.hook_names import HookName, attn_pattern, parse_hook_name, resid_post
from engine.model.paged_attention import PAGED_KWARG

__all__ = [
    "CapturePlan",
    "RowCapture",
    "AttentionCapture",
    "ATTENTION_IMPLEMENTATION",
    "check_layer",
    "hidden_states_index",
    "attention_pattern",
    "ensure_attention_registered",
    "residual_stream",
]

# Not "…sdpa…": transformers checks any implementation so named against the model's SDPA support,
# and Gemma 2 (soft-capped attention) declares none; ours runs soft-capping eagerly itself.
ATTENTION_IMPLEMENTATION = "raylens_capture"
CAPTURE_KWARG = "raylens_attention"
_STEP_HOOKS = ("hook_resid_post", "attn.hook_pattern")


def check_layer(layer: int, num_layers: int, *, parameter: str = "hidden_state_layer") -> int:
    if not 0 <= layer < num_layers:
        raise LayerOutOfRangeError(
            f"`{parameter}` must be in [0, {num_layers - 1}] for this model ({num_layers} layers), got {layer}",
            parameter=parameter,
            value=layer,
        )
    return layer


def hidden_states_index(layer: int) -> int:
    """Index into transformers' ``hidden_states`` tuple of the output of ``layer``."""
    return layer + 1


@dataclass(frozen=True)
class CapturePlan:
    """The internals one request wants from each of its forwards, by name.

    A step forward serves ``blocks.{L}.hook_resid_post`` (every fed token's residual stream after
    layer L, ``(q, d)``) and ``blocks.{L}.attn.hook_pattern`` (``(heads, q', kv)``: every fed
    query row when ``all_query_rows``, as at prefill, else the newest only). Full dumps of every
    other internal are :mod:`engine.model.named_capture`'s job.
    """

    names: frozenset[HookName] = frozenset()
    all_query_rows: bool = False

    @classmethod
    def of(cls, names: Iterable[HookName | str], num_layers: int, *, all_query_rows: bool = False) -> "CapturePlan":
        parsed = []
        for name in names:
            hook = parse_hook_name(name) if isinstance(name, str) else name
            if hook.hook not in _STEP_HOOKS:
                raise InvalidRequestError(
                    f"`{hook}` cannot be captured on every step; a step captures "
                    f"{' and '.join('blocks.<L>.' + h for h in _STEP_HOOKS)} (use Engine.capture for the rest)",
                    parameter="names", value=str(hook))
            check_layer(hook.layer, num_layers, parameter="layer")  # type: ignore[arg-type]
            parsed.append(hook)
        return cls(frozenset(parsed), all_query_rows)

    def union(self, other: "CapturePlan") -> "CapturePlan":
        return CapturePlan(self.names | other.names, self.all_query_rows or other.all_query_rows)

    def with_all_query_rows(self, value: bool) -> "CapturePlan":
        return CapturePlan(self.names, value)

    # read for every row of every forward (a request's plans are made once, when it is submitted):
    # found once per plan, not sorted again at each read (~0.45 µs each, four a request-step)
    @functools.cached_property
    def hidden_layers(self) -> tuple[int, ...]:
        return tuple(sorted(n.layer for n in self.names if n.hook == "hook_resid_post"))  # type: ignore[misc]

    @functools.cached_property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(sorted(n.layer for n in self.names if n.hook == "attn.hook_pattern"))  # type: ignore[misc]

    def __bool__(self) -> bool:
        return bool(self.names)


def event_plan(layer: int, *, hidden_states: bool, attention: bool) -> frozenset[HookName]:
    """The names mod events carry: the configured layer's residual stream and attention."""
    return frozenset(([resid_post(layer)] if hidden_states else []) + ([attn_pattern(layer)] if attention else []))


@dataclass(frozen=True)
class RowCapture:
    """One row's internals from one forward, batch dimension removed.

    ``hidden[L]``: ``(q, d)`` for the ``q`` tokens fed; ``attention[L]``: ``(heads, q', kv)``
    with ``kv`` this request's own context length (``q' = 1`` for the newest row only).
    """

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: dict[int, torch.Tensor] = field(default_factory=dict)

    def by_name(self) -> dict[str, torch.Tensor]:
        out = {str(resid_post(layer)): t for layer, t in self.hidden.items()}
        out.update({str(attn_pattern(layer)): t for layer, t in self.attention.items()})
        return out


@dataclass
class AttentionCapture:
    """The sink one batched forward hands the attention function: which rows want which layer's
    pattern, and the patterns it computed (``layer → (rows, heads, q', kv)``)."""

    rows_for_layer: dict[int, list[int]]
    batch_size: int
    all_query_rows: bool
    patterns: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def for_rows(cls, plans: Sequence[CapturePlan]) -> "AttentionCapture | None":
        rows: dict[int, list[int]] = {}
        for row, plan in enumerate(plans):
            for layer in plan.attention_layers:
                rows.setdefault(layer, []).append(row)
        if not rows:
            return None
        return cls(rows, len(plans), any(p.all_query_rows for p in plans))


def attention_pattern(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    kv_groups: int,
    newest_row_only: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """Post-softmax attention ``(B, heads, q, kv)`` from ``query (B, heads, q, hd)`` and
    ``key (B, kv_heads, kv, hd)``; GQA key heads are repeated to the query heads, as eager does.
    ``attention_mask``: ``(B, 1, q, kv)`` boolean (True = may attend) or additive float.
    ``softcap``: Gemma 2's attention logit soft-capping, ``softcap · tanh(scores / softcap)``
    before the mask, as its eager attention does."""
    if newest_row_only:
        query = query[:, :, -1:, :]
        if attention_mask is not None:
            attention_mask = attention_mask[..., -1:, :]
    keys = key.repeat_interleave(kv_groups, dim=1) if kv_groups > 1 else key
    scores = torch.matmul(query.float(), keys.float().transpose(2, 3)) * scaling  # (B, h, q, kv)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_len, kv_len = scores.shape[-2], scores.shape[-1]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.float()
    elif q_len > 1:  # no mask: the chunk is plainly causal
        query_pos = torch.arange(kv_len - q_len, kv_len, device=scores.device)[:, None]
        key_pos = torch.arange(kv_len, device=scores.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return torch.softmax(scores, dim=-1)


def _capture_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, **kwargs: Any):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    capture: AttentionCapture | None = kwargs.pop(CAPTURE_KWARG, None)
    paged = kwargs.pop(PAGED_KWARG, None)  # key/value are then the layer's whole pool (engine/model/paged_attention.py)
    softcap: float | None = kwargs.pop("softcap", None)
    # the mask we (or transformers' mask functions) built carries the window; a paged kernel takes it itself
    sliding_window = kwargs.pop("sliding_window", None)
    scale = scaling if scaling is not None else module.scaling
    groups = getattr(module, "num_key_value_groups", 1)  # GPT-2 and GPT-NeoX have no grouped heads
    if capture is not None:
        rows = capture.rows_for_layer.get(module.layer_idx)
        if rows:
            every = len(rows) == capture.batch_size
            index = None if every else torch.tensor(rows, device=query.device)
            pick = (lambda t: t) if every else (lambda t: t.index_select(0, index))
            keys = key if paged is None else paged.gathered(key)  # (B, g, kv, hd): this layer's rows only
            capture.patterns[module.layer_idx] = attention_pattern(
                pick(query), pick(keys), pick(attention_mask) if attention_mask is not None else None,
                scale, groups, newest_row_only=not capture.all_query_rows, softcap=softcap,
            )
    if paged is not None:
        return paged.attend(query, key, value, scale, sliding_window), None
    if softcap is not None:
        return _softcapped_attention(query, key, value, attention_mask, scale, groups, softcap)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


def _softcapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float, groups: int,
                          softcap: float) -> tuple[torch.Tensor, None]:
    """Gemma 2's attention with logit soft-capping, which no SDPA kernel does: its eager
    attention's arithmetic (scores in the model dtype, softmax in float32) on ``query (B, h, q,
    hd)``, ``key``/``value (B, g, kv, hd)`` → ``(B, q, h, hd)``, what the attention interface
    returns."""
    keys = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    values = value.repeat_interleave(groups, dim=1) if groups > 1 else value
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling  # (B, h, q, kv)
    scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None and scores.shape[-2] > 1:  # transformers skipped a plainly causal mask
        q_len, kv_len = scores.shape[-2], scores.shape[-1]
        query_pos = torch.arange(kv_len - q_len, kv_len, device=scores.device)[:, None]
        attention_mask = torch.arange(kv_len, device=scores.device)[None, :] <= query_pos  # (q, kv)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), None


_register_lock = threading.Lock()


def ensure_attention_registered() -> str:
    """Register :data:`ATTENTION_IMPLEMENTATION` with transformers (idempotent); return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    with _register_lock:
        AttentionInterface.register(ATTENTION_IMPLEMENTATION, _capture_attention_forward)
        AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
    return ATTENTION_IMPLEMENTATION


def split_rows(outputs: Any, plans: Sequence[CapturePlan], capture: AttentionCapture | None,
               hidden_index: dict[int, int], contexts: Sequence[int], lengths: Sequence[int]) -> list[RowCapture]:
    """Each row's own internals from a left-padded batch: its ``lengths[row]`` real tokens are the
    last columns. Hidden layers ``(q, d)``; patterns cut to the row's own query rows (all of them
    when its plan asks, else the newest) and its own context length ``contexts[row]``."""
    q = max(lengths)
    rows = []
    taken = {layer: 0 for layer in (capture.rows_for_layer if capture else {})}
    for row, plan in enumerate(plans):
        first = q - lengths[row]
        hidden = {layer: outputs.hidden_states[hidden_index[layer]][row, first:] for layer in plan.hidden_layers}
        attention = {}
        for layer in plan.attention_layers:
            pattern = capture.patterns[layer][taken[layer]]  # type: ignore[union-attr]  # (h, q or 1, kv)
            taken[layer] += 1
            if pattern.shape[1] > 1:
                pattern = pattern[:, first:] if plan.all_query_rows else pattern[:, -1:]
            attention[layer] = pattern[:, :, : contexts[row]]
        rows.append(RowCapture(hidden, attention))
    return rows


def residual_stream(model: Any, input_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The residual stream after ``layer`` (``blocks.{layer}.hook_resid_post``) for
    ``input_ids (B, T)`` → ``(B, T, d)``, running only layers ``0..layer`` (SAE training data: the
    layers above are never computed). Read through the model's taps table
    (:meth:`engine.model.taps.Taps.collect`); ``model`` is the model or its table.

    Equals ``model(..., output_hidden_states=True).hidden_states[hidden_states_index(layer)]`` for
    full, unpadded causal sequences (for the last layer: before the final norm, which
    transformers' last entry has already applied).
    """
    from engine.model.taps import taps_of  # taps builds on this module's attention_pattern

    taps = taps_of(model)
    name = resid_post(check_layer(layer, taps.num_layers, parameter="layer"))
    return taps.collect(input_ids, [name])[name]
