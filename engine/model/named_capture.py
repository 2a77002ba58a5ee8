"""Named-tensor capture: every named intermediate of one forward pass, by hook name, to files.

What a name means (its shape, what it is, llama.cpp's name for it) is written once in
:mod:`engine.model.hook_names`; where a forward exposes it is the model's taps table
(:mod:`engine.model.taps`), whose scoped hooks record only the capturing thread's forward and never
return a value, so a capture never changes a forward's outputs and leaves no hook behind, even
when the forward raises.

Tensors keep their batch dimension inside :class:`~engine.model.taps.Recording`; :func:`capture`
runs one sequence and drops it. Tensors are the model's own outputs, not copies: do not modify
them in place.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from engine.errors import ContextOverflowError, InvalidRequestError, check_request_token_ids
from engine.model.hook_names import expand_hook_names, parse_hook_name
from engine.model.kv_cache import cache_argument
from engine.model.taps import Recording, Taps, taps_of

__all__ = ["Recording", "capture", "check_input_ids", "write_capture", "manifest_entry", "load_capture",
           "compare_captures", "TensorDiff", "TENSORS_FILE", "MANIFEST_FILE", "FORMAT"]

TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
FORMAT = "raylens-capture/1"


def check_input_ids(model: Any, input_ids: Sequence[int]) -> list[int]:
    """``input_ids`` as ints: non-empty, in the vocabulary and within the model's context."""
    ids = check_request_token_ids(input_ids, int(model.get_input_embeddings().num_embeddings), "input_ids")
    if not ids:
        raise InvalidRequestError("`input_ids` must hold at least one token, got []", parameter="input_ids", value=[])
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 2**31 - 1)
    if len(ids) > limit:
        raise ContextOverflowError(f"`input_ids` must fit the model's context of {limit} tokens, got {len(ids)}",
                                   parameter="input_ids", value=len(ids))
    return ids


def capture(model: Any, input_ids: Sequence[int], names: Sequence[str], *, out: str | Path | None = None,
            model_id: str | None = None) -> dict[str, torch.Tensor]:
    """Run one fresh forward pass over ``input_ids`` (a new KV cache, nothing reused) and return
    every internal matching ``names`` (globs allowed), batch dimension dropped, in forward order.

    ``model``: a loaded model's :class:`~engine.model.taps.Taps` (or the model, whose table
    :func:`~engine.model.taps.taps_of` keeps). With ``out``, also writes ``out/tensors.safetensors``
    and ``out/manifest.json`` (:func:`write_capture`). Names and ids are checked before any hook
    is registered.
    """
    from transformers import DynamicCache

    taps: Taps = taps_of(model)
    wanted = expand_hook_names(names, taps.num_layers, taps.hooks)
    ids = check_input_ids(taps.model, input_ids)
    device = next(taps.model.parameters()).device
    tensor_ids = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    # no config: every layer keeps every position, as the paged cache does — a config would give
    # sliding-window layers (Gemma, Mistral) a cache that drops what lies outside the window
    cache = DynamicCache()
    with taps.record(wanted) as rec, torch.inference_mode():
        taps.base(input_ids=tensor_ids, use_cache=True, **cache_argument(taps.base, cache))
    captured = {str(name): tensor[0] for name, tensor in rec.tensors(cache).items()}
    if out is not None:
        write_capture(out, captured, input_ids=ids, model_id=model_id)
    return captured


def manifest_entry(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    """One manifest record: what a captured tensor is and which llama.cpp tensor it corresponds to."""
    parsed = parse_hook_name(name)
    spec = parsed.spec
    return {"name": name, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "layer": parsed.layer, "description": f"{spec.description}; {spec.shape}",
            "llama_cpp": spec.llama_cpp}


def write_capture(out: str | Path, tensors: dict[str, torch.Tensor], *, input_ids: Sequence[int] | None = None,
                  model_id: str | None = None) -> Path:
    """``out/tensors.safetensors`` (keys are the names) and ``out/manifest.json``; returns ``out``.

    Each tensor is copied to the host first: one tensor can appear under two names (a block's
    ``hook_resid_post`` is the next block's ``hook_resid_pre``), and safetensors refuses shared
    storage.
    """
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    host = {name: t.detach().to("cpu").contiguous().clone() for name, t in tensors.items()}
    save_file(host, str(folder / TENSORS_FILE), metadata={"format": FORMAT})
    manifest = {"format": FORMAT, "model_id": model_id, "input_ids": list(input_ids) if input_ids else None,
                "tokens": len(input_ids) if input_ids else None,
                "tensors": [manifest_entry(name, t) for name, t in host.items()]}
    (folder / MANIFEST_FILE).write_text(_manifest_text(manifest), encoding="utf-8")
    return folder


def _manifest_text(manifest: dict[str, Any]) -> str:
    """JSON with one line per top-level field and per tensor: a full dump stays greppable."""
    fields = "".join(f"  {json.dumps(k)}: {json.dumps(v)},\n" for k, v in manifest.items() if k != "tensors")
    tensors = ",\n".join(f"    {json.dumps(entry)}" for entry in manifest["tensors"])
    return f'{{\n{fields}  "tensors": [\n{tensors}\n  ]\n}}\n'


# ------------------------------------------------------------------------------------ compare


@dataclass(frozen=True)
class TensorDiff:
    """One name's comparison: ``status`` is ``ok``, ``mismatch`` (values out of tolerance),
    ``shape`` (shapes differ), ``only_a`` or ``only_b`` (the name is in one capture only)."""

    name: str
    status: str
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    max_abs: float | None = None
    bad_fraction: float | None = None  # elements with |a - b| > atol + rtol * |b|
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def load_capture(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a capture: a directory holding ``tensors.safetensors``, or such a file
    (for references written by other tools that use the same names)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    given = Path(path)
    file = given / TENSORS_FILE if given.is_dir() else given
    if not file.is_file():
        raise InvalidRequestError(f"`capture` must be a capture directory (holding {TENSORS_FILE}) or a "
                                  f".safetensors file, got `{path}`", parameter="capture", value=str(path))
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise InvalidRequestError(f"`capture` must be a readable safetensors file, got `{file}`: {err}",
                                  parameter="capture", value=str(file)) from None


def _shape_detail(a: tuple[int, ...], b: tuple[int, ...]) -> str:
    squeeze = lambda s: tuple(s[1:]) if s and s[0] == 1 else s  # noqa: E731
    if a != b and (squeeze(a) == b or squeeze(b) == a):
        return "differ only by a leading dimension of 1 (a batch dimension kept on one side?)"
    if a != b and sorted(a) == sorted(b):
        return "same sizes in another order (a different layout, e.g. heads before positions?)"
    return ""


def compare_captures(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, rtol: float = 1e-3,
                     atol: float = 1e-4) -> list[TensorDiff]:
    """Each name of ``a`` then the names only in ``b``, compared elementwise in float64 with ``b``
    as the reference: an element matches when ``|a - b| <= atol + rtol * |b|`` (NaN matches NaN)."""
    for label, value in (("rtol", rtol), ("atol", atol)):
        if not isinstance(value, (int, float)) or not value >= 0:
            raise InvalidRequestError(f"`{label}` must be a number >= 0, got {value!r}", parameter=label, value=value)
    diffs: list[TensorDiff] = []
    for name, ta in a.items():
        if name not in b:
            diffs.append(TensorDiff(name, "only_a", shape_a=tuple(ta.shape)))
            continue
        tb = b[name]
        sa, sb = tuple(ta.shape), tuple(tb.shape)
        if sa != sb:
            diffs.append(TensorDiff(name, "shape", sa, sb, detail=_shape_detail(sa, sb)))
            continue
        xa, xb = ta.detach().to("cpu", torch.float64), tb.detach().to("cpu", torch.float64)
        close = torch.isclose(xa, xb, rtol=rtol, atol=atol, equal_nan=True)
        finite = torch.isfinite(xa) & torch.isfinite(xb)
        max_abs = float((xa - xb)[finite].abs().max()) if finite.any() else 0.0
        bad = float((~close).double().mean()) if close.numel() else 0.0
        detail = "" if ta.dtype == tb.dtype else f"dtypes {ta.dtype} vs {tb.dtype}"
        diffs.append(TensorDiff(name, "ok" if bool(close.all()) else "mismatch", sa, sb, max_abs, bad, detail))
    diffs += [TensorDiff(name, "only_b", shape_b=tuple(tb.shape)) for name, tb in b.items() if name not in a]
    return diffs
