"""How one token's attention travels: per layer or aggregated, float32 or float16, base64 or binary.

Per layer (the default): the float32 array ``(num_layers, num_heads, context_length)``, C order,
base64 in JSON — ``attention[layer][head][i]`` is the weight from the newest token to
``input_ids[i]`` (prompt first, then the generated tokens), each ``[layer][head]`` row sums to 1.
Aggregated: one value per context position, the mean or max over layers and heads, as a JSON list.
On request: float16 halves the bytes; gzip compresses the bytes before base64 (attention rows
compress well); ``binary`` sends the bytes as a separate WebSocket binary frame right after the
token message, instead of base64 inside it.
"""

from __future__ import annotations

import base64
import gzip
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["AttentionEncoding", "encode_attention"]


@dataclass(frozen=True)
class AttentionEncoding:
    format: Literal["per_layer", "aggregated"] = "per_layer"
    aggregation: Literal["mean", "max"] = "mean"
    dtype: Literal["float32", "float16"] = "float32"
    compression: Literal["none", "gzip"] = "none"
    binary: bool = False


def encode_attention(attention: np.ndarray, enc: AttentionEncoding) -> tuple[dict[str, Any], bytes | None]:
    """The ``attention`` object of a token message and, for binary frames, the bytes to send after it.

    ``attention``: float32 ``(num_layers, num_heads, context_length)``.
    """
    context_length = int(attention.shape[-1])
    if enc.format == "aggregated":
        flat = attention.reshape(-1, context_length)  # (layers * heads, ctx)
        values = flat.mean(axis=0) if enc.aggregation == "mean" else flat.max(axis=0)  # (ctx,)
        array = values.astype(np.float32)
    else:
        array = np.ascontiguousarray(attention, dtype=np.float32)
    info: dict[str, Any] = {"format": enc.format, "shape": list(array.shape), "context_length": context_length}
    if enc.format == "aggregated":
        info["aggregation"] = enc.aggregation
    plain_json = enc.format == "aggregated" and enc.dtype == "float32" and enc.compression == "none" and not enc.binary
    if plain_json:
        info.update(encoding="json", dtype="float32", data=[float(v) for v in array])
        return info, None
    raw = np.ascontiguousarray(array.astype(np.float16 if enc.dtype == "float16" else np.float32)).tobytes()
    if enc.compression == "gzip":
        raw = gzip.compress(raw, compresslevel=1)  # level 1: most of the gain at a fraction of the CPU
    info["dtype"] = enc.dtype
    if enc.compression != "none":
        info["compression"] = enc.compression
    if enc.binary:
        info.update(encoding="binary", byte_length=len(raw))
        return info, raw
    info.update(encoding="base64", data=base64.b64encode(raw).decode("ascii"))
    return info, None


def decode_attention(info: dict[str, Any], binary: bytes | None = None) -> np.ndarray:
    """The inverse of :func:`encode_attention` (for tests and Python clients)."""
    if info.get("encoding") == "json":
        return np.asarray(info["data"], dtype=np.float32).reshape(info["shape"])
    raw = binary if info.get("encoding") == "binary" else base64.b64decode(info["data"])
    if raw is None:
        raise ValueError("a binary-encoded attention needs its binary frame (`binary`)")
    if info.get("compression") == "gzip":
        raw = gzip.decompress(raw)
    dtype = np.float16 if info.get("dtype") == "float16" else np.float32
    return np.frombuffer(raw, dtype=dtype).astype(np.float32).reshape(info["shape"])
