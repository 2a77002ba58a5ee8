"""Tiny random-weight models of every supported family, and their TransformerLens twins, for the
family tests (tests/integration/test_model_families.py). Nothing is downloaded.

Each model is its family's transformers config at 2 layers of width 64 with the embedded model's
tokenizer and vocabulary (the project's random-model recipe: ``configs/models/near-free.json``,
``pipelines.bench.batching.build_random_model``), seeded, saved once per test session. The
weights are drawn wider than transformers' default (``initializer_range``): at the default the
logits of a 2-layer model are almost flat, and greedy decoding would compare near-ties. Gemma's
LM head is untied from its (scaled) embeddings, else every step would predict its input token.
Sliding windows are shorter than the test prompts, so a sliding layer that saw too much would
change the output.

TransformerLens is built from the same weights offline: from the saved directory where its loader
reads the architecture from the config (Llama, Mistral, Qwen2, Qwen3, GPT-2, GPT-NeoX), and from
a config written here for Gemma 2/3, whose TransformerLens configs are keyed by the published
model names; either way the weights go through TransformerLens' own converter with every weight
processing step off, so a name holds the tensor TransformerLens defines.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

WIDTH, LAYERS, HEADS, HEAD_DIM = 64, 2, 4, 16
WINDOW = 6  # sliding window, shorter than every test prompt
INIT_RANGE = 0.2

#: family → (transformers model_type, config fields beyond the shared ones)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(intermediate_size=128, num_key_value_heads=2, head_dim=HEAD_DIM)),
    "mistral": ("mistral", dict(intermediate_size=128, num_key_value_heads=2, head_dim=HEAD_DIM,
                                sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(intermediate_size=128, num_key_value_heads=2)),
    "qwen3": ("qwen3", dict(intermediate_size=128, num_key_value_heads=2, head_dim=HEAD_DIM)),
    "gemma2": ("gemma2", dict(intermediate_size=128, num_key_value_heads=2, head_dim=HEAD_DIM, sliding_window=WINDOW,
                              query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=5.0,
                              final_logit_softcapping=3.0, tie_word_embeddings=False)),
    "gemma3": ("gemma3_text", dict(intermediate_size=128, num_key_value_heads=2, head_dim=HEAD_DIM,
                                   sliding_window=WINDOW, query_pre_attn_scalar=HEAD_DIM, sliding_window_pattern=2,
                                   tie_word_embeddings=False)),
    "gpt2": ("gpt2", dict(n_positions=512, n_ctx=512)),
    "gpt_neox": ("gpt_neox", dict(intermediate_size=256, rotary_pct=0.25, max_position_embeddings=512,
                                  use_parallel_residual=True)),
}
FAMILY_NAMES = tuple(TINY_CONFIGS)


def build_tiny_model(family: str, root: Path) -> Path:
    """``root/<family>``: a directory ``from_pretrained`` loads (config, weights, tokenizer)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from engine.model.loading import resolve_model_path

    # a neutral directory name: TransformerLens picks a config by "llama"/"gemma" anywhere in a path
    target = Path(root) / f"tiny-model-{FAMILY_NAMES.index(family)}"
    if (target / "config.json").is_file():
        return target
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("embedded:smollm2-135m-instruct"))
    model_type, fields = TINY_CONFIGS[family]
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  initializer_range=INIT_RANGE, **fields)
    torch.manual_seed(0)  # a fixture's one-off build: the same weights every session
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _lift_norms(model)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def _lift_norms(model: Any) -> None:
    """Random norm weights too (transformers starts them at 1, Gemma's at 0 of ``1 + w``): a
    norm's weight must change its output for ``hook_normalized`` vs ``hook_weighted`` to be told
    apart, and a LayerNorm's bias too."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or ".ln_" in name) and param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.3)


def _gemma_cfg(hf: Any, family: str) -> dict[str, Any]:
    """TransformerLens' Gemma 2/3 config (its published-model dicts' fields) for ``hf``."""
    types = ["local" if t == "sliding_attention" else "global" for t in hf.layer_types]
    cfg = dict(d_model=hf.hidden_size, d_head=hf.head_dim, n_heads=hf.num_attention_heads, d_mlp=hf.intermediate_size,
               n_layers=hf.num_hidden_layers, n_ctx=512, eps=hf.rms_norm_eps, d_vocab=hf.vocab_size,
               act_fn=hf.hidden_activation, normalization_type="RMS", positional_embedding_type="rotary",
               use_attn_scale=True, attn_scale=float(hf.query_pre_attn_scalar) ** 0.5,
               n_key_value_heads=hf.num_key_value_heads, window_size=hf.sliding_window, use_local_attn=True,
               attn_types=types, gated_mlp=True, final_rms=True, use_normalization_before_and_after=True,
               original_architecture="Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM",
               tokenizer_prepends_bos=True, model_name=f"tiny-{family}")
    if family == "gemma2":
        cfg.update(rotary_base=hf.rope_parameters["rope_theta"], attn_scores_soft_cap=hf.attn_logit_softcapping,
                   output_logits_soft_cap=hf.final_logit_softcapping)
    else:
        cfg.update(rotary_base=hf.rope_parameters["full_attention"]["rope_theta"],
                   rotary_base_local=hf.rope_parameters["sliding_attention"]["rope_theta"], use_qk_norm=True)
    return cfg


def transformer_lens_model(family: str, path: Path, hf_model: Any) -> Any:
    """TransformerLens' ``HookedTransformer`` of ``hf_model``'s weights, no weight processing."""
    import torch
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens import loading_from_pretrained as tl_loading

    if family in ("gemma2", "gemma3"):
        cfg = HookedTransformerConfig(**_gemma_cfg(hf_model.config, family), dtype=torch.float32, device="cpu")
    else:
        cfg = tl_loading.get_pretrained_model_config(str(path), fold_ln=False, device="cpu", dtype=torch.float32)
    state = tl_loading.get_pretrained_state_dict(str(path), cfg, hf_model=hf_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # HookedTransformer is TransformerLens 3's stable API
        model = HookedTransformer(cfg)
    model.load_and_process_state_dict(state, fold_ln=False, center_writing_weights=False, center_unembed=False,
                                      fold_value_biases=False, refactor_factored_attn_matrices=False)
    return model.eval()


# ----------------------------------------------------------------------------- release SAEs

#: family → the registry release (engine/services/sae.py) whose cfg its test SAE takes; Qwen has no
#: sae-lens release, so its families take a locally trained SAE's cfg (raylens' own format).
FAMILY_RELEASES: dict[str, str | None] = {
    "llama": "llama_scope_lxr_8x", "mistral": "mistral-7b-res-wg", "qwen2": None, "qwen3": None,
    "gemma2": "gemma-scope-2b-pt-res-canonical", "gemma3": "gemma-scope-2-1b-pt-res", "gpt2": "gpt2-small-res-jb",
    "gpt_neox": "pythia-70m-deduped-res-sm",
}
SAE_WIDTH = 256


def release_cfg(release: str | None, layer: int) -> dict[str, Any]:
    """The flat cfg sae-lens builds when it loads ``release``'s SAE for ``layer`` (before it reads
    any weight), with the tiny model's widths. Gemma Scope's comes from sae-lens' own loader (it
    needs no download); the others' cfgs live on the hub, so their routing fields are written from
    the release table and the loaders: the hook the SAE id names (``blocks.L.hook_resid_pre`` for
    GPT-2 res-jb and Mistral res-wg), the architecture, the input normalisation, and the
    release's ``config_overrides`` (GPT-2 res-jb: ``center_writing_weights``) read from sae-lens'
    table. Llama Scope's norm scaling is folded into its weights by ``SAE.from_pretrained``, which
    then sets ``normalize_activations`` to none, as here."""
    from sae_lens.loading.pretrained_sae_loaders import get_gemma_2_config_from_hf
    from sae_lens.loading.pretrained_saes_directory import get_config_overrides, get_repo_id_and_folder_name

    from engine.services.sae import resolve_sae

    base = dict(d_in=WIDTH, d_sae=SAE_WIDTH, dtype="float32", device="cpu", apply_b_dec_to_input=False,
                normalize_activations="none", hook_head_index=None, prepend_bos=True, context_size=128)
    if release is None:  # a TopK SAE as raylens' own trainer writes it (pipelines/sae_training)
        return {**base, "architecture": "topk", "k": 16, "hook_name": f"blocks.{layer}.hook_resid_post",
                "model_name": "local"}
    sae_id = resolve_sae(release).sae_id(layer)
    overrides = get_config_overrides(release, sae_id)
    if release == "gemma-scope-2b-pt-res-canonical":
        repo, folder = get_repo_id_and_folder_name(release, sae_id)
        cfg = get_gemma_2_config_from_hf(repo, folder, "cpu", cfg_overrides=overrides)
        return {**cfg, "d_in": WIDTH, "d_sae": SAE_WIDTH}
    by_release = {
        "llama_scope_lxr_8x": dict(architecture="jumprelu", hook_name=f"blocks.{layer}.hook_resid_post",
                                   model_name="meta-llama/Llama-3.1-8B"),
        "gemma-scope-2-1b-pt-res": dict(architecture="jumprelu", hook_name=f"blocks.{layer}.hook_resid_post",
                                        model_name="google/gemma-3-1b-pt",
                                        hf_hook_name=f"model.layers.{layer}.output"),
        "mistral-7b-res-wg": dict(architecture="standard", hook_name=sae_id, model_name="mistral-7b",
                                  apply_b_dec_to_input=True),
        "gpt2-small-res-jb": dict(architecture="standard", hook_name=sae_id, model_name="gpt2-small",
                                  apply_b_dec_to_input=True),
        "pythia-70m-deduped-res-sm": dict(architecture="standard", hook_name=sae_id, model_name="pythia-70m-deduped",
                                          apply_b_dec_to_input=True),
    }
    return {**base, **by_release[release], **overrides}


def build_release_sae(family: str, layer: int, root: Path) -> Path:
    """``root/<family>-sae``: an SAE in sae-lens' on-disk format with ``release_cfg``'s cfg and
    random weights (JumpReLU thresholds low enough that features fire)."""
    import torch
    from sae_lens import SAE
    from sae_lens.loading.pretrained_sae_loaders import handle_config_defaulting

    target = Path(root) / f"{family}-sae"
    if (target / "cfg.json").is_file():
        return target
    sae = SAE.from_dict(handle_config_defaulting(release_cfg(FAMILY_RELEASES[family], layer)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sae.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * (0.05 if name == "threshold" else 1.0))
    sae.save_model(target)
    return target
