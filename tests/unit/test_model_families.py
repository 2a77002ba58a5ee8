"""The family table, the names each family computes, the attention masks of sliding-window
layers and the refusal of unsupported architectures (transformers configs only: no weights)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.model.families import FAMILIES, family_for_architectures, hook_set
from engine.model.hook_names import BLOCK_HOOKS, HookName, expand_hook_names
from engine.model.masks import AttentionMasks, layer_windows


def _config(model_type: str, **fields):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, **fields)


def test_every_family_is_found_by_its_architecture_and_others_are_refused_naming_them():
    for family in FAMILIES.values():
        assert family_for_architectures(list(family.architectures)) is family
    with pytest.raises(UnsupportedModelError) as info:
        family_for_architectures(["FalconForCausalLM"], "tiiuae/falcon-7b")
    message = str(info.value)
    assert message.startswith("`model_id` 'tiiuae/falcon-7b' must be a model of a supported family")
    for family in FAMILIES.values():
        assert f"{family.label} ({family.architectures[0]})" in message, family.name
    assert "got architectures ['FalconForCausalLM']" in message and info.value.parameter == "model_id"


def test_an_unsupported_model_is_refused_from_its_config_before_any_weight_is_read(tmp_path):
    from engine.model.loading import load_model_and_tokenizer

    _config("falcon").save_pretrained(tmp_path)  # a config and nothing else: reading weights would fail otherwise
    with pytest.raises(UnsupportedModelError, match="must be a model of a supported family"):
        load_model_and_tokenizer(str(tmp_path), cache_dir=None, device="cpu", dtype=torch.float32,
                                 attn_implementation="sdpa", hf_token=None)


@pytest.mark.parametrize("name,model_type,fields,present,absent", [
    ("llama", "llama", {}, {"mlp.hook_pre_linear", "attn.hook_rot_q", "hook_resid_mid"},
     {"ln1_post.hook_scale", "attn.q_norm.hook_scale", "hook_pos_embed"}),
    ("qwen3", "qwen3", {}, {"attn.q_norm.hook_normalized", "attn.k_norm.hook_scale"}, {"ln2_post.hook_scale"}),
    ("gemma2", "gemma2", {}, {"ln1_post.hook_scale", "ln2_post.hook_normalized", "mlp.hook_pre_linear"},
     {"attn.q_norm.hook_scale"}),
    ("gemma3", "gemma3_text", {}, {"ln1_post.hook_scale", "attn.q_norm.hook_scale"}, set()),
    ("gpt2", "gpt2", {}, {"hook_pos_embed", "hook_resid_mid", "mlp.hook_pre"},
     {"attn.hook_rot_q", "attn.hook_rot_k", "mlp.hook_pre_linear"}),
    ("gpt_neox", "gpt_neox", {"use_parallel_residual": True}, {"attn.hook_rot_k"},
     {"hook_resid_mid", "mlp.hook_pre_linear", "hook_pos_embed"}),
    ("gpt_neox", "gpt_neox", {"use_parallel_residual": False}, {"hook_resid_mid"}, {"mlp.hook_pre_linear"}),
])
def test_each_family_computes_the_names_its_architecture_has(name, model_type, fields, present, absent):
    hooks = hook_set(FAMILIES[name], _config(model_type, **fields))
    names = set(hooks.block) | set(hooks.model)
    assert present <= names and not absent & names, (present - names, absent & names)
    assert {"hook_resid_pre", "attn.hook_pattern", "hook_resid_post", "hook_embed"} <= names
    assert list(hooks.block) == [h for h in BLOCK_HOOKS if h in hooks.block], "forward order"


def test_a_name_the_model_lacks_is_refused_with_the_models_own_names():
    gpt2 = hook_set(FAMILIES["gpt2"], _config("gpt2"))
    with pytest.raises(InvalidRequestError,
                       match="must be internals this model computes, got `blocks.0.attn.hook_rot_q`"):
        expand_hook_names(["blocks.0.attn.hook_rot_q"], 4, gpt2)
    everything = expand_hook_names(["*"], 4, gpt2)
    assert everything[:2] == [HookName(None, "hook_embed"), HookName(None, "hook_pos_embed")]
    assert len(everything) == 4 * len(gpt2.block) + len(gpt2.model)
    assert not any(n.hook == "attn.hook_rot_q" for n in expand_hook_names(["blocks.*.attn.*"], 4, gpt2))


def _reference_masks(window, positions, kv_len):
    """transformers' own mask functions, evaluated one (query position, key) at a time."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    t = torch.tensor
    return torch.tensor([[[[bool(fn(t(b), t(0), q, t(k))) for k in range(kv_len)] for q in row]]
                         for b, row in enumerate(positions)])  # (B, 1, q, kv)


def test_sliding_and_causal_masks_equal_transformers_mask_functions():
    positions = torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8], [9, 10, 11, 12, 13]])  # a padded row, later chunks
    keys = torch.arange(14)
    gemma = AttentionMasks.of(_model("gemma2", sliding_window=3))
    masks = gemma.build(keys, positions)
    assert set(masks) == {"full_attention", "sliding_attention"} and gemma.slides
    assert torch.equal(masks["full_attention"], _reference_masks(None, positions, 14))
    assert torch.equal(masks["sliding_attention"], _reference_masks(3, positions, 14))
    assert not torch.equal(masks["full_attention"], masks["sliding_attention"]), "positive control"
    mistral = AttentionMasks.of(_model("mistral", sliding_window=3)).build(keys, positions)
    assert torch.equal(mistral, _reference_masks(3, positions, 14))  # one tensor: every Mistral layer slides
    llama = AttentionMasks.of(_model("llama"))
    assert torch.equal(llama.build(keys, positions), _reference_masks(None, positions, 14)) and not llama.slides


def _model(model_type, **fields):
    """A stand-in carrying only what the masks read: its class name (the family) and config."""
    config = _config(model_type, **fields)
    family = next(f for f in FAMILIES.values() if f.name == {"gemma3_text": "gemma3"}.get(model_type, model_type))
    return type(family.architectures[0], (), {"config": config})()


def test_layer_windows_follow_the_config_and_unknown_layer_types_are_refused():
    assert layer_windows(_config("gemma2", sliding_window=5), 4) == [5, None, 5, None]
    assert layer_windows(_config("mistral", sliding_window=7), 4) == [7] * 4
    assert layer_windows(_config("mistral", sliding_window=None), 4) == [None] * 4
    qwen = _config("qwen2", use_sliding_window=True, sliding_window=9, max_window_layers=2)
    assert layer_windows(qwen, 4) == [None, None, 9, 9]
    odd = _config("llama")
    odd.layer_types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        layer_windows(odd, 4)
    windowless = _config("llama")  # sliding layers with no window: refused by name, not a TypeError
    windowless.layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="no sliding_window"):
        layer_windows(windowless, 4)
