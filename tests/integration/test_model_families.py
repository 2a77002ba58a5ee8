"""Every supported model family end to end, on a tiny random-weight model of each
(tests/model_families.py: 2 layers of width 64, the embedded tokenizer's vocabulary, nothing
downloaded): Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, GPT-2 and GPT-NeoX.

For each family, against independent references:

* greedy generation equals transformers' own ``generate`` on a freshly loaded copy (its default
  attention, its own cache and masks), with prompts longer than the sliding window and chunked
  prefill; for the sliding-window families (Mistral, Gemma 2/3) a positive control shows the
  window changes the output, so a sliding layer that saw the whole context would be caught;
* every name both raylens and TransformerLens' ``HookedTransformer`` define holds the same tensor
  (TransformerLens built offline from the same weights, no weight processing), and the names only
  one side has are the documented ones;
* a generation step's captured residual stream and attention pattern (the paged path: our KV
  view, our masks) equal named capture's (the hooked plain forward);
* a mixed-length batch with a logits mod, a Backtrack and a steer gives each request what it gets
  alone, and each mod changed its request (positive controls);
* prefix caching on and off give the same events, internals and SAE features, with a real hit;
* the static-buffer decode (what a CUDA graph replays) equals the eager one, and on a GPU the
  captured CUDA graphs generate what transformers does;
* embeddings are transformers' hidden states pooled, prompt scores its log-softmax, and
  candidates are seeded samples;
* an SAE with the cfg of that family's sae-lens release (random weights) loads, reads the right
  hook, and its stored features are its own encoding of the step's residual stream (centred for
  GPT-2 res-jb, as that release was trained).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.model.capture import residual_stream
from mods import Added, ForwardPass, Prefilled, mod
from mods.features import steer_toward
from tests.helpers import build_config
from tests.model_families import (FAMILY_NAMES, FAMILY_RELEASES, WINDOW, build_release_sae, build_tiny_model,
                                  transformer_lens_model)

SLIDING = ("mistral", "gemma2", "gemma3")
BLOCK = 4  # KV blocks of 4 positions: many block boundaries in short prompts
STEP_TOKENS = 8  # prompts longer than this are prefilled in chunks
NEW_TOKENS = 8
TEXTS = ["The river ran high that spring, and the mill by the bridge turned day and night.",
         "Hi there",
         "Tell me a story about a cat and a dog."]
# Worst |raylens - reference| over a tensor relative to its largest magnitude: float32 with sums
# grouped differently (SDPA vs matmul, einsum vs linear); measured below 2e-6 on these models, and
# a wrong tensor is off by order 1.
PARITY_RTOL = 1e-4
ONLY_TRANSFORMER_LENS = {"attn.hook_attn_scores", "unembed.hook_in", "unembed.hook_out"}
ONLY_RAYLENS = {"ln1.hook_weighted", "ln2.hook_weighted", "ln_final.hook_weighted", "attn.cache_k", "attn.cache_v"}
# TransformerLens runs its q/k norms on (batch · position · head, d_head): same values, one flat dimension
FLAT_IN_TRANSFORMER_LENS = {"attn.q_norm.hook_scale", "attn.q_norm.hook_normalized", "attn.k_norm.hook_scale",
                            "attn.k_norm.hook_normalized"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def path(family, root):
    return build_tiny_model(family, root)


@pytest.fixture(scope="module")
def reference(path):
    """The same weights loaded plainly by transformers (its default attention, no raylens code)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _config(family, path, root, **backend):
    cfg = build_config(model_id=str(path), hidden_state_layer=0, kv_block_size=BLOCK, max_step_tokens=STEP_TOKENS,
                       **backend)
    sae = build_release_sae(family, 0, root)
    return dataclasses.replace(
        cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(root / f"{family}.duckdb")),
        sae=dataclasses.replace(cfg.sae, enabled=True, mode="inline", sae_id=str(sae), layer=0, top_k=8))


@pytest.fixture(scope="module")
def eng(family, path, root):
    from engine import Engine

    with Engine(_config(family, path, root)) as e:
        yield e


@pytest.fixture(scope="module")
def prompts(eng):
    ids = [eng.tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert max(len(i) for i in ids) > max(WINDOW, STEP_TOKENS), "the long prompt must cross the window and a chunk"
    return ids


def _greedy(model, ids, n=NEW_TOKENS):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def _run(e, ids, **kw):  # the events' logits are compared after the run: kept
    return e.generate(input_ids=ids, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, keep_logits=True, **kw)


def _relative_worst(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------- generation


def test_greedy_generation_equals_transformers_generate(eng, path, reference, prompts, family):
    from transformers import AutoModelForCausalLM

    for ids in prompts:
        assert _run(eng, ids).sequence_ids == _greedy(reference, ids), f"{family}: {len(ids)}-token prompt"
    if family in SLIDING:
        # positive control: without the window the same weights generate something else, so a
        # sliding layer that saw the whole context would have failed the comparison above
        unwindowed = AutoModelForCausalLM.from_pretrained(path, sliding_window=4096).eval()
        long = max(prompts, key=len)
        assert _greedy(unwindowed, long) != _greedy(reference, long), f"{family}: the window never mattered"


def test_static_decode_equals_the_eager_decode(family, path, root, eng, prompts):
    """The static-buffer decode is the code a CUDA graph captures and replays (run eagerly here)."""
    from engine import Engine

    with Engine(_config(family, path, root, graph_decode="static")) as static:
        for ids in prompts:
            a, b = _run(static, ids), _run(eng, ids)
            assert a.sequence_ids == b.sequence_ids, f"{family}: static decode differs"
            steps = [(x, y) for x, y in zip(a.events, b.events) if isinstance(x, ForwardPass)]
            assert len(steps) == NEW_TOKENS
            for x, y in steps:  # every decode step's internals, sliding masks included
                for name in ("logits", "hidden_states", "attention_patterns"):
                    worst = _relative_worst(getattr(x, name).to_numpy(), getattr(y, name).to_numpy())
                    assert worst <= PARITY_RTOL, f"{family} step {x.step} {name}: {worst:.2g}"
        assert static.backend.graph_stats["static_steps"] > 0, "positive control: the static path ran"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (the CPU runs their static buffers)")
def test_cuda_graph_decode_equals_transformers_generate_on_a_gpu(family, path, root, prompts):
    """On a GPU the decode steps are captured CUDA graphs, replayed: greedy output must still be
    transformers' own, and every decode shape must have been captured (none fell back)."""
    from transformers import AutoModelForCausalLM

    from engine import Engine

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    with Engine(_config(family, path, root, device="cuda", dtype="float32", graph_decode="auto")) as gpu:
        for ids in prompts:
            assert _run(gpu, ids).sequence_ids == _greedy(reference, ids), f"{family}: {len(ids)}-token prompt"
        decodes = list(gpu.backend._graphs.values())
        assert decodes and gpu.backend.graph_stats["static_steps"] > 0, "positive control: graphs replayed"
        failed = {str(d.key): d.capture_error for d in decodes if d.graph is None}
        assert not failed, f"{family}: CUDA graph capture fell back to eager for {failed}"


# ------------------------------------------------------------------------------ internals


def test_every_shared_name_holds_transformer_lens_tensor(eng, path, reference, prompts, family):
    tl = transformer_lens_model(family, path, reference)
    ids = max(prompts, key=len)
    ours = eng.capture(input_ids=ids, names=["*"])
    with torch.inference_mode():
        _, cache = tl.run_with_cache(torch.tensor([ids]))
    hook = lambda n: n.split(".", 2)[2] if n.startswith("blocks.") else n  # noqa: E731
    assert {hook(n) for n in set(cache) - set(ours)} == ONLY_TRANSFORMER_LENS
    assert {hook(n) for n in set(ours) - set(cache)} == ONLY_RAYLENS
    mismatched = {}
    for name in [n for n in ours if n in cache]:
        flat = hook(name) in FLAT_IN_TRANSFORMER_LENS
        theirs = cache[name] if flat else cache[name][0]
        a = ours[name].reshape(theirs.shape) if flat else ours[name]
        assert tuple(a.shape) == tuple(theirs.shape), f"{family} {name}: {tuple(a.shape)} vs {tuple(theirs.shape)}"
        if (worst := _relative_worst(a, theirs)) > PARITY_RTOL:
            mismatched[name] = worst
    assert not mismatched, f"{family}: {len(mismatched)} names differ from TransformerLens, e.g. {mismatched}"
    assert len(ours) == 2 * len(eng.backend.info.block_hooks) + len(eng.backend.info.model_hooks)


def test_the_step_capture_equals_named_capture(eng, prompts, family):
    """The paged forward (our KV view and masks, chunked prefill) captures what the hooked plain
    forward (and SAE-training collection) does: the residual stream after layer 0 at every prompt
    position, and layer 0's attention (sliding-window layer in Gemma, every layer in Mistral)."""
    ids = max(prompts, key=len)
    result = _run(eng, ids)
    prefilled = result.events[0]
    assert isinstance(prefilled, Prefilled)
    named = eng.capture(input_ids=ids, names=["blocks.0.hook_resid_post", "blocks.0.attn.hook_pattern"])
    assert _relative_worst(prefilled.hidden_states.to_numpy(), named["blocks.0.hook_resid_post"]) <= PARITY_RTOL
    # SAE-training collection stops after the block it needs: the same tensor
    collected = residual_stream(eng.backend.reference_model, torch.tensor([ids]), 0)[0]
    assert _relative_worst(collected, named["blocks.0.hook_resid_post"]) <= PARITY_RTOL
    pattern = prefilled.attention_patterns.to_numpy()  # (h, T, T)
    assert _relative_worst(pattern, named["blocks.0.attn.hook_pattern"]) <= PARITY_RTOL
    if family in SLIDING:  # layer 0 slides: no query attends a key WINDOW or more positions back
        assert float(np.abs(np.tril(pattern, -WINDOW)).max()) == 0.0
        assert float(np.abs(np.tril(pattern, -WINDOW + 1)).max()) > 0.0, "positive control: the window's edge"


def test_embeddings_scores_and_candidates(eng, reference, prompts, family):
    """Embeddings are transformers' last hidden state (after the final norm) or layer 0's output,
    mean-pooled; prompt scores are its log-softmax; candidates are seeded samples, each the same
    as one sampled request."""
    long = max(prompts, key=len)
    scores = eng.score(long)
    with torch.inference_mode():
        logprobs = torch.log_softmax(reference(torch.tensor([long])).logits[0].float(), -1)
    expected = [None] + [float(logprobs[i - 1, t]) for i, t in enumerate(long) if i]
    assert scores.logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(scores.logprobs[1:], expected[1:])) <= 1e-3, family
    vectors, first = eng.embed(TEXTS), eng.embed(TEXTS, layer=0, pool="last")
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            hidden = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert _relative_worst(vectors[i], hidden[-1][0].mean(0)) <= PARITY_RTOL, f"{family} text {i}"
        assert _relative_worst(first[i], hidden[1][0, -1]) <= PARITY_RTOL, f"{family} text {i}, layer 0"
    ids = prompts[1]
    candidates = eng.candidates(input_ids=ids, n=3, seed=11, temperature=1.0, max_tokens=4)
    assert len({tuple(c.token_ids) for c in candidates}) > 1, "positive control: the seeds drew different samples"
    alone = eng.generate(input_ids=ids, seed=12, temperature=1.0, max_tokens=4)
    assert list(alone.sequence_ids) in [list(c.token_ids) for c in candidates]


# ----------------------------------------------------------------------------------- mods


@mod
def ban_top_token(event, actions, tokenizer):
    if isinstance(event, ForwardPass):
        logits = event.logits.to_numpy()
        logits[0, logits[0].argmax()] = -1e9
        return actions.adjust_logits(type(event.logits).from_numpy(logits))
    return None


@mod
def rethink(event, actions, tokenizer):
    """Erase more than a block of what was just written, once."""
    if isinstance(event, Added) and event.step == 6 and not event.forced:
        return actions.backtrack(steps=BLOCK + 1)
    return None


def test_a_mixed_batch_with_a_logits_mod_a_backtrack_and_a_steer(eng, prompts, family):
    steer = steer_toward(0, 20.0)
    mods = [[ban_top_token], [rethink], [steer]]
    plain = [_run(eng, ids) for ids in prompts]
    alone = [_run(eng, ids, mods=m) for ids, m in zip(prompts, mods)]
    steps = eng.loop.stats.steps
    handles = [eng.submit(input_ids=ids, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, mods=m)
               for ids, m in zip(prompts, mods)]
    batched = [h.result(timeout=300) for h in handles]
    steps, tokens = eng.loop.stats.steps - steps, sum(len(r.sequence_ids) for r in batched)
    assert steps < tokens, f"{family}: {steps} steps for {tokens} tokens: the requests never shared a step"
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert b.sequence_ids == a.sequence_ids, f"{family}: request {i} differs in the batch from alone"
    assert batched[0].sequence_ids != plain[0].sequence_ids, "positive control: the logits mod changed nothing"
    assert [a["action_type"] for a in batched[1].payload["actions"]].count("Backtrack") == 1
    assert batched[2].sequence_ids != plain[2].sequence_ids, "positive control: the steer changed nothing"
    assert batched[2].metadata["steers"] == [{"step": 0, "feature_id": 0, "scale": 20.0}]


# ------------------------------------------------------------------------------ prefix cache


def _same_events(on, off, family):
    assert on.sequence_ids == off.sequence_ids and on.prompt_ids == off.prompt_ids, family
    assert [type(e).__name__ for e in on.events] == [type(e).__name__ for e in off.events]
    for x, y in zip(on.events, off.events):
        what = f"{family} {type(x).__name__} {x.step}"
        for name in ("logits", "hidden_states", "attention_patterns"):
            xa, ya = getattr(x, name, None), getattr(y, name, None)
            assert (xa is None) == (ya is None), f"{what}: {name} in one run only"
            if xa is not None:
                assert _relative_worst(xa.to_numpy(), ya.to_numpy()) <= PARITY_RTOL, f"{what}: {name}"
        fx, fy = getattr(x, "sae_features", None), getattr(y, "sae_features", None)
        assert (fx is None) == (fy is None), f"{what}: SAE features in one run only"
        if fx is not None:
            assert np.array_equal(fx.ids, fy.ids), f"{what}: SAE feature ids differ"
            np.testing.assert_allclose(fx.values, fy.values, rtol=1e-4, atol=1e-5, err_msg=what)


def test_prefix_cache_on_and_off_give_the_same_events(eng, prompts, family):
    ids = max(prompts, key=len) + prompts[2]
    off = _run(eng, ids, prefix_cache=False)
    _run(eng, ids[: len(ids) - 3] + prompts[1])  # caches the shared blocks
    hits = eng.cache_stats()["hit_tokens"]
    on = _run(eng, ids)
    assert eng.cache_stats()["hit_tokens"] - hits >= BLOCK, f"{family}: no prefix was reused"
    _same_events(on, off, family)


# ------------------------------------------------------------------------------------ SAEs


def test_the_release_sae_reads_its_hook_and_stores_its_own_encoding(eng, prompts, family):
    encoder = eng.recorder.encoder
    identity = encoder.identity
    release = FAMILY_RELEASES[family]
    expected_hook = "blocks.1.hook_resid_pre" if release in ("gpt2-small-res-jb", "mistral-7b-res-wg") \
        else "blocks.0.hook_resid_post"
    assert identity.hook_name == expected_hook and identity.layer == 0
    assert encoder.center_input == (release == "gpt2-small-res-jb"), "only GPT-2 res-jb was trained centred"
    ids = max(prompts, key=len)
    result = _run(eng, ids)
    hidden = eng.capture(input_ids=ids, names=["blocks.0.hook_resid_post"])["blocks.0.hook_resid_post"]
    x = hidden - hidden.mean(-1, keepdim=True) if encoder.center_input else hidden
    with torch.no_grad():
        acts = encoder.sae.encode(x.float())  # (T, d_sae): sae-lens' own encoding, by hand
    features = result.events[0].sae_features  # the prompt's, as the engine encoded and stored them
    assert features.ids.shape == (len(ids), identity.top_k)
    top = torch.topk(acts, identity.top_k, dim=-1)
    np.testing.assert_allclose(features.values, top.values.numpy(), rtol=1e-4, atol=1e-5)
    fired = features.values > 0
    assert fired.any(), "positive control: some feature fired"
    assert np.array_equal(features.ids[fired], top.indices.numpy()[fired])
    if encoder.center_input:  # positive control: centring changed the encoding
        with torch.no_grad():
            assert not torch.allclose(encoder.sae.encode(hidden.float()), acts)
