"""Every model internal raylens exposes, named in one place.

Hidden states
    transformers numbers hidden states from the embedding output: ``hidden_states[0]`` is the
    input of layer 0 and ``hidden_states[layer + 1]`` the residual stream after ``layer``
    (for the last layer, after the final norm — transformers ties it to ``last_hidden_state``).
    :func:`hidden_states_index` is the only place that ``+ 1`` is written. We ask transformers
    for just the indices we need (``output_hidden_states=[i, ...]``), so the other layers'
    activations are not kept; its capture hooks are context-local and thread safe.

Attention patterns
    Fast kernels (SDPA, flash) never materialise the softmax, and ``output_attentions=True``
    would force the slow eager path on *every* layer. Instead the model runs with
    :data:`ATTENTION_IMPLEMENTATION`, registered through transformers' ``AttentionInterface``:
    every layer calls SDPA as usual, and only the layer named by the
    :class:`AttentionCapture` passed in the forward's kwargs also computes its post-softmax
    pattern from the post-RoPE query and the cached keys it was handed — for decode steps only the
    newest query row, ``(heads, 1, seq)``. No module hook is involved, so concurrent forwards
    cannot see each other's captures. With attention extraction off the model uses plain
    ``"sdpa"`` and pays nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import LayerOutOfRangeError

__all__ = [
    "CapturePlan",
    "AttentionCapture",
    "Captured",
    "ATTENTION_IMPLEMENTATION",
    "check_layer",
    "hidden_states_index",
    "attention_pattern",
    "ensure_attention_registered",
    "forward_kwargs",
    "read_captured",
]

ATTENTION_IMPLEMENTATION = "raylens_sdpa"
_CAPTURE_KWARG = "raylens_attention"


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
    """Which internals one forward pass must keep."""

    hidden_layers: tuple[int, ...] = ()
    attention_layer: int | None = None
    newest_row_only: bool = True  # attention: the newest query row only (decode) or every row (prefill)


@dataclass
class AttentionCapture:
    """The sink one forward pass hands to the attention function of one layer."""

    layer: int
    newest_row_only: bool
    pattern: torch.Tensor | None = None  # (heads, q, kv) float32


@dataclass(frozen=True)
class Captured:
    """Internals of one forward pass, batch dimension removed.

    ``hidden[layer]``: ``(q, d)`` for the ``q`` tokens fed; ``attention``: ``(heads, q, kv)``
    (``q = 1`` when only the newest row was asked for).
    """

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    attention: torch.Tensor | None = None


def attention_pattern(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    kv_groups: int,
    newest_row_only: bool,
) -> torch.Tensor:
    """Post-softmax attention ``(heads, q, kv)`` from ``query (1, heads, q, hd)`` and
    ``key (1, kv_heads, kv, hd)``; GQA key heads are repeated to the query heads, as eager does."""
    if newest_row_only:
        query = query[:, :, -1:, :]
        if attention_mask is not None:
            attention_mask = attention_mask[..., -1:, :]
    keys = key.repeat_interleave(kv_groups, dim=1) if kv_groups > 1 else key
    scores = torch.matmul(query.float(), keys.float().transpose(2, 3)) * scaling  # (1, h, q, kv)
    q_len, kv_len = scores.shape[-2], scores.shape[-1]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.float()
    elif q_len > 1:  # SDPA got no mask because the chunk is plainly causal
        query_pos = torch.arange(kv_len - q_len, kv_len, device=scores.device)[:, None]
        key_pos = torch.arange(kv_len, device=scores.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    return torch.softmax(scores, dim=-1)[0]


def _capture_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, **kwargs: Any):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    capture: AttentionCapture | None = kwargs.pop(_CAPTURE_KWARG, None)
    if capture is not None and module.layer_idx == capture.layer:
        capture.pattern = attention_pattern(
            query, key, attention_mask, scaling if scaling is not None else module.scaling,
            module.num_key_value_groups, capture.newest_row_only,
        )
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


_register_lock = threading.Lock()


def ensure_attention_registered() -> str:
    """Register :data:`ATTENTION_IMPLEMENTATION` with transformers (idempotent); return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    with _register_lock:
        AttentionInterface.register(ATTENTION_IMPLEMENTATION, _capture_attention_forward)
        AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, sdpa_mask)
    return ATTENTION_IMPLEMENTATION


def forward_kwargs(plan: CapturePlan) -> tuple[dict[str, Any], AttentionCapture | None]:
    """Keyword arguments for ``model(...)`` that capture what ``plan`` asks for."""
    kwargs: dict[str, Any] = {}
    if plan.hidden_layers:
        kwargs["output_hidden_states"] = [hidden_states_index(layer) for layer in plan.hidden_layers]
    capture = None
    if plan.attention_layer is not None:
        capture = AttentionCapture(plan.attention_layer, plan.newest_row_only)
        kwargs[_CAPTURE_KWARG] = capture
    return kwargs, capture


def read_captured(outputs: Any, plan: CapturePlan, capture: AttentionCapture | None) -> Captured:
    """Every fed token's hidden states (an SAE needs all of a forced chunk); events slice the newest."""
    hidden = {layer: outputs.hidden_states[hidden_states_index(layer)][0] for layer in plan.hidden_layers}  # (q, d)
    return Captured(hidden, capture.pattern if capture is not None else None)


def residual_stream(model: Any, input_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The residual stream after ``layer`` for ``input_ids (B, T)`` → ``(B, T, d)``, running only
    layers ``0..layer`` (for collecting SAE training data: the layers above are never computed).

    Equals ``model(..., output_hidden_states=True).hidden_states[hidden_states_index(layer)]`` for
    full, unpadded causal sequences; the last layer's entry (which transformers ties to the
    normed output) is not offered.
    """
    inner = model.model
    check_layer(layer, len(inner.layers) - 1, parameter="layer")
    if model.config._attn_implementation == "eager":  # eager would need an explicit causal mask
        raise ValueError("residual_stream needs an SDPA-family attention implementation, not eager")
    hidden = inner.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    position_embeddings = inner.rotary_emb(hidden, position_ids=positions)
    for block in inner.layers[: layer + 1]:  # attention_mask None + no cache: SDPA runs plainly causal
        hidden = block(hidden, attention_mask=None, position_embeddings=position_embeddings, position_ids=positions)
    return hidden
