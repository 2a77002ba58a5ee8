"""The ``raylens`` object in a chat or completions body: interpretability per request, over HTTP.

Each part is off unless asked for, and bounded::

    "raylens": {
      "steer": [{"feature": 1234, "scale": 8.0}],      # at most MAX_STEERS SAE features
      "sae_features": 5,                               # top features per generated token, <= MAX_SAE_TOP_K
      "capture": {"names": ["blocks.3.hook_resid_post"], "start": -16, "end": null}
    }

* ``steer``: each feature's SAE decoder direction times ``scale`` is added to the residual stream
  at the SAE's layer, for the whole request — the built-in ``mods.features.steer_toward`` mod,
  added after the model suffix's mod. Needs the engine's SAE inline.
* ``sae_features``: each generated token's strongest SAE features (the inline SAE's top-k at the
  position that produced it) in the choice's ``raylens.sae_features``, one entry per token beside
  ``logprobs``; streamed with each chunk. Needs the engine's SAE inline (else 501).
* ``capture``: named internals (hook names, globs allowed, at most MAX_CAPTURE_NAMES after
  expansion) of one fresh forward over the choice's prompt + completion tokens, cut to the token
  window ``[start, end)`` (Python indexes into that sequence, negatives from its end; at most
  MAX_CAPTURE_TOKENS positions, the window's first ones kept). The forward is plain: it does not
  replay steering. Returned in the choice's ``raylens.captures`` as float32 little-endian base64
  with its shape (the position axis cut: the first, or the query axis of ``attn.hook_pattern``);
  at most MAX_CAPTURE_VALUES values in all, else the request fails with a 400.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.errors import RaylensError
from engine.model.hook_names import expand_hook_names, hook_spec

from .bridge import run_job
from .errors import ApiError, ErrorCode
from .openai_text import ChoiceText
from .service import Service

__all__ = ["Extension", "parse_extension", "MAX_STEERS", "MAX_SAE_TOP_K", "MAX_CAPTURE_NAMES", "MAX_CAPTURE_TOKENS",
           "MAX_CAPTURE_VALUES"]

MAX_STEERS = 8
MAX_SAE_TOP_K = 32
MAX_CAPTURE_NAMES = 8
MAX_CAPTURE_TOKENS = 64
MAX_CAPTURE_VALUES = 2**22  # 16 MiB of float32 before base64

_KEYS = ("steer", "sae_features", "capture")
_CAPTURE_KEYS = ("names", "start", "end")


def _bad(field: str, constraint: str, value: Any) -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, f"`{field}` must be {constraint}, got {str(value)[:80]}.", field)


def _int(value: Any) -> bool:
    return type(value) is int


@dataclass(frozen=True)
class Extension:
    """A parsed ``raylens`` object."""

    steer: tuple[tuple[int, float], ...] = ()
    sae_features: int = 0
    capture_names: tuple[str, ...] = ()
    capture_start: int = -MAX_CAPTURE_TOKENS
    capture_end: int | None = None

    # -------------------------------------------------------------------------- request side

    def mods(self) -> list[dict[str, Any]]:
        """The steering mods, as payload dicts (they travel to a GeneratorActor as they are)."""
        return [{"name": f"raylens_steer_{feature}", "language": "python", "entrypoint": "steer",
                 "source": f"from mods.features import steer_toward\n"
                           f"steer = steer_toward({feature}, {scale!r}, name='raylens_steer_{feature}')\n"}
                for feature, scale in self.steer]

    @property
    def keeps_samples(self) -> bool:
        return self.sae_features > 0

    # ------------------------------------------------------------------------- answer side

    def token_features(self, text: ChoiceText, start: int = 0) -> list[dict[str, Any]]:
        """``[{"token", "features": [{"id", "value"}]}]`` of the choice's tokens from ``start``."""
        out = []
        for sample, piece in zip(text.samples[start:], text.pieces[start:]):
            found = getattr(sample.event, "sae_features", None) if sample.first_of_event else None
            features = []
            if found is not None:
                ids, values = (found.ids, found.values) if found.ids.ndim == 1 else (found.ids[-1], found.values[-1])
                features = [{"id": int(i), "value": float(v)} for i, v in zip(ids[: self.sae_features],
                                                                              values[: self.sae_features]) if v > 0]
            out.append({"token": piece, "features": features})
        return out

    async def captures(self, service: Service, text: ChoiceText, result: Any) -> dict[str, Any]:
        """The choice's captures (see the module docstring)."""
        completion = text.ids if text.stopped_by_string else [t for t in result.output_ids
                                                              if t not in text.stop_ids]
        sequence = [int(t) for t in result.prompt_ids] + [int(t) for t in completion]
        start, end, _ = slice(self.capture_start, self.capture_end).indices(len(sequence))
        end = max(start, min(end, start + MAX_CAPTURE_TOKENS))
        tensors = await run_job(service.engine, "capture", input_ids=sequence, names=list(self.capture_names),
                                timeout_s=service.settings.request_timeout_s)
        out, total = {}, 0
        for name, tensor in tensors.items():
            array = _numpy(tensor)
            axis = 1 if hook_spec(name).shape.startswith("(h, T") else 0
            cut = np.ascontiguousarray(np.take(array, range(start, end), axis=axis), dtype="<f4")
            total += cut.size
            if total > MAX_CAPTURE_VALUES:
                raise _bad("raylens.capture", f"at most {MAX_CAPTURE_VALUES} values in all (fewer names or "
                                              f"tokens)", f"more ({name} alone has {cut.size})")
            out[str(name)] = {"shape": list(cut.shape), "dtype": "float32", "encoding": "base64",
                              "data": base64.b64encode(cut.tobytes()).decode("ascii")}
        return {"window": [start, end], "token_ids": sequence[start:end], "tensors": out}

    async def choice_extra(self, service: Service, text: ChoiceText, result: Any) -> dict[str, Any]:
        """The choice's ``raylens`` object at its end (empty: nothing was asked)."""
        extra: dict[str, Any] = {}
        if self.sae_features:
            extra["sae_features"] = self.token_features(text)
        if self.capture_names:
            extra["captures"] = await self.captures(service, text, result)
        return extra


def _numpy(tensor: Any) -> np.ndarray:
    """A captured tensor as float32 numpy (torch in process; numpy from a GeneratorActor)."""
    if isinstance(tensor, np.ndarray):
        return tensor.astype(np.float32, copy=False)
    return tensor.detach().float().cpu().numpy()


def parse_extension(service: Service, raw: Any) -> Extension | None:
    """The body's ``raylens`` object checked (a 400 naming the field), or None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _bad("raylens", "an object with steer, sae_features or capture", raw)
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise _bad(f"raylens.{unknown[0]}", f"one of {', '.join(_KEYS)} (no other key)", unknown[0])
    steer = _steers(raw.get("steer"))
    top_k = raw.get("sae_features") or 0
    if not _int(top_k) or not 0 <= top_k <= MAX_SAE_TOP_K:
        raise _bad("raylens.sae_features", f"an integer in [0, {MAX_SAE_TOP_K}]", top_k)
    if (steer or top_k) and not service.sae_features_available():
        part = "raylens.steer" if steer else "raylens.sae_features"
        raise ApiError(ErrorCode.FEATURES_UNAVAILABLE, f"`{part}` must be used with the engine's SAE inline "
                                                       "(sae.enabled with sae.mode: inline), got none inline on "
                                                       "this server.", part)
    names, start, end = _capture(service, raw.get("capture"))
    return Extension(steer, top_k, names, start, end)


def _steers(raw: Any) -> tuple[tuple[int, float], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_STEERS:
        raise _bad("raylens.steer", f"a list of at most {MAX_STEERS} {{feature, scale}} objects", raw)
    out = {}
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) != {"feature", "scale"}:
            raise _bad(f"raylens.steer[{i}]", "an object with exactly `feature` and `scale`", item)
        feature, scale = item["feature"], item["scale"]
        if not _int(feature) or feature < 0:
            raise _bad(f"raylens.steer[{i}].feature", "an SAE feature id >= 0", feature)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise _bad(f"raylens.steer[{i}].scale", "a finite number", scale)
        out[feature] = float(scale)
    return tuple(out.items())


def _capture(service: Service, raw: Any) -> tuple[tuple[str, ...], int, int | None]:
    if raw is None:
        return (), -MAX_CAPTURE_TOKENS, None
    if not isinstance(raw, dict):
        raise _bad("raylens.capture", "an object with names, start and end", raw)
    unknown = sorted(set(raw) - set(_CAPTURE_KEYS))
    if unknown:
        raise _bad(f"raylens.capture.{unknown[0]}", f"one of {', '.join(_CAPTURE_KEYS)}", unknown[0])
    names = raw.get("names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise _bad("raylens.capture.names", "a non-empty list of hook names (globs allowed)", names)
    try:
        expanded = expand_hook_names(names, int(service.info.num_layers), service.info.hooks)
    except RaylensError as err:
        raise ApiError(ErrorCode.INVALID_REQUEST, str(err), "raylens.capture.names") from None
    if len(expanded) > MAX_CAPTURE_NAMES:
        raise _bad("raylens.capture.names", f"at most {MAX_CAPTURE_NAMES} internals after expanding globs",
                   f"{len(expanded)}")
    start, end = raw.get("start", -MAX_CAPTURE_TOKENS), raw.get("end")
    if not _int(start):
        raise _bad("raylens.capture.start", "an integer (negative: from the sequence's end)", start)
    if end is not None and not _int(end):
        raise _bad("raylens.capture.end", "an integer or null (the sequence's end)", end)
    return tuple(str(n) for n in expanded), start, end
