"""The internals vocabulary: glob expansion, descriptions and llama.cpp names (no model)."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError, LayerOutOfRangeError
from engine.model.hook_names import (BLOCK_HOOKS, GLOBAL_HOOKS, HOOK_SPECS, HookName, expand_hook_names, hook_spec,
                                     parse_hook_name)

LAYERS = 4  # a small stand-in model: expansion depends on the layer count only


def test_every_hook_has_a_spec_with_shape_and_description():
    assert set(HOOK_SPECS) == set(BLOCK_HOOKS) | set(GLOBAL_HOOKS)
    for hook, spec in HOOK_SPECS.items():
        assert spec.shape.startswith("(") and spec.description, f"{hook} lacks its shape or description"


def test_llama_cpp_names_of_the_checkpoint_tensors():
    expected = {"ln1.hook_weighted": "attn_norm", "ln2.hook_weighted": "ffn_norm", "mlp.hook_pre": "ffn_gate",
                "mlp.hook_pre_linear": "ffn_up", "ln_final.hook_weighted": "result_norm", "attn.hook_q": "Qcur",
                "attn.hook_k": "Kcur", "attn.hook_v": "Vcur", "attn.hook_pattern": "kq_soft_max", "attn.hook_z": "kqv_out",
                "hook_mlp_out": "ffn_out", "hook_resid_post": "l_out", "attn.cache_k": "cache_k",
                "attn.cache_v": "cache_v"}
    assert {hook: HOOK_SPECS[hook].llama_cpp for hook in expected} == expected
    assert hook_spec("blocks.2.attn.hook_q").llama_cpp == "Qcur"


def test_globs_expand_in_forward_order():
    names = expand_hook_names(["blocks.*.hook_resid_post", "hook_embed"], LAYERS)
    assert [str(n) for n in names] == ["hook_embed"] + [f"blocks.{layer}.hook_resid_post" for layer in range(LAYERS)]
    attn = expand_hook_names(["blocks.*.attn.*"], LAYERS)
    per_layer = [h for h in BLOCK_HOOKS if h.startswith("attn.")]
    assert len(attn) == LAYERS * len(per_layer) and all(n.hook.startswith("attn.") for n in attn)
    everything = expand_hook_names(["*"], LAYERS)
    assert len(everything) == LAYERS * len(BLOCK_HOOKS) + len(GLOBAL_HOOKS)
    assert expand_hook_names(["blocks.1.attn.hook_q", "blocks.1.attn.hook_q"], LAYERS) == [HookName(1, "attn.hook_q")]


@pytest.mark.parametrize("names,error,message", [
    (["blocks.*.attn.hook_qq"], InvalidRequestError, "must match at least one internal"),
    (["blocks.3.attn.hook_qq"], InvalidRequestError, "is not a known internal"),
    ([f"blocks.{LAYERS}.hook_resid_post"], LayerOutOfRangeError, f"must use layers in [0, {LAYERS - 1}]"),
    ([], InvalidRequestError, "at least one name"),
    ("blocks.*.hook_resid_post", InvalidRequestError, "must be a list"),
])
def test_bad_names_are_refused_with_the_fix(names, error, message):
    with pytest.raises(error) as info:
        expand_hook_names(names, LAYERS)
    assert message in str(info.value)
    assert info.value.parameter == "names"


def test_parse_round_trips_every_name():
    for name in expand_hook_names(["*"], LAYERS):
        assert parse_hook_name(str(name)) == name
