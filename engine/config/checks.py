"""The value rules config sections and requests share: integer and float checks, the bounds the
ingest backend and torch impose, the request-id rule, device names."""

from __future__ import annotations

import numbers
from typing import Any, Literal

from engine.errors import ConfigError, InvalidRequestError

__all__ = ["require_fields", "is_int", "is_real", "I32_MAX", "SEED_MAX", "MIN_TEMPERATURE", "REQUEST_ID_MAX_CHARS", "MOD_LOG_MIN_CHARS", "MOD_LOG_MAX_CHARS",
           "check_request_id", "choice_seed", "DeviceName", "DType"]

DeviceName = str  # "auto" | "cpu" | "mps" | "cuda" | "cuda:N"
DType = Literal["auto", "float32", "float16", "bfloat16"]

_DTYPES = ("auto", "float32", "float16", "bfloat16")


def require_fields(obj: Any, prefix: str, checks: list[tuple[str, bool, str]]) -> None:
    """Raise :class:`ConfigError` for the first ``(field, ok, constraint)`` that is not ok, naming
    ``prefix + field``, the constraint and the value: the one way settings objects refuse values."""
    for name, ok, constraint in checks:
        if not ok:
            value = getattr(obj, name)
            raise ConfigError(f"`{prefix}{name}` must be {constraint}, got {value!r}", parameter=name, value=value)


#: The ingest backend stores every integer as a 32-bit signed int and refuses larger ones.
I32_MAX = 2**31 - 1
#: ``torch.Generator.manual_seed`` takes at most 64 bits.
SEED_MAX = 2**64 - 1
# A temperature under this samples like greedy decoding anyway, and far smaller ones overflow
# logits / temperature in float32 (NaN probabilities): such values are refused, asking for 0.
MIN_TEMPERATURE = 1e-4
#: The ingest backend's ``request_id`` column (VARCHAR(255)).
REQUEST_ID_MAX_CHARS = 255
#: Bounds of the mod-log limits: room for a truncation marker, and 8 M characters (up to 48 MiB
#: once JSON-escaped) stays under the backend's 75 MiB body limit.
MOD_LOG_MIN_CHARS = 256
MOD_LOG_MAX_CHARS = 8 * 1024 * 1024


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice (or candidate) ``index`` of a request seeded ``seed``: ``seed + index``,
    wrapping past ``SEED_MAX`` to 0, so every seed a request may carry works with every ``n``
    (choice 0 keeps the request's own seed). None stays None: each choice draws its own."""
    return None if seed is None else (seed + index) % (SEED_MAX + 1)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_request_id(request_id: Any) -> str:
    """``request_id`` if the ingest backend would store it, else :class:`InvalidRequestError`.

    The backend keys requests by a string of at most 255 characters and answers a longer one with
    HTTP 500, after the whole generation ran; checking it when the request arrives fails it at
    once, with the fix. Returns the id unchanged.
    """
    if not isinstance(request_id, str) or not request_id:
        raise InvalidRequestError(f"`request_id` must be a non-empty string, got {request_id!r}. "
                                  "Omit it to get a generated one.", parameter="request_id", value=request_id)
    if len(request_id) > REQUEST_ID_MAX_CHARS:
        raise InvalidRequestError(
            f"`request_id` must be at most {REQUEST_ID_MAX_CHARS} characters, got {len(request_id)} "
            f"({request_id[:40]!r}…). Use a shorter id (the ingest backend stores at most {REQUEST_ID_MAX_CHARS}).",
            parameter="request_id", value=request_id)
    return request_id


def _check_device(device: str) -> None:
    base, _, index = device.partition(":")
    if base not in ("auto", "cpu", "mps", "cuda") or (index and (base != "cuda" or not index.isdigit())):
        raise ConfigError(
            f"`device` must be one of auto, cpu, mps, cuda, cuda:N, got {device!r}",
            parameter="device",
            value=device,
        )
