"""Mods that act on SAE features: gate tokens on what the model is representing.

When the engine encodes hidden states inline (``sae.enabled`` with ``sae.mode: inline``), every
``ForwardPass`` carries ``event.sae_features`` (the newest token's strongest features) and
``Prefilled`` the prompt's. These helpers build ordinary mods from a feature and a threshold:

* :func:`ban_tokens_while` — forbid tokens while a feature is above a threshold;
* :func:`force_tokens_when` — force a chunk the first time a feature fires;
* :func:`backtrack_when` — when a feature fires, erase the newest ``n`` tokens and ban the token
  that led there for the rest of the request (a "stay on topic" guard);
* :func:`steer_toward` — add a feature's decoder direction to the residual stream (``Steer``).

Each returned mod keeps its state per request, so one mod object can serve many requests at once.
Without inline features (``sae_features`` is None) they do nothing.
"""

from __future__ import annotations

from typing import Any, Iterable

from .decorator import mod
from .tensor import MaskedLogits
from .types import ForwardPass, ModEvent

__all__ = ["feature_value", "feature_fires", "top_features", "ban_tokens_while", "force_tokens_when",
           "backtrack_when", "steer_toward"]

_BANNED = -1e9  # the mask value mods use: finite, so a fully masked row still samples something


def feature_value(event: ModEvent, feature_id: int) -> float:
    """The feature's activation on the newest token (0.0 when absent or not among the top k)."""
    features = getattr(event, "sae_features", None)
    return features.value_of(feature_id) if features is not None else 0.0


def feature_fires(event: ModEvent, feature_id: int, threshold: float = 0.0) -> bool:
    return feature_value(event, feature_id) > threshold


def _masked(event: ForwardPass, tokens: Iterable[int], actions: Any) -> Any:
    """The event's logits with ``tokens`` banned, said (the engine bans them where its logits are)."""
    return actions.adjust_logits(MaskedLogits(event.logits, disallowed=list(tokens), value=_BANNED))


def ban_tokens_while(feature_id: int, threshold: float, tokens: Iterable[int], *, name: str | None = None):
    """A mod that bans ``tokens`` on every step where ``feature_id`` is above ``threshold``."""
    banned = sorted({int(t) for t in tokens})

    @mod
    def ban_while_feature(event, actions, tokenizer=None):
        if isinstance(event, ForwardPass) and feature_fires(event, feature_id, threshold):
            return _masked(event, banned, actions)
        return None

    ban_while_feature.__name__ = name or f"ban_while_feature_{feature_id}"
    return ban_while_feature


def force_tokens_when(feature_id: int, threshold: float, tokens: Iterable[int], *, name: str | None = None):
    """A mod that forces ``tokens`` the first time ``feature_id`` rises above ``threshold``."""
    chunk = [int(t) for t in tokens]
    fired: set[str] = set()

    @mod
    def force_when_feature(event, actions, tokenizer=None):
        if isinstance(event, ForwardPass) and event.request_id not in fired and \
                feature_fires(event, feature_id, threshold):
            fired.add(event.request_id)
            return actions.force_tokens(chunk)
        return None

    force_when_feature.__name__ = name or f"force_when_feature_{feature_id}"
    return force_when_feature


def backtrack_when(feature_id: int, threshold: float, *, n: int = 1, max_times: int = 4, name: str | None = None):
    """A mod that, when ``feature_id`` fires on the newest token, erases the newest ``n`` tokens
    and bans the token that led there for the rest of the request; at most ``max_times`` times per
    request (then it lets the text be)."""
    state: dict[str, dict[str, Any]] = {}

    @mod
    def backtrack_when_feature(event, actions, tokenizer=None):
        if not isinstance(event, ForwardPass):
            return None
        mine = state.setdefault(event.request_id, {"banned": set(), "times": 0, "prompt": None})
        ids = event.input_ids or []
        if mine["prompt"] is None:
            mine["prompt"] = len(ids)
        generated = len(ids) - mine["prompt"]
        if generated > 0 and mine["times"] < max_times and feature_fires(event, feature_id, threshold):
            mine["times"] += 1
            mine["banned"].add(int(ids[-1]))  # the token whose reading fired the feature
            return actions.backtrack(steps=min(n, generated))
        if mine["banned"]:
            return _masked(event, mine["banned"], actions)
        return None

    backtrack_when_feature.__name__ = name or f"backtrack_when_feature_{feature_id}"
    return backtrack_when_feature


def steer_toward(feature_id: int, scale: float, *, from_step: int = 0, name: str | None = None):
    """A mod that steers every request it runs in by ``scale`` × the feature's decoder direction,
    from ``from_step`` on."""
    started: set[str] = set()

    @mod
    def steer_feature(event, actions, tokenizer=None):
        if isinstance(event, ForwardPass) and event.step >= from_step and event.request_id not in started:
            started.add(event.request_id)
            return actions.steer(feature_id, scale)
        return None

    steer_feature.__name__ = name or f"steer_feature_{feature_id}"
    return steer_feature


def top_features(event: ModEvent, k: int = 5) -> list[tuple[int, float]]:
    """``[(feature id, value), …]`` of the newest token, strongest first (empty without features)."""
    features = getattr(event, "sae_features", None)
    if features is None:
        return []
    ids, values = (features.ids, features.values) if features.ids.ndim == 1 else (features.ids[-1],
                                                                                 features.values[-1])
    return [(int(i), float(v)) for i, v in zip(ids[:k], values[:k]) if v > 0]

