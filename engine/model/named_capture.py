"""Named-tensor capture: every named intermediate of one forward pass, by hook name, to files.

What a name means (its shape, what it is, llama.cpp's name for it) is written once in
:mod:`engine.model.hook_names`; this module only finds those tensors in a Llama-family
transformers model (``embed_tokens``, ``layers[L].{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.down_proj}``, ``norm``), with module forward hooks.

Hooks are global state on a shared model (TransformerLens' ``HookedRootModule`` warns the same),
so :func:`hooks` registers them in a context manager and removes every handle in ``finally``: a
forward that raises leaves no hook behind. While they are registered, another thread may run a
forward on the same model (the engine serves concurrent requests); each hook records only in the
thread that opened the capture, so other requests pass straight through. Hooks never return a
value, so a capture never changes a forward's outputs.

Where a tensor is taken:

- ``attn.hook_q/k/v`` are the projections before RoPE (TransformerLens' convention);
  ``attn.hook_rot_q/rot_k`` apply the model's own ``apply_rotary_pos_emb`` to them with the
  ``position_embeddings`` the attention module was handed, so they equal what attention used.
- ``attn.hook_pattern`` is computed from the rotated q and k and the mask the attention module
  got, only when asked for: the model keeps its fast attention kernel (SDPA) and is never
  switched to eager.
- ``attn.cache_k/cache_v`` are read from the ``DynamicCache`` the forward filled.

Tensors keep their batch dimension inside :class:`Recording`; :func:`capture` runs one sequence
and drops it. Tensors are the model's own outputs, not copies: do not modify them in place.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch

from engine.errors import ContextOverflowError, InvalidRequestError, check_request_token_ids
from engine.model.capture import attention_pattern
from engine.model.hook_names import HookName, expand_hook_names, parse_hook_name

__all__ = ["Recording", "hooks", "capture", "write_capture", "manifest_entry", "load_capture", "compare_captures",
           "TensorDiff", "TENSORS_FILE", "MANIFEST_FILE", "FORMAT"]

TENSORS_FILE = "tensors.safetensors"
MANIFEST_FILE = "manifest.json"
FORMAT = "raylens-capture/1"

# Raw module outputs each derived hook needs, per layer: "q"/"k"/"v" are the projections,
# "rope" the (cos, sin) and "mask" the attention mask handed to the attention module.
_NEEDS: dict[str, tuple[str, ...]] = {
    "hook_resid_pre": ("resid_pre",),
    "ln1.hook_normalized": ("ln1",),
    "attn.hook_q": ("q",),
    "attn.hook_k": ("k",),
    "attn.hook_v": ("v",),
    "attn.hook_rot_q": ("q", "k", "rope"),
    "attn.hook_rot_k": ("q", "k", "rope"),
    "attn.hook_pattern": ("q", "k", "rope", "mask"),
    "attn.hook_z": ("z",),
    "hook_attn_out": ("attn_out",),
    "hook_resid_mid": ("resid_mid",),
    "ln2.hook_normalized": ("ln2",),
    "mlp.hook_post": ("mlp_post",),
    "hook_mlp_out": ("mlp_out",),
    "hook_resid_post": ("resid_post",),
    "attn.cache_k": (),
    "attn.cache_v": (),
}
_CACHE_HOOKS = {"attn.cache_k", "attn.cache_v"}


def _base(model: Any) -> Any:
    """The decoder stack (``LlamaModel``) of a causal LM, or the stack itself."""
    base = getattr(model, "base_model", model)
    if not all(hasattr(base, attr) for attr in ("embed_tokens", "layers", "norm")):
        raise InvalidRequestError(
            f"named capture must run on a Llama-family model (embed_tokens, layers, norm), got "
            f"{type(model).__name__}", parameter="model", value=type(model).__name__)
    return base


def _first(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


@dataclass
class Recording:
    """What one forward pass left in the hooks; :meth:`tensors` turns it into named tensors.

    ``raw[(layer, key)]``: module outputs with the batch dimension, e.g. ``(B, T, d)``.
    """

    names: tuple[HookName, ...]
    owner: int = field(default_factory=threading.get_ident)
    raw: dict[tuple[int | None, str], Any] = field(default_factory=dict)

    def keep(self, layer: int | None, key: str, value: Any) -> None:
        if threading.get_ident() == self.owner:
            self.raw[(layer, key)] = value

    def tensors(self, model: Any, cache: Any = None) -> dict[HookName, torch.Tensor]:
        """Every requested name → its tensor, batch dimension kept (``(B, …)``)."""
        base = _base(model)
        out: dict[HookName, torch.Tensor] = {}
        rotated: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in self.names:
            if name.layer is None:
                out[name] = self.raw[(None, name.hook)]
            else:
                out[name] = self._block_tensor(base, name, cache, rotated)
        return out

    def _block_tensor(self, base: Any, name: HookName, cache: Any,
                      rotated: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        layer, hook = name.layer, name.hook
        attn = base.layers[layer].self_attn
        hd = attn.head_dim
        if hook in _CACHE_HOOKS:
            if cache is None:
                raise InvalidRequestError(f"`{name}` needs the forward's KV cache; run it with a DynamicCache",
                                          parameter="names", value=str(name))
            stored = cache.layers[layer].keys if hook == "attn.cache_k" else cache.layers[layer].values
            return stored.transpose(1, 2)  # (B, g, T, hd) -> (B, T, g, hd): positions first, like hook_k
        if hook in ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z"):
            key = {"attn.hook_q": "q", "attn.hook_k": "k", "attn.hook_v": "v", "attn.hook_z": "z"}[hook]
            flat = self.raw[(layer, key)]  # (B, T, heads * hd)
            return flat.view(*flat.shape[:-1], -1, hd)  # (B, T, heads, hd)
        if hook in ("attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_pattern"):
            if layer not in rotated:
                rotated[layer] = self._rotate(attn, layer)
            rot_q, rot_k = rotated[layer]  # (B, h, T, hd), (B, g, T, hd)
            if hook == "attn.hook_rot_q":
                return rot_q.transpose(1, 2)
            if hook == "attn.hook_rot_k":
                return rot_k.transpose(1, 2)
            mask = self.raw.get((layer, "mask"))
            heads, q_len, kv_len = rot_q.shape[1], rot_q.shape[2], rot_k.shape[2]
            patterns = [attention_pattern(rot_q[b:b + 1], rot_k[b:b + 1], None if mask is None else mask[b:b + 1],
                                          attn.scaling, attn.num_key_value_groups, newest_row_only=False)
                        .reshape(heads, q_len, kv_len) for b in range(rot_q.shape[0])]
            return torch.stack(patterns)  # (B, h, T, T) float32
        key = {"hook_resid_pre": "resid_pre", "ln1.hook_normalized": "ln1", "hook_attn_out": "attn_out",
               "hook_resid_mid": "resid_mid", "ln2.hook_normalized": "ln2", "mlp.hook_post": "mlp_post",
               "hook_mlp_out": "mlp_out", "hook_resid_post": "resid_post"}[hook]
        return self.raw[(layer, key)]

    def _rotate(self, attn: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k after RoPE, exactly as the attention module computes them: ``(B, heads, T, hd)``."""
        q, k = self.raw[(layer, "q")], self.raw[(layer, "k")]  # (B, T, h * hd), (B, T, g * hd)
        cos, sin = self.raw[(layer, "rope")]
        apply_rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if apply_rope is None:
            raise InvalidRequestError(f"post-RoPE q/k and attention patterns need the model module's "
                                      f"apply_rotary_pos_emb, which {type(attn).__module__} lacks",
                                      parameter="names")
        hd = attn.head_dim
        q = q.view(*q.shape[:-1], -1, hd).transpose(1, 2)
        k = k.view(*k.shape[:-1], -1, hd).transpose(1, 2)
        return apply_rope(q, k, cos, sin)


def _plan(names: Iterable[HookName]) -> dict[int | None, set[str]]:
    """Raw keys to record per layer (``None``: the model-wide hooks)."""
    plan: dict[int | None, set[str]] = {}
    for name in names:
        keys = {name.hook} if name.layer is None else set(_NEEDS[name.hook])
        plan.setdefault(name.layer, set()).update(keys)
    return plan


def _register(base: Any, plan: dict[int | None, set[str]], rec: Recording) -> list[Any]:
    """Register the hooks ``plan`` asks for; returns their handles (the caller removes them)."""
    handles: list[Any] = []

    def after(module: Any, layer: int | None, key: str, pick=_first) -> None:
        handles.append(module.register_forward_hook(lambda _m, _a, output: rec.keep(layer, key, pick(output))))

    def before(module: Any, layer: int | None, key: str) -> None:
        def hook(_m: Any, args: tuple, kwargs: dict) -> None:
            rec.keep(layer, key, args[0] if args else kwargs["hidden_states"])
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    wanted_global = plan.get(None, set())
    if "hook_embed" in wanted_global:
        after(base.embed_tokens, None, "hook_embed")
    if "ln_final.hook_normalized" in wanted_global:
        after(base.norm, None, "ln_final.hook_normalized")
    for layer, keys in plan.items():
        if layer is None:
            continue
        block = base.layers[layer]
        attn = block.self_attn
        simple = {"resid_post": (block, after), "ln1": (block.input_layernorm, after), "q": (attn.q_proj, after),
                  "k": (attn.k_proj, after), "v": (attn.v_proj, after), "attn_out": (attn, after),
                  "ln2": (block.post_attention_layernorm, after), "mlp_out": (block.mlp, after),
                  "resid_pre": (block, before), "resid_mid": (block.post_attention_layernorm, before),
                  "z": (attn.o_proj, before), "mlp_post": (block.mlp.down_proj, before)}
        for key in sorted(keys & simple.keys()):
            module, how = simple[key]
            how(module, layer, key)
        if keys & {"rope", "mask"}:
            def attn_inputs(_m: Any, _args: tuple, kwargs: dict, layer: int = layer) -> None:
                rec.keep(layer, "rope", kwargs.get("position_embeddings"))
                rec.keep(layer, "mask", kwargs.get("attention_mask"))
            handles.append(attn.register_forward_pre_hook(attn_inputs, with_kwargs=True))
    return handles


@contextlib.contextmanager
def hooks(model: Any, names: Sequence[HookName]) -> Iterator[Recording]:
    """Hooks that record ``names`` during forwards run inside the block, removed on exit even
    when the forward raises. Read the tensors with ``recording.tensors(model, cache)``."""
    base = _base(model)
    rec = Recording(tuple(names))
    handles: list[Any] = []
    try:
        handles = _register(base, _plan(rec.names), rec)
        yield rec
    finally:
        for handle in handles:
            handle.remove()


def _check_ids(model: Any, input_ids: Sequence[int]) -> list[int]:
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

    With ``out``, also writes ``out/tensors.safetensors`` and ``out/manifest.json``
    (:func:`write_capture`). Names and ids are checked before any hook is registered.
    """
    from transformers import DynamicCache

    wanted = expand_hook_names(names, int(model.config.num_hidden_layers))
    ids = _check_ids(model, input_ids)
    device = next(model.parameters()).device
    tensor_ids = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
    cache = DynamicCache(config=model.config)
    with hooks(model, wanted) as rec, torch.inference_mode():
        _base(model)(input_ids=tensor_ids, past_key_values=cache, use_cache=True)
    captured = {str(name): tensor[0] for name, tensor in rec.tensors(model, cache).items()}
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
