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
them for every supported model family (tests/integration/test_transformer_lens_parity.py on the
embedded model, tests/integration/test_model_families.py on a small random model of each family).
A family computes a subset of the vocabulary (:class:`HookSet`, from :mod:`engine.model.families`).
In particular ``ln*.hook_normalized`` is the norm output *before* its weight, as in
TransformerLens; the weighted output, what the next projection reads, is ``ln*.hook_weighted``, a
name TransformerLens lacks. Names beyond
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

__all__ = ["HookName", "HookSpec", "HookSet", "VOCABULARY", "HOOK_SPECS", "parse_hook_name", "expand_hook_names",
           "hook_spec", "resid_post", "attn_pattern", "BLOCK_HOOKS", "GLOBAL_HOOKS"]


@dataclass(frozen=True)
class HookSpec:
    """One internal: its shape for one sequence, what it is, and llama.cpp's name (None: no
    single llama.cpp tensor holds it)."""

    shape: str
    description: str
    llama_cpp: str | None


# In forward order. Per-layer hooks are relative to ``blocks.{L}.``. This is the whole vocabulary;
# each model family has the subset its architecture computes (:mod:`engine.model.families`): only
# Gemma 2/3 have ``ln1_post``/``ln2_post``, only Qwen3 and Gemma 3 ``attn.q_norm``/``attn.k_norm``,
# GPT-2 has no RoPE (no ``hook_rot_*``), a parallel block (GPT-NeoX) no ``hook_resid_mid``, and a
# plain MLP (GPT-2, GPT-NeoX) no ``mlp.hook_pre_linear``. A norm's ``hook_scale`` is the divisor of
# an RMSNorm, sqrt(mean(x^2) + eps), or of a LayerNorm, sqrt(var(x) + eps) (its input centred first),
# as in TransformerLens.
_BLOCK_SPECS: dict[str, HookSpec] = {
    "hook_resid_pre": HookSpec("(T, d)", "residual stream entering the block (the previous block's output)", None),
    "ln1.hook_scale": HookSpec("(T, 1)", "input norm's divisor of the residual stream: sqrt(mean(x^2) + eps) "
                               "(RMSNorm) or sqrt(var(x) + eps) (LayerNorm)", None),
    "ln1.hook_normalized": HookSpec("(T, d)", "input norm output before its weight (and bias): resid_pre "
                                    "(centred, for a LayerNorm) / ln1.hook_scale", None),
    "ln1.hook_weighted": HookSpec("(T, d)", "input norm output, weight (and bias) applied: what q/k/v project",
                                  "attn_norm"),
    "attn.hook_q": HookSpec("(T, h, hd)", "queries: the query projection split into heads, before RoPE (and "
                            "before the q norm, where there is one)", "Qcur"),
    "attn.hook_k": HookSpec("(T, g, hd)", "keys: the key projection split into key/value heads, before RoPE (and "
                            "before the k norm, where there is one)", "Kcur"),
    "attn.hook_v": HookSpec("(T, g, hd)", "values: the value projection split into key/value heads", "Vcur"),
    "attn.q_norm.hook_scale": HookSpec("(T, h, 1)", "query norm's divisor sqrt(mean(q^2) + eps) per head", None),
    "attn.q_norm.hook_normalized": HookSpec("(T, h, hd)", "query norm output before its weight: hook_q / "
                                            "q_norm.hook_scale", None),
    "attn.k_norm.hook_scale": HookSpec("(T, g, 1)", "key norm's divisor sqrt(mean(k^2) + eps) per head", None),
    "attn.k_norm.hook_normalized": HookSpec("(T, g, hd)", "key norm output before its weight: hook_k / "
                                            "k_norm.hook_scale", None),
    "attn.hook_rot_q": HookSpec("(T, h, hd)", "queries after RoPE (and the q norm): what the attention scores use",
                                "Qcur"),
    "attn.hook_rot_k": HookSpec("(T, g, hd)", "keys after RoPE (and the k norm): what the attention scores use",
                                "Kcur"),
    "attn.cache_k": HookSpec("(T, g, hd)", "keys as the KV cache holds them after the pass (post-RoPE)", "cache_k"),
    "attn.cache_v": HookSpec("(T, g, hd)", "values as the KV cache holds them after the pass", "cache_v"),
    "attn.hook_pattern": HookSpec("(h, T, T)", "post-softmax attention, causal (and sliding-window) mask and "
                                  "any logit soft-capping applied, float32", "kq_soft_max"),
    "attn.hook_z": HookSpec("(T, h, hd)", "attention-weighted values per head, before the output projection",
                            "kqv_out"),
    "ln1_post.hook_scale": HookSpec("(T, 1)", "post-attention norm's divisor sqrt(mean(x^2) + eps) of the "
                                    "attention output", None),
    "ln1_post.hook_normalized": HookSpec("(T, d)", "post-attention norm output before its weight", None),
    "hook_attn_out": HookSpec("(T, d)", "attention output as added to the residual stream: after the output "
                              "projection (and the post-attention norm, where there is one)", "attn_out"),
    "hook_resid_mid": HookSpec("(T, d)", "residual stream after adding the attention output", "ffn_inp"),
    "ln2.hook_scale": HookSpec("(T, 1)", "MLP input norm's divisor (of resid_mid; of resid_pre in a parallel "
                               "block)", None),
    "ln2.hook_normalized": HookSpec("(T, d)", "MLP input norm output before its weight (and bias): its input "
                                    "(centred, for a LayerNorm) / ln2.hook_scale", None),
    "ln2.hook_weighted": HookSpec("(T, d)", "MLP input norm output, weight (and bias) applied: the MLP input",
                                  "ffn_norm"),
    "mlp.hook_pre": HookSpec("(T, m)", "the MLP's pre-activation: the gate projection (gated MLP) or its first "
                             "projection", "ffn_gate"),
    "mlp.hook_pre_linear": HookSpec("(T, m)", "up projection output (the linear half of a gated MLP)", "ffn_up"),
    "mlp.hook_post": HookSpec("(T, m)", "the MLP's activation: act(gate) * up (gated MLP) or act(pre), before the "
                              "down projection", "ffn_swiglu"),
    "ln2_post.hook_scale": HookSpec("(T, 1)", "post-MLP norm's divisor sqrt(mean(x^2) + eps) of the MLP output",
                                    None),
    "ln2_post.hook_normalized": HookSpec("(T, d)", "post-MLP norm output before its weight", None),
    "hook_mlp_out": HookSpec("(T, d)", "MLP output as added to the residual stream: after the down projection "
                             "(and the post-MLP norm, where there is one)", "ffn_out"),
    "hook_resid_post": HookSpec("(T, d)", "residual stream leaving the block", "l_out"),
}
_GLOBAL_SPECS: dict[str, HookSpec] = {
    "hook_embed": HookSpec("(T, d)", "token embeddings (Gemma: already scaled by sqrt(d)): the residual stream "
                           "entering block 0, plus hook_pos_embed where there is one", "inp_embd"),
    "hook_pos_embed": HookSpec("(T, d)", "learned absolute position embeddings (GPT-2), added to hook_embed", None),
    "ln_final.hook_scale": HookSpec("(T, 1)", "final norm's divisor (RMSNorm or LayerNorm, as ln1.hook_scale) of "
                                    "the last block's output", None),
    "ln_final.hook_normalized": HookSpec("(T, d)", "final norm output before its weight (and bias): the last "
                                         "block's hook_resid_post (centred, for a LayerNorm) / "
                                         "ln_final.hook_scale", None),
    "ln_final.hook_weighted": HookSpec("(T, d)", "final norm output, weight (and bias) applied: what the LM head "
                                       "reads", "result_norm"),
}
HOOK_SPECS: dict[str, HookSpec] = {**_BLOCK_SPECS, **_GLOBAL_SPECS}

BLOCK_HOOKS = tuple(_BLOCK_SPECS)
GLOBAL_HOOKS = tuple(_GLOBAL_SPECS)
_BEFORE_BLOCKS = ("hook_embed", "hook_pos_embed")  # model-wide names computed before block 0


@dataclass(frozen=True)
class HookSet:
    """The names one model defines: per-block hooks and model-wide hooks, each in the vocabulary's
    forward order. :data:`VOCABULARY` is every name; a loaded model's set comes from its family
    (:func:`engine.model.families.hook_set`)."""

    block: tuple[str, ...] = BLOCK_HOOKS
    model: tuple[str, ...] = GLOBAL_HOOKS

    def __post_init__(self) -> None:
        unknown = [h for h in self.block if h not in _BLOCK_SPECS] + [h for h in self.model if h not in _GLOBAL_SPECS]
        if unknown:
            raise ValueError(f"a HookSet must hold vocabulary names only, got {unknown}")
        object.__setattr__(self, "block", tuple(h for h in BLOCK_HOOKS if h in self.block))
        object.__setattr__(self, "model", tuple(h for h in GLOBAL_HOOKS if h in self.model))

    def forward_order(self, num_layers: int) -> list["HookName"]:
        """Every name of a ``num_layers`` model in forward order."""
        names = [HookName(None, h) for h in self.model if h in _BEFORE_BLOCKS]
        names += [HookName(layer, hook) for layer in range(num_layers) for hook in self.block]
        return names + [HookName(None, h) for h in self.model if h not in _BEFORE_BLOCKS]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, HookName):
            return False
        return name.hook in (self.model if name.layer is None else self.block)


VOCABULARY = HookSet()

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


def expand_hook_names(patterns: Iterable[str], num_layers: int, hooks: HookSet = VOCABULARY) -> list[HookName]:
    """Every internal of a ``num_layers`` model with the names ``hooks`` (a loaded model's
    :class:`HookSet`; default every name of the vocabulary) matching any of ``patterns``, in
    forward order.

    Patterns are shell globs (``fnmatch``, case-sensitive) over the full names:
    ``blocks.*.hook_resid_post``, ``blocks.3.attn.*``, ``*`` for everything. A name without
    wildcards must be exact and in range; a pattern that matches nothing is refused, because a
    typo would otherwise silently capture less than asked. An exact name of the vocabulary
    that this model lacks (``ln1_post.*`` on Llama) is refused, naming the model's own hooks.
    """
    if isinstance(patterns, str):
        raise InvalidRequestError(f"`names` must be a list of names or globs, got the string {patterns!r}",
                                  parameter="names", value=patterns)
    patterns = list(patterns)
    if not patterns:
        raise InvalidRequestError("`names` must hold at least one name or glob, got []", parameter="names", value=[])
    universe = hooks.forward_order(num_layers)
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
            if name not in hooks:
                raise InvalidRequestError(
                    f"`names` must be internals this model computes, got `{pattern}`; its per-block hooks are "
                    f"{', '.join(hooks.block)} and its model-wide ones {', '.join(hooks.model)}",
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
