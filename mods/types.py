"""Mod events and actions: the contract between the generation loop and mods.

This module is what legacy mods import as ``shared.types``. The classes keep the shape of the
original SDK: plain mutable classes, public attributes, no dataclasses, no slots,
no custom equality, because existing mods and the loop set attributes on them freely
(``_source``, ``_mod_logs``) and validation looks classes up by exact type.

New in raylens: the event classes themselves (never subclasses, which the exact-type validation
table would reject) carry the model's internals as optional keyword-only fields that default to
``None``. They live in memory for mods only and never enter the ingest payload.

Shapes (``d`` = hidden size, ``h`` = query heads, ``seq`` = tokens in context, ``V`` = logits
width), all set by the backend at the configured layer:

==================  =======================  =======================
field               Prefilled                ForwardPass
==================  =======================  =======================
hidden_states       ``(seq, d)``             ``(1, d)`` newest token
attention_patterns  ``(h, seq, seq)``        ``(h, 1, seq)`` newest row
layer               configured layer index   same
input_ids           prompt ids (a list)      full sequence so far
==================  =======================  =======================

``ForwardPass.input_ids`` is a read-only sequence (:class:`mods.token_ids.TokenIds`, a view of the
request's ids made in O(1) a step) that reads like a list: ``len``, indexing, slices, iteration,
``==`` with a list; ``list(event.input_ids)`` is a list of its own.

``ForwardPass.logits`` is a tensor whose ``to_numpy()`` is float32 ``[1, V]``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = [
    "ModEvent",
    "Prefilled",
    "ForwardPass",
    "Sampled",
    "Added",
    "ContextInfo",
    "ModAction",
    "Noop",
    "AdjustedPrefill",
    "ForceTokens",
    "AdjustedLogits",
    "ForceOutput",
    "ToolCalls",
    "Backtrack",
    # EmitError is importable by name but, as in the original, not part of __all__.
]


def _top_k_logprob(logits: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k log-probabilities per row of ``logits.to_numpy()`` ``[B, V]``.

    Returns ``(logprobs [B, k], indices [B, k])`` sorted descending within each row.
    A 1-D input raises (there is no axis 1), as does ``k > V``.
    """
    arr = np.asarray(logits.to_numpy(), dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"logits must be 2-D [batch, vocab], got shape {arr.shape}")
    vocab = arr.shape[1]
    if not 0 < k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}], got {k}")
    shifted = arr - arr.max(axis=1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    part = np.argpartition(-logprobs, k - 1, axis=1)[:, :k]
    part_lp = np.take_along_axis(logprobs, part, axis=1)
    order = np.argsort(-part_lp, axis=1, kind="stable")
    indices = np.take_along_axis(part, order, axis=1)
    return np.take_along_axis(logprobs, indices, axis=1), indices


def _shape_of(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return "None" if value is None else f"shape={tuple(shape)}" if shape is not None else type(value).__name__


# --------------------------------------------------------------------------------------- events


class ModEvent:
    """Base class of the four events. ``request_id`` and ``step`` are always set."""

    request_id: str
    step: int

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={_short(v)}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


def _short(value: Any) -> str:
    if hasattr(value, "shape") and not isinstance(value, (int, float)):
        return _shape_of(value)
    if isinstance(value, list) and len(value) > 12:
        return f"[{', '.join(map(str, value[:12]))}, … {len(value)} items]"
    return repr(value)


class ContextInfo:
    """What ``Prefilled.context_info`` carries (listed in ``docs/generation-rules.md``).

    Existing mods read ``tokens`` (prompt ids) and ``_prompt_len``; the rest is for new mods.
    An object rather than a dict so ``context_info.tokens`` works, and always truthy.
    """

    def __init__(self, request_id: str, tokens: list[int], max_tokens: int) -> None:
        self.request_id = request_id
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self._prompt_len = len(tokens)
        self.prompt_len = len(tokens)
        self.max_tokens = max_tokens
        self.logprobs: list[float] = []

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"ContextInfo(request_id={self.request_id!r}, prompt_len={self.prompt_len}, max_tokens={self.max_tokens})"


class SAEFeatures:
    """The strongest SAE features of tokens, when the engine encodes them inline (else the events'
    ``sae_features`` is None).

    ``ids`` (int64) and ``values`` (float32), strongest first: shape ``(k,)`` on ``ForwardPass``
    (the newest token), ``(prompt_len, k)`` on ``Prefilled`` (every prompt token). ``release`` and
    ``layer`` name the SAE (its residual stream is after ``layer``).
    """

    def __init__(self, ids: Any, values: Any, release: str, layer: int) -> None:
        self.ids = np.asarray(ids, dtype=np.int64)
        self.values = np.asarray(values, dtype=np.float32)
        self.release = release
        self.layer = layer

    def value_of(self, feature_id: int) -> float:
        """The feature's activation on the newest token (0.0 when it is not among the top k)."""
        ids, values = (self.ids, self.values) if self.ids.ndim == 1 else (self.ids[-1], self.values[-1])
        hit = np.nonzero(ids == int(feature_id))[0]
        return float(values[hit[0]]) if hit.size else 0.0

    def __repr__(self) -> str:
        return f"SAEFeatures(release={self.release!r}, layer={self.layer}, ids={_short(self.ids)})"


class Prefilled(ModEvent):
    """The prompt has been processed; dispatched once per request, before the first step.

    ``max_steps`` is the request's budget of new tokens. ``context_info`` is a :class:`ContextInfo`
    (a falsy value is stored as ``{}``, as in the original).
    """

    def __init__(
        self,
        request_id: str,
        step: int,
        max_steps: int,
        context_info: Any = None,
        *,
        hidden_states: Any = None,
        attention_patterns: Any = None,
        layer: int | None = None,
        input_ids: list[int] | None = None,
        sae_features: SAEFeatures | None = None,
    ) -> None:
        self.request_id = request_id
        self.step = step
        self.max_steps = max_steps
        self.context_info = context_info or {}
        self.hidden_states = hidden_states
        self.attention_patterns = attention_patterns
        self.layer = layer
        self.input_ids = input_ids
        self.sae_features = sae_features


class ForwardPass(ModEvent):
    """Logits for the next position are ready; the start of every step."""

    def __init__(
        self,
        request_id: str,
        step: int,
        logits: Any,
        *,
        hidden_states: Any = None,
        attention_patterns: Any = None,
        layer: int | None = None,
        input_ids: Sequence[int] | None = None,
        sae_features: SAEFeatures | None = None,
    ) -> None:
        self.request_id = request_id
        self.step = step
        self.logits = logits
        self.hidden_states = hidden_states
        self.attention_patterns = attention_patterns
        self.layer = layer
        self.input_ids = input_ids
        self.sae_features = sae_features

    def top_k_logprob(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        return _top_k_logprob(self.logits, k)


class Sampled(ModEvent):
    """A token was sampled (not dispatched when the step's tokens were forced)."""

    def __init__(self, request_id: str, step: int, sampled_token: int) -> None:
        self.request_id = request_id
        self.step = step
        self.sampled_token = sampled_token


class Added(ModEvent):
    """Token(s) were committed to the sequence; a whole forced chunk arrives as one event."""

    def __init__(self, request_id: str, step: int, added_tokens: list[int], forced: bool) -> None:
        self.request_id = request_id
        self.step = step
        self.added_tokens = list(added_tokens)
        self.forced = forced


# -------------------------------------------------------------------------------------- actions


class ModAction:
    """Base class of everything a mod may return."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={_short(v)}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class Noop(ModAction):
    def __init__(self) -> None:
        pass


class AdjustedPrefill(ModAction):
    """Replace the prompt with ``tokens``; ``max_steps > 0`` becomes the new token budget."""

    def __init__(self, tokens: Any, max_steps: Any) -> None:
        self.tokens = list(tokens)
        self.max_steps = max_steps


class ForceTokens(ModAction):
    def __init__(self, tokens: Any) -> None:
        self.tokens = list(tokens)


class AdjustedLogits(ModAction):
    """Sample this step from ``logits`` instead of the model's.

    ``token_temp``: ``None`` keeps the request temperature, ``0`` samples greedily, otherwise the
    temperature for this step only.
    """

    def __init__(self, logits: Any, token_temp: float | None = None) -> None:
        self.logits = logits
        self.token_temp = token_temp

    def top_k_logprob(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        return _top_k_logprob(self.logits, k)


class EmitError(ModAction):
    def __init__(self, err_str: str) -> None:
        self.err_str = err_str


class ForceOutput(ModAction):
    """End the request; the output becomes exactly ``tokens``."""

    def __init__(self, tokens: Any) -> None:
        self.tokens = list(tokens)


class ToolCalls(ModAction):
    """End the request with a tool call; ``tool_calls`` is an opaque JSON-able payload."""

    def __init__(self, tool_calls: Any) -> None:
        self.tool_calls = tool_calls


class Backtrack(ModAction):
    """Erase ``n`` tokens, then reinject ``tokens`` (``None``: nothing to reinject)."""

    def __init__(self, n: Any, tokens: Any = None) -> None:
        self.n = int(n)
        self.tokens = list(tokens) if tokens is not None else None


class Steer(ModAction):
    """Add ``scale`` times SAE feature ``feature_id``'s decoder direction to the residual stream at
    the SAE's layer on every later forward of this request, until a later Steer of the same feature
    replaces the scale (0 removes it). Needs the engine's SAE loaded (``sae.enabled``)."""

    def __init__(self, feature_id: Any, scale: Any) -> None:
        self.feature_id = feature_id
        self.scale = scale


TERMINAL_ACTIONS: tuple[type[ModAction], ...] = (ForceOutput, ToolCalls, EmitError)
