"""The events a request's mods, listeners and result see, built from a forward's output: what each
field holds and its shape (``mods/types.py`` documents them for mods). Tensors are read-only
views of the engine's own; logits are a view of the batch's row made when first read."""

from __future__ import annotations

import copy
from typing import Any, Sequence

import numpy as np
import torch

from engine.model.backend import RowOutput
from engine.model.capture import RowCapture
from engine.model.tensor import ReleasedLogits, TensorShim, logits_dims, released
from mods.types import ContextInfo, ForwardPass, Prefilled, SAEFeatures

__all__ = ["prefilled_event", "forward_event", "released_logits", "attention_rows", "all_features", "newest_row",
           "features_of"]


def prefilled_event(request_id: str, prompt_ids: list[int], max_tokens: int, output: RowOutput, layer: int,
                    features: SAEFeatures | None) -> Prefilled:
    """The prompt is in: its every token's hidden state ``(prompt_len, d)`` and attention
    ``(h, prompt_len, prompt_len)`` at ``layer``, and its SAE features ``(prompt_len, k)``."""
    captured = output.captured
    ids = list(prompt_ids)
    return Prefilled(
        request_id, 0, max_tokens, ContextInfo(request_id, ids, max_tokens),
        hidden_states=_shim(captured.hidden.get(layer)),  # (prompt_len, d)
        attention_patterns=_shim(captured.attention.get(layer)),  # (h, prompt_len, prompt_len)
        layer=layer,
        input_ids=ids,
        sae_features=features,  # (prompt_len, k)
    )


def forward_event(request_id: str, step: int, output: RowOutput | RowCapture, layer: int, input_ids: Sequence[int],
                  features: SAEFeatures | None, host: Any = None, logits: Any = None) -> ForwardPass:
    """A step's forward: logits ``(1, V)`` (``host``: the step's host copy its mods read), the
    newest token's hidden state ``(1, d)`` and attention row ``(h, 1, kv)`` at ``layer``.
    ``logits`` given (a result's :class:`~engine.model.tensor.ReleasedLogits`): ``output`` may be
    the row's captured internals alone."""
    captured = output if isinstance(output, RowCapture) else output.captured
    hidden = captured.hidden.get(layer)
    attention = captured.attention.get(layer)
    if logits is None:
        assert not isinstance(output, RowCapture)  # internal invariant: internals alone come with released logits
        logits = _logits_shim(output, host)
    return ForwardPass(
        request_id, step, logits,  # (1, V)
        hidden_states=_shim(hidden if hidden is None or hidden.shape[0] == 1 else hidden[-1:]),  # (1, d)
        attention_patterns=_shim(attention if attention is None or attention.shape[1] == 1
                                 else attention[:, -1:, :]),  # (h, 1, kv)
        layer=layer,
        input_ids=input_ids,
        sae_features=features,  # (k,)
    )


def released_logits(event: Any, step: int | None = None, shape: tuple[int, ...] | None = None) -> Any:
    """A copy of ``event`` (a ForwardPass, or an AdjustedLogits of step ``step``) for a result
    that does not keep logits: the same fields, its logits a :class:`ReleasedLogits`. The mods
    and listeners that received ``event`` itself keep what they hold. ``shape``: the logits'
    shape when the caller knows it (a ForwardPass's row is ``(1, V)``), else read from them."""
    try:  # a plain object's shallow copy, at a third of copy.copy's cost (one per request-step)
        kept = object.__new__(type(event))
        kept.__dict__.update(event.__dict__)
    except (TypeError, AttributeError):  # an action class without a __dict__
        kept = copy.copy(event)
    if shape is None:
        shape = logits_dims(event.logits) or ()
    step = step if step is not None else event.step
    shape = shape if type(shape) is tuple else tuple(shape)
    kept.logits = released(shape, step) if type(step) is int else ReleasedLogits(shape, step)
    return kept


def all_features(encoded: Any) -> SAEFeatures | None:
    """Every row of an inline SAE encoding (``(rows, k)``), as the SDK's numpy object."""
    if encoded is None:
        return None
    return SAEFeatures(encoded.indices.cpu().numpy(), encoded.values.float().cpu().numpy(), encoded.release,
                       encoded.layer)


def newest_row(encoded: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """``(encoded, indices (k,), values (k,))``: the newest row's host copy, to share between readers."""
    return encoded, encoded.indices[-1].cpu().numpy(), encoded.values[-1].float().cpu().numpy()


def features_of(newest: tuple[Any, np.ndarray, np.ndarray]) -> SAEFeatures:
    """A reader's own :class:`SAEFeatures` of a shared newest row (a mod may write into it)."""
    encoded, indices, values = newest
    return SAEFeatures(indices.copy(), values.copy(), encoded.release, encoded.layer)


def attention_rows(output: RowOutput) -> np.ndarray:
    """``(layers, heads, context)`` float32 host copy of the newest attention row of every layer."""
    attention = output.captured.attention
    rows = [attention[layer][:, -1, :] for layer in sorted(attention)]
    return torch.stack(rows).float().cpu().numpy()


def _logits_shim(output: RowOutput, host: Any) -> TensorShim:
    """``(1, V)`` read-only logits of the newest forward: a view of the batch's row, made when a
    reader first asks for it; ``host``: the step's host copy its mods read (``to_numpy``)."""
    source = output.source
    if source is None:
        return TensorShim(output.logits[None, :], readonly=True)
    batch, index = source
    return TensorShim.row(batch, index, host)


def _shim(tensor: torch.Tensor | None) -> TensorShim | None:
    return TensorShim(tensor, readonly=True) if tensor is not None else None
