"""The attention masks a forward over the paged KV cache hands the model: causal per row, and
sliding-window where a layer slides.

The backend reads every row's keys from position 0 to the batch's longest context (the
``(B, kv_heads, kv, hd)`` view of :mod:`engine.model.kv_cache`) and passes a ready 4-D boolean mask
``(B, 1, q, kv)``: True where query ``q`` (at its own position) may attend key position ``kv``.
transformers uses a ready 4-D mask as it is, for *every* layer — so a sliding-window layer
(Mistral's every layer, Gemma 2/3's alternate layers, Qwen2's upper layers when configured) would
silently see the whole context. Hence one mask per kind of layer:

* causal: ``key ≤ query``;
* sliding (window ``w``): ``query - w < key ≤ query``, transformers' own definition
  (``masking_utils.sliding_window_overlay``), so a layer sees ``w`` positions itself included.

How the model takes them is its family's (:mod:`engine.model.families`): models whose layers mix
kinds take a dict keyed by layer type (``{"full_attention": …, "sliding_attention": …}``, which
Qwen2/3 and Gemma 2/3 accept in place of a mask and index by ``config.layer_types``); the others
take one tensor, sliding for every layer when the config has a ``sliding_window`` (Mistral).
Padding columns (position 0) see key 0 only, so no query row is all -inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import UnsupportedModelError
from engine.model.families import Family, family_of

__all__ = ["AttentionMasks", "layer_windows"]

_FULL, _SLIDING = "full_attention", "sliding_attention"


def layer_windows(config: Any, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention), from the model config."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        return [int(window) if window else None] * num_layers
    unknown = sorted(set(types) - {_FULL, _SLIDING})
    if unknown:
        raise UnsupportedModelError(f"layer types must be {_FULL} or {_SLIDING}, got {unknown}; raylens builds "
                                    "causal and sliding-window masks only", parameter="model", value=unknown)
    sliding = int(window) if window else None
    if sliding is None and _SLIDING in types:
        raise UnsupportedModelError(f"the model's config has {_SLIDING} layers but no sliding_window ({window!r}); "
                                    "set sliding_window in its config.json", parameter="model", value=window)
    return [sliding if t == _SLIDING else None for t in types]


@dataclass(frozen=True)
class AttentionMasks:
    """How to build the masks of one loaded model; :meth:`build` runs per forward (inside a
    captured CUDA graph too: tensor operations only, nothing read back to the host)."""

    by_layer_type: tuple[tuple[str, int | None], ...] | None  # (layer type, window) when the model takes a dict
    window: int | None  # the one mask's window otherwise

    @classmethod
    def of(cls, model: Any, family: Family | None = None) -> "AttentionMasks":
        family = family or family_of(model)
        config = model.config
        windows = layer_windows(config, int(config.num_hidden_layers))
        if family.masks == "by_layer_type" and getattr(config, "layer_types", None) is not None:
            kinds = dict(zip(config.layer_types, windows))
            return cls(tuple(sorted(kinds.items())), None)
        if len(set(windows)) > 1:
            raise UnsupportedModelError(f"a {family.label} model must use one attention window for every layer "
                                        f"(it takes one mask), got {sorted(set(windows), key=str)}",
                                        parameter="model", value=sorted(set(windows), key=str))
        return cls(None, windows[0] if windows else None)

    def build(self, key_positions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """``key_positions (kv,)``, every row's query ``positions (B, q)`` → the mask
        ``(B, 1, q, kv)`` boolean, or ``{layer type: mask}``."""
        if self.by_layer_type is None:
            return _mask(key_positions, positions, self.window)
        return {kind: _mask(key_positions, positions, window) for kind, window in self.by_layer_type}

    @property
    def slides(self) -> bool:
        """Whether some layer attends through a sliding window."""
        windows = [w for _, w in self.by_layer_type] if self.by_layer_type is not None else [self.window]
        return any(w is not None for w in windows)


def _mask(key_positions: torch.Tensor, positions: torch.Tensor, window: int | None) -> torch.Tensor:
    keys, queries = key_positions[None, None, None, :], positions[:, None, :, None]
    allowed = keys <= queries  # (B, 1, q, kv): causal per row
    if window is not None:
        allowed = allowed & (keys > queries - window)
    return allowed
