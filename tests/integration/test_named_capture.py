"""Named-tensor capture on the embedded model, checked against independent computations:
transformers' own ``output_hidden_states`` and eager ``output_attentions``, and every step of one
block recomputed by hand from the model's weights (RMSNorm, projections, RoPE from the config's
theta, softmax, SwiGLU). Also: capture never changes outputs, its hooks never outlive it, and it
never records another thread's forward."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from engine.errors import InvalidRequestError, LayerOutOfRangeError, TokenOutOfVocabularyError
from engine.model.capture import hidden_states_index
from engine.model.hook_names import expand_hook_names
from engine.model.named_capture import MANIFEST_FILE, TENSORS_FILE, capture
from engine.model.taps import taps_of
from tests.helpers import FP32_NOISE_TOL

PROMPT = "Explain why the sky is blue in two sentences."
SAME_OPS_TOL = 1e-5  # the same float32 ops in another grouping (by hand vs in the model): rounding only


@pytest.fixture(scope="module")
def model(engine):
    return engine.backend.reference_model


@pytest.fixture(scope="module")
def ids(engine):
    return engine.encode(PROMPT)


@pytest.fixture(scope="module")
def full(model, ids):
    """Every internal of one forward over the prompt."""
    return capture(model, ids, ["*"])


@pytest.fixture(scope="module")
def eager_model(engine):
    """A second copy of the same weights with eager attention, loaded through transformers' own
    API: the independent reference for attention patterns (the session model stays untouched)."""
    from transformers import AutoModelForCausalLM

    from engine.model.loading import resolve_model_path

    backend = engine.config.backend
    path = resolve_model_path(backend.model_id, backend.model_cache_dir)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _hf(model, ids, **kwargs):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), **kwargs)


def _worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _all_hooks(model) -> dict[str, tuple]:
    """Every hook registered on every module, by module name (transformers may keep its own)."""
    return {name: tuple(list(getattr(m, attr)) for attr in ("_forward_hooks", "_forward_pre_hooks",
                                                            "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs"))
            for name, m in model.named_modules()}


def test_capture_covers_every_internal_in_forward_order(full, model, ids):
    cfg = model.config
    hooks = taps_of(model).hooks
    assert len(full) == cfg.num_hidden_layers * len(hooks.block) + len(hooks.model)
    assert next(iter(full)) == "hook_embed" and list(full)[-1] == "ln_final.hook_weighted"
    T, h, g = len(ids), cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // h
    assert full["blocks.2.attn.hook_q"].shape == (T, h, hd)
    assert full["blocks.2.attn.hook_k"].shape == full["blocks.2.attn.cache_k"].shape == (T, g, hd)
    assert full["blocks.2.attn.hook_pattern"].shape == (h, T, T)
    assert full["blocks.2.mlp.hook_post"].shape == (T, cfg.intermediate_size)
    assert full["blocks.2.hook_resid_post"].shape == (T, cfg.hidden_size)


def test_capture_resid_post_matches_output_hidden_states(full, model, ids):
    hidden = _hf(model, ids, output_hidden_states=True).hidden_states
    last = model.config.num_hidden_layers - 1
    drift = {"hook_embed": _worst(full["hook_embed"], hidden[0][0])}
    for layer in range(last):  # transformers' entry for the last layer is after the final norm
        drift[f"blocks.{layer}.hook_resid_post"] = _worst(full[f"blocks.{layer}.hook_resid_post"],
                                                          hidden[hidden_states_index(layer)][0])
    drift["ln_final.hook_weighted"] = _worst(full["ln_final.hook_weighted"], hidden[hidden_states_index(last)][0])
    name, worst = max(drift.items(), key=lambda kv: kv[1])
    assert worst <= FP32_NOISE_TOL, f"{name} differs from output_hidden_states by {worst:.3g} > {FP32_NOISE_TOL}"
    # the residual stream is continuous: one block's output is the next block's input
    assert torch.equal(full["blocks.4.hook_resid_pre"], full["blocks.3.hook_resid_post"])


def test_capture_attention_pattern_matches_hf_eager(full, eager_model, ids):
    attentions = _hf(eager_model, ids, output_attentions=True).attentions
    drift = {layer: _worst(full[f"blocks.{layer}.attn.hook_pattern"], attentions[layer][0])
             for layer in range(eager_model.config.num_hidden_layers)}
    layer, worst = max(drift.items(), key=lambda kv: kv[1])
    assert worst <= FP32_NOISE_TOL, (f"layer {layer}'s captured softmax differs from eager output_attentions by "
                                     f"{worst:.3g} > {FP32_NOISE_TOL}")
    rows = full["blocks.0.attn.hook_pattern"].sum(-1)
    assert _worst(rows, torch.ones_like(rows)) <= SAME_OPS_TOL, "every attention row must sum to 1"
    assert float(full["blocks.0.attn.hook_pattern"].triu(1).abs().max()) == 0.0, "the pattern must be causal"


def _rope_by_hand(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x (T, heads, hd)`` at positions 0..T-1, computed from theta alone."""
    T, _, hd = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)  # (hd/2,)
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (T, hd/2)
    cos = torch.cat([angles, angles], -1).cos()[:, None, :]
    sin = torch.cat([angles, angles], -1).sin()[:, None, :]
    rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("layer", [0, 7])
def test_capture_block_matches_its_computation_by_hand(full, model, layer):
    """Each captured tensor of one block equals the block's arithmetic applied by hand to the
    captured tensor before it; checking every step catches errors that would cancel out."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": cfg.rope_theta}
    assert rope["rope_type"] == "default", "the RoPE-by-hand reference covers plain RoPE only"
    block = model.base_model.layers[layer]
    attn, mlp = block.self_attn, block.mlp
    h, g = cfg.num_attention_heads, cfg.num_key_value_heads
    hd, T = cfg.hidden_size // h, full["hook_embed"].shape[0]
    c = lambda hook: full[f"blocks.{layer}.{hook}"]  # noqa: E731

    def scale(x):
        return (x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps).sqrt()

    with torch.inference_mode():
        ln1_scale = scale(c("hook_resid_pre"))
        ln1_normalized = c("hook_resid_pre") / c("ln1.hook_scale")
        ln1 = c("ln1.hook_normalized") * block.input_layernorm.weight
        q = (c("ln1.hook_weighted") @ attn.q_proj.weight.T).view(T, h, hd)
        k = (c("ln1.hook_weighted") @ attn.k_proj.weight.T).view(T, g, hd)
        v = (c("ln1.hook_weighted") @ attn.v_proj.weight.T).view(T, g, hd)
        rot_q, rot_k = _rope_by_hand(c("attn.hook_q"), rope["rope_theta"]), _rope_by_hand(c("attn.hook_k"),
                                                                                            rope["rope_theta"])
        keys = c("attn.hook_rot_k").repeat_interleave(h // g, dim=1)  # (T, h, hd)
        scores = torch.einsum("qhd,khd->hqk", c("attn.hook_rot_q"), keys) / hd ** 0.5
        pattern = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        z = torch.einsum("hqk,khd->qhd", c("attn.hook_pattern"), c("attn.hook_v").repeat_interleave(h // g, dim=1))
        attn_out = c("attn.hook_z").reshape(T, h * hd) @ attn.o_proj.weight.T
        resid_mid = c("hook_resid_pre") + c("hook_attn_out")
        ln2_scale = scale(c("hook_resid_mid"))
        ln2_normalized = c("hook_resid_mid") / c("ln2.hook_scale")
        ln2 = c("ln2.hook_normalized") * block.post_attention_layernorm.weight
        ln2_in = c("ln2.hook_weighted")
        gate, up = ln2_in @ mlp.gate_proj.weight.T, ln2_in @ mlp.up_proj.weight.T
        mlp_post = torch.nn.functional.silu(c("mlp.hook_pre")) * c("mlp.hook_pre_linear")
        mlp_out = c("mlp.hook_post") @ mlp.down_proj.weight.T
        resid_post = c("hook_resid_mid") + c("hook_mlp_out")
    by_hand = {"ln1.hook_scale": ln1_scale, "ln1.hook_normalized": ln1_normalized, "ln1.hook_weighted": ln1,
               "attn.hook_q": q, "attn.hook_k": k, "attn.hook_v": v,
               "attn.hook_rot_q": rot_q, "attn.hook_rot_k": rot_k, "attn.cache_k": c("attn.hook_rot_k"),
               "attn.cache_v": c("attn.hook_v"), "attn.hook_pattern": pattern, "attn.hook_z": z,
               "hook_attn_out": attn_out, "hook_resid_mid": resid_mid, "ln2.hook_scale": ln2_scale,
               "ln2.hook_normalized": ln2_normalized, "ln2.hook_weighted": ln2, "mlp.hook_pre": gate,
               "mlp.hook_pre_linear": up, "mlp.hook_post": mlp_post, "hook_mlp_out": mlp_out, "hook_resid_post": resid_post}
    for hook, expected in by_hand.items():
        captured = c(hook)
        scale = max(1.0, float(expected.abs().max()))  # tolerance relative to the tensor's magnitude
        worst = _worst(captured, expected)
        assert worst <= SAME_OPS_TOL * scale, (f"blocks.{layer}.{hook} differs from its computation by hand by "
                                               f"{worst:.3g} > {SAME_OPS_TOL} x {scale:.3g}")
    assert _worst(rot_q, c("attn.hook_q")) > SAME_OPS_TOL, "positive control: RoPE must change the queries"


def test_capture_never_changes_logits(model, ids):
    from transformers import DynamicCache

    from engine.model.kv_cache import cache_argument

    before = _hf(model, ids).logits
    with taps_of(model).record(expand_hook_names(["*"], model.config.num_hidden_layers, taps_of(model).hooks)) as rec:
        during = _hf(model, ids, use_cache=True, **cache_argument(model, DynamicCache(config=model.config))).logits
    after = _hf(model, ids).logits
    assert rec.raw, "positive control: the hooks recorded the forward"
    assert torch.equal(before, during), f"capture changed the logits by up to {_worst(before, during):.3g}"
    assert torch.equal(before, after), "a capture left state behind that changed a later forward"


def test_capture_releases_hooks_when_the_forward_raises(model, ids):
    before = _all_hooks(model)
    with taps_of(model).record(expand_hook_names(["*"], model.config.num_hidden_layers, taps_of(model).hooks)):
        inside = _all_hooks(model)
    assert inside != before, "positive control: hooks were registered inside the context"

    def explode(*_):
        raise RuntimeError("a layer failed")

    failing = model.base_model.layers[3].mlp.register_forward_hook(explode)
    try:
        with pytest.raises(RuntimeError, match="a layer failed"):
            capture(model, ids, ["*"])
    finally:
        failing.remove()
    leaked = {name for name, hooks_now in _all_hooks(model).items() if hooks_now != before[name]}
    assert not leaked, f"hooks left behind on {sorted(leaked)[:5]} after a failed forward"
    with pytest.raises(TokenOutOfVocabularyError):  # refused before any hook is registered
        capture(model, [model.config.vocab_size], ["*"])
    assert _all_hooks(model) == before


def test_capture_ignores_forwards_of_other_threads(model, ids):
    names = expand_hook_names(["blocks.0.hook_resid_post"], model.config.num_hidden_layers, taps_of(model).hooks)
    with taps_of(model).record(names) as rec:
        other = threading.Thread(target=_hf, args=(model, ids))
        other.start()
        other.join(timeout=120)
        assert not rec.raw, "a forward in another thread was recorded into this capture"
        _hf(model, ids)
    assert rec.raw, "positive control: the capturing thread's forward is recorded"


def test_engine_capture_writes_safetensors_and_manifest(engine, tmp_path):
    from safetensors.torch import load_file

    names = ["blocks.3.attn.hook_q", "blocks.*.hook_resid_post"]
    out = tmp_path / "capture"
    tensors = engine.capture(prompt=PROMPT, names=names, out=out)
    layers = engine.backend.info.num_layers
    expected = []  # forward order: within block 3, the query comes before the block's output
    for layer in range(layers):
        expected += (["blocks.3.attn.hook_q"] if layer == 3 else []) + [f"blocks.{layer}.hook_resid_post"]
    assert list(tensors) == expected
    stored = load_file(str(out / TENSORS_FILE))
    assert set(stored) == set(tensors)
    assert all(torch.equal(stored[n], tensors[n].cpu()) for n in tensors)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["input_ids"] == engine.encode(PROMPT) and manifest["model_id"] == engine.backend.info.model_id
    entries = {e["name"]: e for e in manifest["tensors"]}
    q = entries["blocks.3.attn.hook_q"]
    assert q["shape"] == list(tensors["blocks.3.attn.hook_q"].shape) and q["dtype"] == "float32"
    assert q["layer"] == 3 and q["llama_cpp"] == "Qcur" and "before RoPE" in q["description"]
    assert entries["blocks.0.hook_resid_post"]["llama_cpp"] == "l_out"


def test_engine_capture_refuses_bad_names_before_running(engine):
    with pytest.raises(InvalidRequestError, match="must match at least one internal"):
        engine.capture(prompt=PROMPT, names=["blocks.*.attn.hook_nope"])
    with pytest.raises(LayerOutOfRangeError):
        engine.capture(prompt=PROMPT, names=[f"blocks.{engine.backend.info.num_layers}.hook_resid_post"])
    with pytest.raises(InvalidRequestError, match="exactly one of prompt"):
        engine.capture(names=["hook_embed"])


@pytest.mark.parametrize("bad, kind, where", [
    ([1, 2.0], InvalidRequestError, r"`input_ids\[1\]` must be an int token id"),
    ([1, "2"], InvalidRequestError, r"`input_ids\[1\]` must be an int token id"),
    ([True], InvalidRequestError, r"`input_ids\[0\]` must be an int token id"),
    ([0, 10**9], TokenOutOfVocabularyError, r"`input_ids\[1\]` must be a token id in \[0, "),
])
def test_every_entry_point_checks_token_ids_by_one_rule(engine, model, bad, kind, where):
    """Generation, the engine's and the model-level named capture refuse a bad id alike: the same
    typed error naming the same position (a float is never truncated into an id)."""
    with pytest.raises(kind, match=where):
        engine.submit(input_ids=bad, max_tokens=2)
    with pytest.raises(kind, match=where):
        engine.capture(input_ids=bad, names=["hook_embed"])
    with pytest.raises(kind, match=where):
        capture(model, bad, ["hook_embed"])
