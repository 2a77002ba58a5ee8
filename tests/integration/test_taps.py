"""The taps table of the embedded model: every name resolves to its module once, reads and writes
are scoped (no hook outlives its block, even when the forward raises), SAE-training collection
equals transformers' own hidden states while running only the layers it needs, and the steering
write tap has exactly the effect of a plain forward hook adding the delta to the block's output.
Value correctness of every read (pre/post hooks) is checked against independent computations in
test_named_capture.py, which reads through this table."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.model.capture import hidden_states_index, residual_stream
from engine.model.hook_names import BLOCK_HOOKS, GLOBAL_HOOKS, HOOK_SPECS, HookName, expand_hook_names, resid_post
from engine.model.taps import Taps, taps_of

PROMPT = "Explain why the sky is blue in two sentences."


@pytest.fixture(scope="module")
def model(engine):
    return engine.backend.reference_model


@pytest.fixture(scope="module")
def taps(model) -> Taps:
    return taps_of(model)


@pytest.fixture(scope="module")
def ids(engine):
    return engine.encode(PROMPT)


def _all_hooks(model) -> dict[str, tuple]:
    """Every hook registered on every module, by module name (transformers keeps its own)."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")
    return {name: tuple(list(getattr(m, attr)) for attr in kinds) for name, m in model.named_modules()}


def _leaked(model, before: dict[str, tuple]) -> list[str]:
    return sorted(name for name, now in _all_hooks(model).items() if now != before[name])


def test_every_name_of_the_vocabulary_has_one_tap_in_forward_order(taps, model):
    layers = model.config.num_hidden_layers
    universe = expand_hook_names(["*"], layers, taps.hooks)
    assert list(taps.taps) == universe
    assert len(universe) == layers * len(taps.hooks.block) + len(taps.hooks.model)
    # Llama computes every name of the vocabulary but those other families add
    others = {"attn.q_norm.hook_scale", "attn.q_norm.hook_normalized", "attn.k_norm.hook_scale",
              "attn.k_norm.hook_normalized", "ln1_post.hook_scale", "ln1_post.hook_normalized", "ln2_post.hook_scale",
              "ln2_post.hook_normalized"}
    assert set(taps.hooks.block) == set(BLOCK_HOOKS) - others
    assert set(taps.hooks.model) == set(GLOBAL_HOOKS) - {"hook_pos_embed"}
    assert taps_of(model) is taps, "the table is built once per model"
    modules = dict(model.named_modules())
    owner = {id(m): name for name, m in modules.items()}
    for name, tap in taps.taps.items():
        assert tap.spec == HOOK_SPECS[name.hook]  # llama.cpp alias and description, as the vocabulary says
        for key in tap.reads:
            read = taps.reads[key]
            assert key.layer == name.layer and read.when in ("pre", "post")
            path = owner[id(read.module)]  # one module of this model, inside its own block
            if name.layer is not None:
                assert path == f"model.layers.{name.layer}" or path.startswith(f"model.layers.{name.layer}."), path
    assert owner[id(taps.module("blocks.3.attn.hook_q"))] == "model.layers.3.self_attn.q_proj"
    assert owner[id(taps.module("blocks.3.hook_resid_post"))] == "model.layers.3"
    assert owner[id(taps.module("ln_final.hook_normalized"))] == "model.norm"
    assert taps.module("blocks.3.attn.hook_pattern") is None  # derived from q, k and the attention inputs


def test_a_name_is_parsed_once_and_unknown_names_are_refused(taps, model):
    assert taps.tap("blocks.2.hook_resid_post") is taps.tap(HookName(2, "hook_resid_post"))
    with pytest.raises(InvalidRequestError, match="must name an internal of this"):
        taps.tap(f"blocks.{model.config.num_hidden_layers}.hook_resid_post")
    with pytest.raises(InvalidRequestError, match="is not a known internal"):
        taps.tap("blocks.1.hook_nope")


def test_collect_equals_output_hidden_states_and_runs_only_the_layers_it_needs(taps, model, ids):
    layer = 5
    batch = torch.tensor([ids[:10], ids[2:12]])  # (2, 10)
    calls = []
    above = model.base_model.layers[layer + 1].register_forward_hook(lambda *_: calls.append(1))
    try:
        with torch.inference_mode():
            collected = residual_stream(model, batch, layer)
            assert not calls, "collection ran a layer above the one it reads"
            reference = model(input_ids=batch, output_hidden_states=True).hidden_states[hidden_states_index(layer)]
        assert calls, "positive control: a full forward runs the layer above"
    finally:
        above.remove()
    assert collected.shape == (2, 10, model.config.hidden_size)
    assert torch.equal(collected, reference), f"differs by {float((collected - reference).abs().max()):.3g}"


def test_collect_of_the_last_layer_is_the_residual_stream_before_the_final_norm(engine, taps, model, ids):
    last = model.config.num_hidden_layers - 1
    batch = torch.tensor([ids])
    got = residual_stream(model, batch, last)[0]
    captured = engine.capture(input_ids=ids, names=[str(resid_post(last)), "ln_final.hook_normalized"])
    scale = float(got.abs().max())
    assert float((got - captured[str(resid_post(last))]).abs().max()) <= 1e-5 * scale
    assert float((got - captured["ln_final.hook_normalized"]).abs().max()) > 1.0  # positive control: not normed


def test_reads_and_writes_leave_no_hook_behind_even_when_the_forward_raises(taps, model, ids):
    before = _all_hooks(model)
    names = expand_hook_names(["*"], model.config.num_hidden_layers, taps_of(model).hooks)
    with taps.record(names), taps.write(resid_post(3), lambda resid: resid):
        assert _leaked(model, before), "positive control: the hooks were registered inside the block"
    assert not _leaked(model, before)

    def explode(*_):
        raise RuntimeError("a layer failed")

    failing = model.base_model.layers[2].mlp.register_forward_hook(explode)
    try:
        with pytest.raises(RuntimeError, match="a layer failed"):
            with taps.record(names), taps.write(resid_post(1), lambda resid: resid + 1), torch.inference_mode():
                model(input_ids=torch.tensor([ids]))
        with pytest.raises(RuntimeError, match="a layer failed"):
            residual_stream(model, torch.tensor([ids]), 4)
    finally:
        failing.remove()
    leaked = _leaked(model, before)
    assert not leaked, f"hooks left behind on {leaked[:5]}"


def test_steering_write_tap_equals_a_forward_hook_adding_the_delta(engine, taps, model, ids):
    """The reference is the mechanism the tap replaces, written out here: a forward hook on the
    block that returns its output plus the delta."""
    layer = 10
    delta = torch.randn(1, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 4.0
    batch = torch.tensor([ids])
    with torch.inference_mode():
        plain = model(input_ids=batch).logits
        with taps.write(resid_post(layer), lambda resid: resid + delta):
            tapped = model(input_ids=batch).logits
        handle = model.base_model.layers[layer].register_forward_hook(lambda _m, _a, output: output + delta)
        try:
            hooked = model(input_ids=batch).logits
        finally:
            handle.remove()
    assert float((tapped - plain).abs().max()) > 1e-2, "positive control: the delta changes the logits"
    assert torch.equal(tapped, hooked)


def test_a_write_tap_changes_only_the_forwards_of_the_thread_that_opened_it(taps, model, ids):
    batch = torch.tensor([ids])
    with torch.inference_mode():
        plain = model(input_ids=batch).logits
    seen = {}

    def other_thread() -> None:
        with torch.inference_mode():
            seen["logits"] = model(input_ids=batch).logits

    with taps.write(resid_post(4), lambda resid: resid + 10.0):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join(timeout=120)
        with torch.inference_mode():
            mine = model(input_ids=batch).logits
    assert torch.equal(seen["logits"], plain), "another thread's forward was steered"
    assert float((mine - plain).abs().max()) > 1e-2, "positive control: the opening thread's forward is steered"


def test_only_whole_module_outputs_are_writable(taps):
    with pytest.raises(InvalidRequestError, match="must be a writable tap"):
        with taps.write("blocks.0.attn.hook_pattern", lambda t: t):
            pass
    with pytest.raises(InvalidRequestError, match="must be a writable tap"):
        with taps.write("blocks.0.hook_resid_pre", lambda t: t):  # a block's input: write the previous output
            pass
