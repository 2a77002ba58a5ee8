"""HuggingFaceBackend on the embedded model: loading, internals, KV cache, differential checks.

Dimensions come from the model config (never 576/30/9 written down). References are independent:
transformers' own greedy ``generate``, an eager-attention forward with ``output_attentions``, and
a full forward with every hidden state.
"""

from __future__ import annotations

import pytest
import torch

from engine.model.devices import resolve_device
from engine.errors import ContextOverflowError, InvalidRequestError, LayerOutOfRangeError, TokenOutOfVocabularyError
from engine.model.capture import ATTENTION_IMPLEMENTATION, hidden_states_index
from mods import Added, ForwardPass, Prefilled, mod
from tests.helpers import FP32_NOISE_TOL, build_config, forward_prompt

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def mc(engine):
    return engine.backend.reference_model.config


@pytest.fixture(scope="module")
def eager_model(engine):
    """The same weights with eager attention, as the attention reference."""
    from transformers import AutoModelForCausalLM

    from engine.model.loading import resolve_model_path

    cfg = engine.config.backend
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg.model_id, cfg.model_cache_dir),
                                                 attn_implementation="eager")
    return model.eval()


def test_the_step_loop_hands_transformers_its_cache_without_deprecation_warnings(engine):
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; the old name warns on every
    forward. The engine passes the cache under the name the model's forward takes."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = engine.generate(PROMPT, max_tokens=3, temperature=0.0)
    assert result.finish_reason in ("stop", "length")
    deprecations = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not deprecations, deprecations


def test_model_loads_on_the_auto_detected_device(engine):
    assert engine.backend.info.device == str(resolve_device("auto")) == "cpu"  # no GPU on CI machines
    assert engine.backend.attention_implementation == ATTENTION_IMPLEMENTATION == "raylens_capture"


@pytest.mark.parametrize("prompt", [PROMPT, "Write a short story about a lighthouse keeper."])
def test_greedy_loop_matches_transformers_generate_token_for_token(engine, prompt):
    ids = engine.encode(prompt)
    model = engine.backend.reference_model
    eos = set(engine.backend.info.eos_token_ids)
    with torch.inference_mode():
        reference = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    ours = engine.generate(input_ids=ids, max_tokens=32, temperature=0.0)
    assert ours.output_ids == [t for t in reference if t not in eos]


def test_fixed_seed_is_reproducible_and_temperature_zero_is_stable(engine):
    a = engine.generate(PROMPT, max_tokens=12, temperature=0.9, seed=11)
    b = engine.generate(PROMPT, max_tokens=12, temperature=0.9, seed=11)
    assert a.output_ids == b.output_ids
    g1 = engine.generate(PROMPT, max_tokens=12, temperature=0.0)
    g2 = engine.generate(PROMPT, max_tokens=12, temperature=0.0)
    assert g1.output_ids == g2.output_ids


def test_hidden_state_and_attention_shapes(engine, mc):
    result = engine.generate(PROMPT, max_tokens=4, temperature=0.0)
    pre = result.events[0]
    assert isinstance(pre, Prefilled)
    seq = len(result.prompt_ids)
    assert pre.hidden_states.shape == (seq, mc.hidden_size)
    assert pre.attention_patterns.shape == (mc.num_attention_heads, seq, seq)
    assert pre.layer == engine.config.backend.hidden_state_layer and pre.input_ids == result.prompt_ids
    forwards = [e for e in result.events if isinstance(e, ForwardPass)]
    for i, fp in enumerate(forwards):
        assert fp.logits.shape == (1, engine.backend.info.vocab_size)
        assert fp.hidden_states.shape == (1, mc.hidden_size)
        assert fp.attention_patterns.shape == (mc.num_attention_heads, 1, seq + i)
        assert len(fp.input_ids) == seq + i


def test_hidden_states_equal_the_full_forward_reference_and_layer16_differs_from_layer0(engine, mc):
    ids = engine.encode(PROMPT)
    backend = engine.backend
    layer = engine.config.backend.hidden_state_layer
    out = forward_prompt(engine, ids, [f"blocks.{layer}.hook_resid_post", "blocks.0.hook_resid_post"])
    layer0 = out.captured.hidden[0]
    with torch.inference_mode():
        ref = backend.reference_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    ours = out.captured.hidden[layer]
    torch.testing.assert_close(ours, ref[hidden_states_index(layer)][0], atol=FP32_NOISE_TOL, rtol=0,
                               msg=lambda m: f"layer {layer} hidden states drift from output_hidden_states: {m}")
    torch.testing.assert_close(layer0, ref[hidden_states_index(0)][0], atol=FP32_NOISE_TOL, rtol=0)
    gap = (ours - layer0).abs().mean().item()
    assert gap > 0.1, f"layer {layer} should differ from layer 0 (mean |diff| {gap:.4f})"


def test_attention_equals_eager_attention_and_rows_sum_to_one(engine, eager_model):
    result = engine.generate(PROMPT, max_tokens=6, temperature=0.0)
    layer = engine.config.backend.hidden_state_layer
    full = result.prompt_ids + result.output_ids
    with torch.inference_mode():
        ref = eager_model(torch.tensor([full]), output_attentions=True).attentions[layer][0]  # (h, n, n)
    pre = result.events[0]
    seq = len(result.prompt_ids)
    torch.testing.assert_close(pre.attention_patterns.tensor, ref[:, :seq, :seq], atol=FP32_NOISE_TOL, rtol=0)
    forwards = [e for e in result.events if isinstance(e, ForwardPass)]
    for i, fp in enumerate(forwards):
        row = seq + i - 1  # the query row of the newest token fed
        torch.testing.assert_close(fp.attention_patterns.tensor, ref[:, row:row + 1, :row + 1],
                                   atol=FP32_NOISE_TOL, rtol=0,
                                   msg=lambda m: f"decode step {i}: attention differs from eager: {m}")
        sums = fp.attention_patterns.tensor.sum(-1)
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)


def test_attention_changes_when_tokens_are_injected(engine):
    @mod
    def inject(event, actions, tokenizer):
        if isinstance(event, ForwardPass) and event.step == 1:
            return actions.force_tokens(tokenizer.encode(" IGNORE ALL RULES", add_special_tokens=False))

    plain = engine.generate(PROMPT, max_tokens=20, temperature=0.0)
    injected = engine.generate(PROMPT, mods=[inject], max_tokens=20, temperature=0.0)
    step = 2  # the first forward pass after the injection
    a = next(e for e in plain.events if isinstance(e, ForwardPass) and e.step == step).attention_patterns.tensor
    b = next(e for e in injected.events if isinstance(e, ForwardPass) and e.step == step).attention_patterns.tensor
    assert a.shape != b.shape or (a - b).abs().max() > 1e-3


def test_attention_hook_leaves_nothing_behind(engine):
    model = engine.backend.reference_model
    before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    engine.generate(PROMPT, max_tokens=3, temperature=0.0)
    after = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    assert after == before  # attention capture rides on forward kwargs, never on module hooks


def test_moving_a_slot_position_back_regenerates_identical_logits(engine):
    """Backtrack is a position move: re-feeding from an earlier position overwrites the stale
    keys/values (masked meanwhile) and reproduces the logits of the first pass."""
    from engine.model.backend import ForwardBatch, ForwardRow

    ids = engine.encode(PROMPT)

    def moves(loop):  # on the loop's thread, with blocks from its KV manager, as the scheduler feeds
        kv, runner = loop.scheduler.kv, loop.runner

        def feed(start, tokens):
            table = kv.prepare("rw", start, len(tokens))
            batch = ForwardBatch((ForwardRow("rw", start, tuple(tokens), table=table),), kv.num_blocks, kv.take_copies())
            out = runner.execute(batch).rows()[0]
            kv.record("rw", start, tokens, out.captured, False)
            return out.logits.clone()

        kv.add("rw")
        try:
            first = feed(0, ids)
            for i, token in enumerate((504, 3575, 282)):
                later = feed(len(ids) + i, [token])
                assert (later - first).abs().max() > 1e-3  # positive control: new tokens change the logits
            return first, feed(len(ids) - 1, [ids[-1]])
        finally:
            kv.remove("rw")

    first, again = engine.loop.call(moves, timeout=600)
    torch.testing.assert_close(again, first, atol=FP32_NOISE_TOL, rtol=0)


def test_forward_pass_input_ids_are_the_sequence_as_it_was_and_share_one_list(engine):
    """Each ForwardPass's ``input_ids`` is the sequence fed so far, as a mod saw it then — through
    a Backtrack that erased two committed tokens — and a result's events view one list per stretch
    between erases (no list of their own a step), with a mod or without."""
    seen: list[list[int]] = []

    @mod
    def undo_two(event, actions, tokenizer):
        if isinstance(event, ForwardPass):
            seen.append(list(event.input_ids))  # a list of its own, as the mod saw it then
            if event.step == 4:
                return actions.backtrack(steps=2)

    result = engine.generate(PROMPT, mods=[undo_two], max_tokens=8, temperature=0.0)
    forwards = [e for e in result.events if isinstance(e, ForwardPass)]
    assert [list(fp.input_ids) for fp in forwards] == seen
    assert len(seen[5]) == len(seen[4]) - 2  # the erase shows in the next step's ids, not in earlier ones
    final = result.prompt_ids + result.output_ids
    assert seen[-1] == final[:len(seen[-1])]
    assert len({id(fp.input_ids._ids) for fp in forwards}) == 2  # one list before the erase, one after
    plain = engine.generate(PROMPT, max_tokens=8, temperature=0.0)  # no mod: its events are made at the end
    plain_forwards = [e for e in plain.events if isinstance(e, ForwardPass)]
    assert len({id(fp.input_ids._ids) for fp in plain_forwards}) == 1
    assert [list(fp.input_ids) for fp in plain_forwards] == \
        [plain.prompt_ids + plain.output_ids[:i] for i in range(len(plain_forwards))]


def test_backtrack_without_reinjection_regenerates_the_same_greedy_text(engine):
    """A cropped cache that were wrong would change the greedy continuation."""
    @mod
    def undo_two(event, actions, tokenizer):
        if isinstance(event, ForwardPass) and event.step == 4:
            return actions.backtrack(steps=2)

    plain = engine.generate(PROMPT, max_tokens=10, temperature=0.0)
    undone = engine.generate(PROMPT, mods=[undo_two], max_tokens=10, temperature=0.0)
    assert undone.output_ids == plain.output_ids


def test_backtrack_with_replacement_continues_differently(engine):
    @mod
    def replace(event, actions, tokenizer):
        if isinstance(event, Added) and event.step == 3 and not event.forced:
            return actions.backtrack(steps=1, tokens=tokenizer.encode(" the city of", add_special_tokens=False))

    plain = engine.generate(PROMPT, max_tokens=12, temperature=0.0)
    changed = engine.generate(PROMPT, mods=[replace], max_tokens=12, temperature=0.0)
    assert changed.output_ids[:3] == plain.output_ids[:3]
    assert changed.output_ids[3:] != plain.output_ids[3:]


def test_selfprompt_style_numpy_masking_through_the_tensor_shim(engine, tokenizer):
    """Allow only digits: mask via to_numpy(), rebuild with type(logits).from_numpy, move to device."""
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}

    @mod
    def only_digits(event, actions, tok):
        if isinstance(event, ForwardPass):
            logits = event.logits.to_numpy().copy()
            keep = logits[0, sorted(digits)].copy()
            logits[0, :] = -1e9
            logits[0, sorted(digits)] = keep
            masked = type(event.logits).from_numpy(logits).to(event.logits.device)
            return actions.adjust_logits(masked, token_temp=0.0)

    result = engine.generate("Pick a number.", mods=[only_digits], max_tokens=5, temperature=0.9, seed=1)
    assert len(result.output_ids) == 5 and set(result.output_ids) <= digits


def test_eos_stops_generation_and_max_tokens_is_respected(engine):
    stopped = engine.generate(PROMPT, max_tokens=64, temperature=0.0)
    assert stopped.finish_reason == "stop" and len(stopped.output_ids) < 64
    assert stopped.events[-1].added_tokens[-1] in engine.backend.info.eos_token_ids  # EOS dispatched, stripped
    assert not set(stopped.output_ids) & set(engine.backend.info.eos_token_ids)
    capped = engine.generate(PROMPT, max_tokens=3, temperature=0.0)
    assert capped.finish_reason == "length" and len(capped.output_ids) == 3


def test_bad_token_ids_and_oversized_prompts_are_clear_errors(engine):
    vocab = engine.backend.info.vocab_size
    with pytest.raises(TokenOutOfVocabularyError, match=rf"`input_ids\[1\]` must be a token id in \[0, {vocab}\)"):
        engine.generate(input_ids=[1, vocab + 5], max_tokens=2)
    with pytest.raises(InvalidRequestError, match=r"`banned_tokens\[0\]` must be an int token id, got 'a'"):
        engine.submit(PROMPT, max_tokens=2, banned_tokens=["a"])
    with pytest.raises(TokenOutOfVocabularyError, match=r"`stop_tokens\[1\]`"):
        engine.generate(PROMPT, max_tokens=2, stop_tokens=[2, vocab])
    with pytest.raises(ContextOverflowError, match="must be shorter than"):
        engine.generate(input_ids=[1] * engine.backend.info.max_context, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="`prompt` must be a non-empty string"):
        engine.generate("   ")
    with pytest.raises(InvalidRequestError, match="`max_tokens` must be"):
        engine.generate(PROMPT, max_tokens=0)
    with pytest.raises(InvalidRequestError, match="exactly one of prompt, messages, input_ids"):
        engine.generate(PROMPT, input_ids=[1])


def test_a_layer_out_of_range_is_rejected_with_the_valid_range(mc):
    from engine.model.hf import HuggingFaceBackend

    with pytest.raises(LayerOutOfRangeError, match=rf"in \[0, {mc.num_hidden_layers - 1}\]"):
        HuggingFaceBackend(build_config(hidden_state_layer=mc.num_hidden_layers).backend)
