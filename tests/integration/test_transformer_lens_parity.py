"""raylens' named capture against TransformerLens' ``HookedTransformer``, an independent
implementation of the Llama math, on the embedded model's own converted weights.

TransformerLens builds its model from the converted directory (``get_pretrained_model_config``,
``get_pretrained_state_dict``, then ``load_and_process_state_dict`` with every processing step
off: no folded norms, no centring), so both sides compute with the same numbers and every name
both define must hold the same tensor. The vocabulary's documented differences are checked too:
the names only one side has, and the last layer's ``hook_resid_post``, which a generation step
reads after the final norm while named capture (like TransformerLens) reads it before.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.hook_names import parse_hook_name
from tests.helpers import forward_prompt

transformer_lens = pytest.importorskip("transformer_lens", reason="the parity test needs transformer-lens installed")

PROMPTS = {
    "chat": "Explain why the sky is blue in two sentences.",
    "raw": ("The river ran high that spring, and the mill by the bridge turned day and night while the "
            "town argued about whether to raise the weir before the autumn floods."),
}
# Worst |raylens - TransformerLens| over a tensor, relative to the tensor's largest magnitude.
# Both sides run float32 with differently grouped sums (einsum vs matmul, their softmax vs ours);
# measured at most 7e-6 over 30 layers, so 1e-4 leaves room without hiding a wrong tensor
# (a wrong tensor, e.g. the norm output with its weight, is off by order 1: see the control).
PARITY_RTOL = 1e-4
# The names only one side defines, as engine/model/hook_names.py documents them.
ONLY_TRANSFORMER_LENS = {"attn.hook_attn_scores", "unembed.hook_in", "unembed.hook_out"}
ONLY_RAYLENS = {"ln1.hook_weighted", "ln2.hook_weighted", "ln_final.hook_weighted", "attn.cache_k", "attn.cache_v"}


@pytest.fixture(scope="module")
def hooked(engine):
    """TransformerLens' model of the embedded weights, built from the converted local directory
    (no hub access) with no weight processing, so its tensors mean what its names say."""
    import warnings

    from transformer_lens import HookedTransformer
    from transformer_lens import loading_from_pretrained as tl_loading

    from engine.model.loading import resolve_model_path

    backend = engine.config.backend
    path = resolve_model_path(backend.model_id, backend.model_cache_dir)
    cfg = tl_loading.get_pretrained_model_config(path, fold_ln=False, device="cpu", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # HookedTransformer is TransformerLens 3's stable API
        model = HookedTransformer(cfg)
    model.load_and_process_state_dict(tl_loading.get_pretrained_state_dict(path, cfg), fold_ln=False,
                                      center_writing_weights=False, center_unembed=False, fold_value_biases=False,
                                      refactor_factored_attn_matrices=False)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(PROMPTS))
def both(request, engine, hooked):
    """``(ids, raylens capture, TransformerLens cache)`` of one prompt, batch dimension dropped."""
    text = PROMPTS[request.param]
    ids = engine.encode(text) if request.param == "chat" else list(engine.tokenizer.encode(text, add_special_tokens=False))
    ours = engine.capture(input_ids=ids, names=["*"])
    with torch.inference_mode():
        _, cache = hooked.run_with_cache(torch.tensor([ids]))
    theirs = {name: tensor[0] for name, tensor in cache.items()}
    return ids, ours, theirs


def _hook(name: str) -> str:
    """``blocks.3.attn.hook_q`` → ``attn.hook_q`` (model-wide names as they are)."""
    return name.split(".", 2)[2] if name.startswith("blocks.") else name


def _relative_worst(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64 (b is the reference)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_every_shared_name_holds_transformer_lens_tensor(both, engine):
    ids, ours, theirs = both
    shared = sorted(set(ours) & set(theirs), key=lambda n: list(ours).index(n))
    layers = engine.backend.info.num_layers
    per_block = {_hook(n) for n in shared if n.startswith("blocks.")}
    assert len(shared) == layers * len(per_block) + len({n for n in shared if not n.startswith("blocks.")})
    assert {"hook_resid_pre", "ln1.hook_normalized", "attn.hook_pattern", "attn.hook_z", "hook_resid_mid",
            "ln2.hook_normalized", "mlp.hook_post", "hook_resid_post"} <= per_block, "positive control: coverage"
    mismatched = {}
    for name in shared:
        a, b = ours[name], theirs[name]
        assert tuple(a.shape) == tuple(b.shape), f"{name}: raylens {tuple(a.shape)} vs TransformerLens {tuple(b.shape)}"
        worst = _relative_worst(a, b)
        if not worst <= PARITY_RTOL:
            mismatched[name] = worst
    assert not mismatched, (f"{len(mismatched)} names differ from TransformerLens beyond {PARITY_RTOL} of their scale, "
                            f"e.g. {dict(list(mismatched.items())[:5])}")
    assert ours["hook_embed"].shape == (len(ids), engine.backend.info.hidden_size)


def test_the_names_only_one_side_defines_are_the_documented_ones(both):
    _, ours, theirs = both
    assert {_hook(n) for n in set(theirs) - set(ours)} == ONLY_TRANSFORMER_LENS
    assert {_hook(n) for n in set(ours) - set(theirs)} == ONLY_RAYLENS
    for name in ONLY_RAYLENS:  # each is a spelled-out internal of the vocabulary, not an accident of the table
        assert parse_hook_name(name if name.startswith("ln_final") else f"blocks.0.{name}").spec.description


def test_normalized_is_before_the_norm_weight_and_weighted_after(both, engine):
    """TransformerLens' ``ln*.hook_normalized`` is the norm output before its weight; raylens'
    weighted output (what the projections read) is ``ln*.hook_weighted``. The control shows the
    comparison above would catch the weighted tensor under TransformerLens' name."""
    _, ours, theirs = both
    model = engine.backend.reference_model
    block = model.base_model.layers[3]
    pairs = {"blocks.3.ln1": block.input_layernorm.weight, "blocks.3.ln2": block.post_attention_layernorm.weight,
             "ln_final": model.base_model.norm.weight}
    for prefix, weight in pairs.items():
        expected = theirs[f"{prefix}.hook_normalized"] * weight.detach()
        assert _relative_worst(ours[f"{prefix}.hook_weighted"], expected) <= PARITY_RTOL, prefix
        assert _relative_worst(ours[f"{prefix}.hook_weighted"], theirs[f"{prefix}.hook_normalized"]) > 0.1, (
            f"positive control: {prefix}'s norm weight must change the tensor")


def test_last_layer_resid_post_has_two_meanings_step_after_the_final_norm(both, engine):
    """Named capture's last ``hook_resid_post`` is TransformerLens' (before the final norm); a
    generation step's capture of the last layer is transformers' last hidden state, after the final
    norm with its weight: named capture's ``ln_final.hook_weighted``."""
    ids, ours, theirs = both
    last = engine.backend.info.num_layers - 1
    name = f"blocks.{last}.hook_resid_post"
    step = forward_prompt(engine, ids, [name]).captured.hidden[last]  # (T, d), every position
    assert _relative_worst(ours[name], theirs[name]) <= PARITY_RTOL
    assert _relative_worst(step, ours["ln_final.hook_weighted"]) <= PARITY_RTOL
    assert _relative_worst(step, ours[name]) > 0.1, "the two meanings must differ for this test to mean anything"
    middle = f"blocks.{last // 2}.hook_resid_post"  # below the top, both paths read the same tensor
    step_middle = forward_prompt(engine, ids, [middle]).captured.hidden[last // 2]
    assert _relative_worst(step_middle, theirs[middle]) <= PARITY_RTOL
