"""The model families raylens runs, one small declarative entry each: where a transformers
architecture keeps every tensor the TransformerLens vocabulary (:mod:`engine.model.hook_names`)
names.

An entry lists module paths — model-wide from the base model (``model.model``,
``model.transformer``, ``model.gpt_neox``), per block from one decoder layer, attention and MLP
parts from those — and the few facts that change which names exist or how they are derived:

* a fused query/key/value projection and how it splits (GPT-2's ``c_attn``: three blocks of ``d``;
  GPT-NeoX's ``query_key_value``: per head, ``(h, 3 · hd)``);
* per-head q/k norms (Qwen3, Gemma 3: ``attn.q_norm.*``, and RoPE rotates the normed q/k), and
  whether they see heads or positions first (Gemma 3 norms ``(B, heads, T, hd)``, Qwen3
  ``(B, T, heads, hd)``);
* norms after attention and after the MLP (Gemma 2/3: ``ln1_post``/``ln2_post``; then
  ``hook_attn_out``/``hook_mlp_out`` are those norms' outputs, what is added to the residual);
* a gated MLP (``mlp.hook_pre`` is the gate, ``mlp.hook_pre_linear`` the up projection) or a plain
  one (``mlp.hook_pre`` is the first projection, no ``hook_pre_linear``);
* attention and MLP in parallel, both reading ``resid_pre`` (GPT-NeoX when its config says so: no
  ``hook_resid_mid``);
* RMSNorm or LayerNorm (which divisor ``hook_scale`` is), RoPE or learned positions (GPT-2:
  ``hook_pos_embed``, no ``hook_rot_*``);
* how the model takes a prepared attention mask: one 4-D mask for every layer (Llama, Mistral,
  GPT-2, GPT-NeoX), or one per layer type (``{"full_attention": …, "sliding_attention": …}``:
  Qwen2/3, Gemma 2/3 — see :mod:`engine.model.masks`).

Everything else (embedding scaling, ``(1 + weight)`` RMSNorm, logit soft-capping, partial rotary)
the model's own forward does; the taps read its modules' inputs and outputs, so they need no entry.
A model whose class is not listed is refused when it is loaded, naming the supported families.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.model.hook_names import BLOCK_HOOKS, GLOBAL_HOOKS, HookSet

__all__ = ["Family", "FAMILIES", "family_of", "family_for_architectures", "hook_set", "supported_families",
           "get_path"]

FusedQKV = Literal["thirds", "per_head"]


@dataclass(frozen=True)
class Family:
    """Where one architecture keeps its tensors. Paths are dotted attribute paths: model-wide ones
    from the base model, ``ln*``/``attention``/``mlp`` from a block, ``qkv``/``qk_norm``/``out_proj``
    from the attention module, ``mlp_*`` from the MLP module."""

    name: str
    label: str  # as the README and errors spell it
    architectures: tuple[str, ...]  # transformers ``*ForCausalLM`` class names
    embed: str
    layers: str
    final_norm: str
    pos_embed: str | None = None
    ln1: str = "input_layernorm"
    attention: str = "self_attn"
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one name: a fused projection
    fused_qkv: FusedQKV | None = None
    qk_norm: tuple[str, str] | None = None
    qk_norm_heads_first: bool = False  # the q/k norms see (B, heads, T, hd) (Gemma 3), not (B, T, heads, hd)
    out_proj: str = "o_proj"
    ln1_post: str | None = None
    ln2: str = "post_attention_layernorm"
    mlp: str = "mlp"
    mlp_gate: str | None = "gate_proj"  # None: a plain MLP
    mlp_in: str = "up_proj"  # the gated MLP's up projection, or a plain MLP's first projection
    mlp_out: str = "down_proj"
    ln2_post: str | None = None
    parallel_flag: str | None = None  # config attribute that puts attention and MLP in parallel
    norm: Literal["rms", "layer"] = "rms"
    rotary: bool = True
    masks: Literal["one", "by_layer_type"] = "one"

    def __post_init__(self) -> None:
        if (len(self.qkv) == 1) != (self.fused_qkv is not None):
            raise ValueError(f"family {self.name}: a fused projection needs fused_qkv, three need none")

    def parallel(self, config: Any) -> bool:
        """Whether attention and MLP both read ``resid_pre`` in a model of this ``config``."""
        return bool(self.parallel_flag and getattr(config, self.parallel_flag, False))


LLAMA = Family("llama", "Llama", ("LlamaForCausalLM",), embed="embed_tokens", layers="layers", final_norm="norm")
MISTRAL = dataclasses.replace(LLAMA, name="mistral", label="Mistral", architectures=("MistralForCausalLM",))
QWEN2 = dataclasses.replace(LLAMA, name="qwen2", label="Qwen2", architectures=("Qwen2ForCausalLM",),
                            masks="by_layer_type")
QWEN3 = dataclasses.replace(QWEN2, name="qwen3", label="Qwen3", architectures=("Qwen3ForCausalLM",),
                            qk_norm=("q_norm", "k_norm"))
GEMMA2 = dataclasses.replace(LLAMA, name="gemma2", label="Gemma 2", architectures=("Gemma2ForCausalLM",),
                             ln1_post="post_attention_layernorm", ln2="pre_feedforward_layernorm",
                             ln2_post="post_feedforward_layernorm", masks="by_layer_type")
GEMMA3 = dataclasses.replace(GEMMA2, name="gemma3", label="Gemma 3", architectures=("Gemma3ForCausalLM",),
                             qk_norm=("q_norm", "k_norm"), qk_norm_heads_first=True)
GPT2 = Family("gpt2", "GPT-2", ("GPT2LMHeadModel",), embed="wte", pos_embed="wpe", layers="h", final_norm="ln_f",
              ln1="ln_1", attention="attn", qkv=("c_attn",), fused_qkv="thirds", out_proj="c_proj", ln2="ln_2",
              mlp_gate=None, mlp_in="c_fc", mlp_out="c_proj", norm="layer", rotary=False)
GPT_NEOX = Family("gpt_neox", "GPT-NeoX / Pythia", ("GPTNeoXForCausalLM",), embed="embed_in", layers="layers",
                  final_norm="final_layer_norm", attention="attention", qkv=("query_key_value",),
                  fused_qkv="per_head", out_proj="dense", mlp_gate=None, mlp_in="dense_h_to_4h",
                  mlp_out="dense_4h_to_h", parallel_flag="use_parallel_residual", norm="layer")

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, GPT2, GPT_NEOX)}
_BY_ARCHITECTURE = {arch: family for family in FAMILIES.values() for arch in family.architectures}


def supported_families() -> str:
    """``Llama (LlamaForCausalLM), Mistral (MistralForCausalLM), …`` for messages and docs."""
    return ", ".join(f"{f.label} ({', '.join(f.architectures)})" for f in FAMILIES.values())


def family_for_architectures(architectures: Any, model_id: str | None = None) -> Family:
    """The family of a model whose config lists ``architectures``; anything else is refused."""
    for arch in architectures or ():
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    what = f"{model_id!r} " if model_id else ""
    raise UnsupportedModelError(f"`model_id` {what}must be a model of a supported family: {supported_families()}; got "
                         f"architectures {list(architectures or [])}", parameter="model_id",
                         value=model_id or list(architectures or []))


def family_of(model: Any) -> Family:
    """The family of a loaded transformers model (its class, or its config's ``architectures``)."""
    names = [type(model).__name__, *(getattr(getattr(model, "config", None), "architectures", None) or [])]
    return family_for_architectures(names)


def hook_set(family: Family, config: Any) -> HookSet:
    """The names a model of ``family`` with ``config`` computes (a subset of the vocabulary)."""
    absent: set[str] = set()
    if family.qk_norm is None:
        absent |= {h for h in BLOCK_HOOKS if h.startswith(("attn.q_norm.", "attn.k_norm."))}
    if family.ln1_post is None:
        absent |= {"ln1_post.hook_scale", "ln1_post.hook_normalized"}
    if family.ln2_post is None:
        absent |= {"ln2_post.hook_scale", "ln2_post.hook_normalized"}
    if not family.rotary:
        absent |= {"attn.hook_rot_q", "attn.hook_rot_k"}
    if family.mlp_gate is None:
        absent.add("mlp.hook_pre_linear")
    if family.parallel(config):
        absent.add("hook_resid_mid")
    model = [h for h in GLOBAL_HOOKS if h != "hook_pos_embed" or family.pos_embed is not None]
    return HookSet(tuple(h for h in BLOCK_HOOKS if h not in absent), tuple(model))


def get_path(root: Any, path: str) -> Any:
    """``root.a.b`` for ``path = "a.b"``; a module a family entry names must exist."""
    try:
        return operator.attrgetter(path)(root)
    except AttributeError as err:
        raise ModelLoadError(f"the model lacks `{path}` ({type(root).__name__}): its family entry in "
                             f"engine/model/families.py does not match this transformers version",
                             parameter="model") from err
