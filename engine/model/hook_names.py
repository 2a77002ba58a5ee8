"""The names of model internals, in the TransformerLens vocabulary: one place that spells them.

Every consumer of internals (mod events, the SAE hand-off, SAE training, named-tensor capture)
asks for tensors by these names, e.g. ``blocks.16.hook_resid_post`` (the residual stream after
layer 16) or ``blocks.16.attn.hook_pattern`` (layer 16's post-softmax attention). A name is parsed
once into a typed :class:`HookName`; code never matches on the string again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import InvalidRequestError

__all__ = ["HookName", "parse_hook_name", "resid_post", "attn_pattern", "BLOCK_HOOKS", "GLOBAL_HOOKS"]

# per-layer hooks, relative to ``blocks.{L}.``
BLOCK_HOOKS = (
    "hook_resid_pre",
    "ln1.hook_normalized",
    "attn.hook_q",
    "attn.hook_k",
    "attn.hook_v",
    "attn.hook_pattern",
    "attn.hook_z",
    "hook_attn_out",
    "hook_resid_mid",
    "ln2.hook_normalized",
    "mlp.hook_post",
    "hook_mlp_out",
    "hook_resid_post",
)
GLOBAL_HOOKS = ("hook_embed", "ln_final.hook_normalized")

_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


@dataclass(frozen=True, order=True)
class HookName:
    """A parsed internal name: ``layer`` is None for the model-wide hooks."""

    layer: int | None
    hook: str

    def __str__(self) -> str:
        return self.hook if self.layer is None else f"blocks.{self.layer}.{self.hook}"


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


def resid_post(layer: int) -> HookName:
    return HookName(layer, "hook_resid_post")


def attn_pattern(layer: int) -> HookName:
    return HookName(layer, "attn.hook_pattern")
