"""Where a loaded model's forward exposes each named internal: its reads and its name table,
built from the model's family entry (:mod:`engine.model.families`) once, at load time.

A :class:`Read` is one observation point: a module, before (``pre``) or after (``post``) it runs,
and which argument or output holds the tensor (for a fused query/key/value projection, which
slice). A :class:`Tap` is one name: the reads it needs and how they become its tensor
(:data:`Derive`). :mod:`engine.model.taps` registers the reads as scoped hooks and derives the
tensors.

Read points per block, by key: ``resid_pre``, ``ln1_in``/``ln1`` (the input norm's input and
output), ``q``/``k``/``v`` (flat projections ``(B, T, heads · hd)``), ``q_norm_in``/``q_normed``
and ``k_…`` (per-head norms, ``(B, T, heads, hd)``), ``attn_in`` (the attention module's
``position_embeddings`` and ``attention_mask``), ``z`` (the output projection's input),
``ln1_post_in``, ``attn_out`` (what is added to the residual), ``ln2_in``/``ln2``, ``mlp_pre``,
``mlp_up``, ``mlp_post``, ``ln2_post_in``, ``mlp_out``, ``resid_post``; model-wide: ``hook_embed``,
``hook_pos_embed``, ``final_in``/``final``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from engine.model.families import Family, get_path, hook_set
from engine.model.hook_names import HookName, HookSet

__all__ = ["Read", "ReadKey", "Tap", "Derive", "build_reads", "build_taps", "head_dim"]


@dataclass(frozen=True)
class ReadKey:
    """One raw read: ``layer`` (None: model-wide) and the point inside it, e.g. ``(3, "q")``."""

    layer: int | None
    point: str


@dataclass(frozen=True)
class Read:
    """Where a forward is observed: ``module`` before it runs (``pre``: ``extract(args, kwargs)``)
    or after (``post``: ``extract(output)``). ``writable``: the read is the module's whole output
    (or its first element), so a write tap can replace it."""

    key: ReadKey
    module: Any
    when: Literal["pre", "post"]
    extract: Callable[..., Any]
    writable: bool = False


# How a name's tensor is formed from its reads.
Derive = Literal["raw", "heads", "rot_q", "rot_k", "pattern", "cache_k", "cache_v", "rms_scale", "rms_normalized",
                 "layer_scale", "layer_normalized"]


@dataclass(frozen=True)
class Tap:
    """One name's entry: the reads it needs and how they become its tensor."""

    name: HookName
    reads: tuple[ReadKey, ...]
    derive: Derive

    @property
    def spec(self) -> Any:
        """Shape, description and llama.cpp alias (from :mod:`engine.model.hook_names`)."""
        return self.name.spec


def head_dim(config: Any) -> int:
    """Size of one attention head, from the model config (``head_dim``, else hidden / heads)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, tuple) else value


def _hidden_arg(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs["hidden_states"]


def _attention_inputs(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    return kwargs.get("position_embeddings"), kwargs.get("attention_mask")


def _fused_part(layout: str, part: int, heads: int) -> Callable[[Any], Any]:
    """The ``part`` (0 q, 1 k, 2 v) of a fused projection's output ``(B, T, 3 · heads · hd)`` as a
    flat ``(B, T, heads · hd)``: GPT-2 concatenates three blocks of ``d``; GPT-NeoX interleaves per
    head, ``(B, T, heads, 3 · hd)``."""
    def extract(output: Any) -> Any:
        fused = _first(output)
        if layout == "thirds":
            return fused.chunk(3, dim=-1)[part]
        per_head = fused.view(*fused.shape[:-1], heads, -1)  # (B, T, heads, 3 * hd)
        return per_head.chunk(3, dim=-1)[part].flatten(-2)  # (B, T, heads * hd)
    return extract


def build_reads(family: Family, base: Any, blocks: Any) -> list[Read]:
    """Every read point of ``base`` (the model without its LM head) for ``family``."""
    config = base.config
    reads = [Read(ReadKey(None, "hook_embed"), get_path(base, family.embed), "post", _first, writable=True),
             Read(ReadKey(None, "final_in"), get_path(base, family.final_norm), "pre", _hidden_arg),
             Read(ReadKey(None, "final"), get_path(base, family.final_norm), "post", _first, writable=True)]
    if family.pos_embed is not None:
        reads.append(Read(ReadKey(None, "hook_pos_embed"), get_path(base, family.pos_embed), "post", _first,
                          writable=True))
    for layer, block in enumerate(blocks):
        reads += _block_reads(family, config, layer, block)
    return reads


def _block_reads(family: Family, config: Any, layer: int, block: Any) -> list[Read]:
    attn, mlp = get_path(block, family.attention), get_path(block, family.mlp)
    k = lambda point: ReadKey(layer, point)  # noqa: E731
    reads = [Read(k("resid_pre"), block, "pre", _hidden_arg),
             Read(k("ln1_in"), get_path(block, family.ln1), "pre", _hidden_arg),
             Read(k("ln1"), get_path(block, family.ln1), "post", _first, writable=True),
             Read(k("attn_in"), attn, "pre", _attention_inputs),
             Read(k("z"), get_path(attn, family.out_proj), "pre", _hidden_arg),
             Read(k("ln2_in"), get_path(block, family.ln2), "pre", _hidden_arg),
             Read(k("ln2"), get_path(block, family.ln2), "post", _first, writable=True),
             Read(k("mlp_post"), get_path(mlp, family.mlp_out), "pre", _hidden_arg),
             Read(k("resid_post"), block, "post", _first, writable=True)]
    if family.fused_qkv is None:
        reads += [Read(k(point), get_path(attn, path), "post", _first, writable=True)
                  for point, path in zip("qkv", family.qkv)]
    else:
        fused = get_path(attn, family.qkv[0])
        reads += [Read(k(point), fused, "post", _fused_part(family.fused_qkv, part, config.num_attention_heads))
                  for part, point in enumerate("qkv")]
    if family.qk_norm is not None:
        # read positions first, (B, T, heads, hd), whichever layout the norm sees
        swap = (lambda t: t.transpose(1, 2)) if family.qk_norm_heads_first else (lambda t: t)
        for point, path in zip("qk", family.qk_norm):
            norm = get_path(attn, path)
            reads += [Read(k(f"{point}_norm_in"), norm, "pre", lambda args, kwargs: swap(_hidden_arg(args, kwargs))),
                      Read(k(f"{point}_normed"), norm, "post", lambda output: swap(_first(output)))]
    if family.ln1_post is not None:
        post = get_path(block, family.ln1_post)
        reads += [Read(k("ln1_post_in"), post, "pre", _hidden_arg),
                  Read(k("attn_out"), post, "post", _first, writable=True)]
    else:
        reads.append(Read(k("attn_out"), attn, "post", _first, writable=True))
    first = get_path(mlp, family.mlp_gate if family.mlp_gate is not None else family.mlp_in)
    reads.append(Read(k("mlp_pre"), first, "post", _first, writable=True))
    if family.mlp_gate is not None:
        reads.append(Read(k("mlp_up"), get_path(mlp, family.mlp_in), "post", _first, writable=True))
    if family.ln2_post is not None:
        post = get_path(block, family.ln2_post)
        reads += [Read(k("ln2_post_in"), post, "pre", _hidden_arg),
                  Read(k("mlp_out"), post, "post", _first, writable=True)]
    else:
        reads.append(Read(k("mlp_out"), mlp, "post", _first, writable=True))
    return reads


def _block_table(family: Family) -> dict[str, tuple[tuple[str, ...], Derive]]:
    """Per block: name → (read points, derive)."""
    norm = family.norm
    scale, normalized = f"{norm}_scale", f"{norm}_normalized"
    q, k = ("q_normed", "k_normed") if family.qk_norm is not None else ("q", "k")
    return {
        "hook_resid_pre": (("resid_pre",), "raw"),
        "ln1.hook_scale": (("ln1_in",), scale),  # type: ignore[dict-item]
        "ln1.hook_normalized": (("ln1_in",), normalized),  # type: ignore[dict-item]
        "ln1.hook_weighted": (("ln1",), "raw"),
        "attn.hook_q": (("q",), "heads"),
        "attn.hook_k": (("k",), "heads"),
        "attn.hook_v": (("v",), "heads"),
        "attn.q_norm.hook_scale": (("q_norm_in",), "rms_scale"),
        "attn.q_norm.hook_normalized": (("q_norm_in",), "rms_normalized"),
        "attn.k_norm.hook_scale": (("k_norm_in",), "rms_scale"),
        "attn.k_norm.hook_normalized": (("k_norm_in",), "rms_normalized"),
        "attn.hook_rot_q": ((q, k, "attn_in"), "rot_q"),
        "attn.hook_rot_k": ((q, k, "attn_in"), "rot_k"),
        "attn.cache_k": ((), "cache_k"),
        "attn.cache_v": ((), "cache_v"),
        "attn.hook_pattern": ((q, k, "attn_in"), "pattern"),
        "attn.hook_z": (("z",), "heads"),
        "ln1_post.hook_scale": (("ln1_post_in",), "rms_scale"),
        "ln1_post.hook_normalized": (("ln1_post_in",), "rms_normalized"),
        "hook_attn_out": (("attn_out",), "raw"),
        "hook_resid_mid": (("ln2_in",), "raw"),  # sequential blocks only: the MLP norm reads resid_mid
        "ln2.hook_scale": (("ln2_in",), scale),  # type: ignore[dict-item]
        "ln2.hook_normalized": (("ln2_in",), normalized),  # type: ignore[dict-item]
        "ln2.hook_weighted": (("ln2",), "raw"),
        "mlp.hook_pre": (("mlp_pre",), "raw"),
        "mlp.hook_pre_linear": (("mlp_up",), "raw"),
        "mlp.hook_post": (("mlp_post",), "raw"),
        "ln2_post.hook_scale": (("ln2_post_in",), "rms_scale"),
        "ln2_post.hook_normalized": (("ln2_post_in",), "rms_normalized"),
        "hook_mlp_out": (("mlp_out",), "raw"),
        "hook_resid_post": (("resid_post",), "raw"),
    }


def build_taps(family: Family, config: Any, num_layers: int) -> tuple[HookSet, list[Tap]]:
    """The model's names (a :class:`HookSet`) and their taps, in forward order."""
    hooks = hook_set(family, config)
    norm = family.norm
    model_wide: dict[str, tuple[str, Derive]] = {
        "hook_embed": ("hook_embed", "raw"), "hook_pos_embed": ("hook_pos_embed", "raw"),
        "ln_final.hook_scale": ("final_in", f"{norm}_scale"),  # type: ignore[dict-item]
        "ln_final.hook_normalized": ("final_in", f"{norm}_normalized"),  # type: ignore[dict-item]
        "ln_final.hook_weighted": ("final", "raw")}
    block = _block_table(family)
    taps = []
    for name in hooks.forward_order(num_layers):
        if name.layer is None:
            point, derive = model_wide[name.hook]
            taps.append(Tap(name, (ReadKey(None, point),), derive))
        else:
            points, derive = block[name.hook]
            taps.append(Tap(name, tuple(ReadKey(name.layer, p) for p in points), derive))
    return hooks, taps
