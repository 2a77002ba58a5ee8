"""The names of model internals, in the TransformerLens vocabulary: one place that spells them.

Every consumer of internals (mod events, the SAE hand-off, SAE training, named-tensor capture)
asks for tensors by these names, e.g. ``blocks.16.hook_resid_post`` (the residual stream after
layer 16) or ``blocks.16.attn.hook_pattern`` (layer 16's post-softmax attention). A name is parsed
once into a typed :class:`HookName`; code never matches on the string again.

Each hook also has a :class:`HookSpec`: what the tensor is, its shape for one sequence of ``T``
tokens (batch dimension dropped; ``d`` hidden size, ``h`` query heads, ``g`` key/value heads,
``hd`` head size, ``m`` MLP width) and the name llama.cpp's graph gives the same tensor, so a
capture can be compared with a llama.cpp eval-callback dump (llama.cpp appends ``-{layer}`` to
per-layer names).

Every name TransformerLens' ``HookedTransformer`` also defines holds the tensor it holds there, for
a model loaded with no weight processing (``fold_ln``, centring and the rest off), and CI compares
them (tests/integration/test_transformer_lens_parity.py). In particular ``ln*.hook_normalized`` is
the RMSNorm output *before* its weight, as in TransformerLens; the weighted output, what the next
projection reads, is ``ln*.hook_weighted``, a name TransformerLens lacks. Names beyond
TransformerLens: ``ln*.hook_weighted``, and ``attn.cache_k``/``attn.cache_v``, the keys and values
as the KV cache holds them after the pass. TransformerLens names raylens lacks:
``attn.hook_attn_scores`` (pre-softmax scores), ``unembed.hook_in``/``hook_out`` (the same tensors
as ``ln_final.hook_weighted`` and the logits) and ``mlp.hook_in``/``attn.hook_*_input`` (off
unless TransformerLens is told to split its inputs).

One name, two tensors at the top: the last block's ``hook_resid_post`` is the residual stream
before the final norm in named capture (as in TransformerLens), but a generation *step*'s capture
of the last layer (mod events, the SAE hand-off, :mod:`engine.model.capture`) reads transformers'
``hidden_states``, whose last entry is after the final norm, weight applied: the step tensor of
the last layer equals named capture's ``ln_final.hook_weighted``. Every other layer is the same
tensor on both paths.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Iterable

from engine.errors import InvalidRequestError, LayerOutOfRangeError

__all__ = ["HookName", "HookSpec", "HOOK_SPECS", "parse_hook_name", "expand_hook_names", "hook_spec", "resid_post",
           "attn_pattern", "BLOCK_HOOKS", "GLOBAL_HOOKS"]


@dataclass(frozen=True)
class HookSpec:
    """One internal: its shape for one sequence, what it is, and llama.cpp's name (None: no
    single llama.cpp tensor holds it)."""

    shape: str
    description: str
    llama_cpp: str | None


# In forward order. Per-layer hooks are relative to ``blocks.{L}.``.
_BLOCK_SPECS: dict[str, HookSpec] = {
    "hook_resid_pre": HookSpec("(T, d)", "residual stream entering the block (the previous block's output)", None),
    "ln1.hook_scale": HookSpec("(T, 1)", "input RMSNorm's divisor sqrt(mean(x^2) + eps) of the residual stream",
                               None),
    "ln1.hook_normalized": HookSpec("(T, d)", "input RMSNorm output before its weight: resid_pre / ln1.hook_scale",
                                    None),
    "ln1.hook_weighted": HookSpec("(T, d)", "input RMSNorm output, weight applied: what q/k/v project", "attn_norm"),
    "attn.hook_q": HookSpec("(T, h, hd)", "queries, q_proj output split into heads, before RoPE", "Qcur"),
    "attn.hook_k": HookSpec("(T, g, hd)", "keys, k_proj output split into key/value heads, before RoPE", "Kcur"),
    "attn.hook_v": HookSpec("(T, g, hd)", "values, v_proj output split into key/value heads", "Vcur"),
    "attn.hook_rot_q": HookSpec("(T, h, hd)", "queries after RoPE: what the attention scores use", "Qcur"),
    "attn.hook_rot_k": HookSpec("(T, g, hd)", "keys after RoPE: what the attention scores use", "Kcur"),
    "attn.cache_k": HookSpec("(T, g, hd)", "keys as the KV cache holds them after the pass (post-RoPE)", "cache_k"),
    "attn.cache_v": HookSpec("(T, g, hd)", "values as the KV cache holds them after the pass", "cache_v"),
    "attn.hook_pattern": HookSpec("(h, T, T)", "post-softmax attention, causal mask applied, float32",
                                  "kq_soft_max"),
    "attn.hook_z": HookSpec("(T, h, hd)", "attention-weighted values per head, before o_proj", "kqv_out"),
    "hook_attn_out": HookSpec("(T, d)", "attention output after o_proj, before the residual add", "attn_out"),
    "hook_resid_mid": HookSpec("(T, d)", "residual stream after adding the attention output", "ffn_inp"),
    "ln2.hook_scale": HookSpec("(T, 1)", "post-attention RMSNorm's divisor sqrt(mean(x^2) + eps) of resid_mid",
                               None),
    "ln2.hook_normalized": HookSpec("(T, d)", "post-attention RMSNorm output before its weight: "
                                    "resid_mid / ln2.hook_scale", None),
    "ln2.hook_weighted": HookSpec("(T, d)", "post-attention RMSNorm output, weight applied: the MLP input",
                                  "ffn_norm"),
    "mlp.hook_pre": HookSpec("(T, m)", "gate_proj output, before the activation", "ffn_gate"),
    "mlp.hook_pre_linear": HookSpec("(T, m)", "up_proj output (the linear half of the gated MLP)", "ffn_up"),
    "mlp.hook_post": HookSpec("(T, m)", "gated activation silu(gate_proj x) * up_proj x, before down_proj",
                              "ffn_swiglu"),
    "hook_mlp_out": HookSpec("(T, d)", "MLP output after down_proj, before the residual add", "ffn_out"),
    "hook_resid_post": HookSpec("(T, d)", "residual stream leaving the block", "l_out"),
}
_GLOBAL_SPECS: dict[str, HookSpec] = {
    "hook_embed": HookSpec("(T, d)", "token embeddings: the residual stream entering block 0", "inp_embd"),
    "ln_final.hook_scale": HookSpec("(T, 1)", "final RMSNorm's divisor sqrt(mean(x^2) + eps) of the last "
                                    "block's output", None),
    "ln_final.hook_normalized": HookSpec("(T, d)", "final RMSNorm output before its weight: the last block's "
                                         "hook_resid_post / ln_final.hook_scale", None),
    "ln_final.hook_weighted": HookSpec("(T, d)", "final RMSNorm output, weight applied: what lm_head reads",
                                       "result_norm"),
}
HOOK_SPECS: dict[str, HookSpec] = {**_BLOCK_SPECS, **_GLOBAL_SPECS}

BLOCK_HOOKS = tuple(_BLOCK_SPECS)
GLOBAL_HOOKS = tuple(_GLOBAL_SPECS)

_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


@dataclass(frozen=True, order=True)
class HookName:
    """A parsed internal name: ``layer`` is None for the model-wide hooks."""

    layer: int | None
    hook: str

    def __str__(self) -> str:
        return self.hook if self.layer is None else f"blocks.{self.layer}.{self.hook}"

    @property
    def spec(self) -> HookSpec:
        return HOOK_SPECS[self.hook]


def parse_hook_name(name: str) -> HookName:
    """``blocks.3.attn.hook_q`` → ``HookName(3, "attn.hook_q")``; unknown names are refused."""
    if not isinstance(name, str):
        raise InvalidRequestError(f"a hook name must be a string, got {name!r}", parameter="names", value=name)
    if name in GLOBAL_HOOKS:
        return HookName(None, name)
    match = _BLOCK.match(name)
    if match is None or match.group(2) not in BLOCK_HOOKS:
        raise InvalidRequestError(
            f"`{name}` is not a known internal; use blocks.<layer>.<hook> with hook one of "
            f"{', '.join(BLOCK_HOOKS)}, or one of {', '.join(GLOBAL_HOOKS)}", parameter="names", value=name)
    return HookName(int(match.group(1)), match.group(2))


def hook_spec(name: HookName | str) -> HookSpec:
    """The :class:`HookSpec` of a name (parsed first when given as a string)."""
    return (parse_hook_name(name) if isinstance(name, str) else name).spec


def _forward_order(num_layers: int) -> list[HookName]:
    names = [HookName(None, "hook_embed")]
    names += [HookName(layer, hook) for layer in range(num_layers) for hook in BLOCK_HOOKS]
    return names + [HookName(None, hook) for hook in GLOBAL_HOOKS if hook != "hook_embed"]


def expand_hook_names(patterns: Iterable[str], num_layers: int) -> list[HookName]:
    """Every internal of a ``num_layers`` model matching any of ``patterns``, in forward order.

    Patterns are shell globs (``fnmatch``, case-sensitive) over the full names:
    ``blocks.*.hook_resid_post``, ``blocks.3.attn.*``, ``*`` for everything. A name without
    wildcards must be exact and in range; a pattern that matches nothing is refused, because a
    typo would otherwise silently capture less than asked.
    """
    if isinstance(patterns, str):
        raise InvalidRequestError(f"`names` must be a list of names or globs, got the string {patterns!r}",
                                  parameter="names", value=patterns)
    patterns = list(patterns)
    if not patterns:
        raise InvalidRequestError("`names` must hold at least one name or glob, got []", parameter="names", value=[])
    universe = _forward_order(num_layers)
    wanted: set[HookName] = set()
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError(f"`names` must hold non-empty strings, got {pattern!r}", parameter="names",
                                      value=pattern)
        if not any(c in pattern for c in "*?["):
            name = parse_hook_name(pattern)
            if name.layer is not None and not 0 <= name.layer < num_layers:
                raise LayerOutOfRangeError(
                    f"`names` must use layers in [0, {num_layers - 1}] for this model, got `{pattern}`",
                    parameter="names", value=pattern)
            wanted.add(name)
            continue
        matched = {name for name in universe if fnmatch.fnmatchcase(str(name), pattern)}
        if not matched:
            raise InvalidRequestError(
                f"`names` pattern `{pattern}` must match at least one internal, e.g. blocks.*.hook_resid_post, "
                f"blocks.3.attn.*, *; got no match", parameter="names", value=pattern)
        wanted |= matched
    return [name for name in universe if name in wanted]


def resid_post(layer: int) -> HookName:
    return HookName(layer, "hook_resid_post")


def attn_pattern(layer: int) -> HookName:
    return HookName(layer, "attn.hook_pattern")
