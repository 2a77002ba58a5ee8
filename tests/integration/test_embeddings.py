"""Embeddings on the embedded model: pooled against transformers' own hidden states, a batch
equal to the texts one by one, deterministic, and refusing bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequestError, LayerOutOfRangeError
from engine.model.capture import hidden_states_index
from engine.model.embeddings import batches
from tests.helpers import FP32_NOISE_TOL

# Lengths chosen so that one padded batch mixes texts of different lengths (checked below).
TEXTS = [
    "n : Nat\n⊢ n + 0 = n",
    "a b : Nat\n⊢ a + b = b + a",
    "The quick brown fox jumps over the lazy dog.",
    "hello world",
    "xs : List Nat\nh : xs ≠ []\n⊢ xs.length > 0",
]
BATCH_EQUALS_ONE_BY_ONE_TOL = 1e-5  # float32, max abs difference


@pytest.fixture(scope="module")
def token_ids(tokenizer):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def test_texts_share_padded_batches_with_other_lengths(token_ids):
    groups = batches([len(ids) for ids in token_ids], batch_size=16)
    mixed = [chunk for _, chunk in groups if len({len(token_ids[i]) for i in chunk}) > 1]
    assert mixed, f"positive control: some batch must pad texts of different lengths, got {groups}"


@pytest.mark.parametrize("layer,pool", [(None, "mean"), (5, "last"), ("last", "mean")])
def test_batch_equals_texts_one_by_one(engine, layer, pool):
    layer = engine.backend.info.num_layers - 1 if layer == "last" else layer
    batched = engine.embed(TEXTS, layer=layer, pool=pool)
    alone = np.stack([engine.embed([text], layer=layer, pool=pool)[0] for text in TEXTS])
    worst = float(np.abs(batched - alone).max())
    assert worst < BATCH_EQUALS_ONE_BY_ONE_TOL, (f"layer={layer} pool={pool}: a batch differs from one by one by "
                                                 f"{worst:.3g} >= {BATCH_EQUALS_ONE_BY_ONE_TOL}")


def test_embed_shape_dtype_and_determinism(engine):
    first = engine.embed(TEXTS)
    assert first.shape == (len(TEXTS), engine.backend.info.hidden_size) and first.dtype == np.float32
    engine.embed(["something else entirely, to leave any state behind"], batch_size=1)
    again = engine.embed(list(reversed(TEXTS)), batch_size=2)[::-1]
    assert np.array_equal(first, again), f"embeddings changed on repeat by {np.abs(first - again).max():.3g}"


def test_distinct_texts_get_distinct_embeddings(engine):
    vectors = engine.embed(TEXTS[:2])
    cosine = float(vectors[0] @ vectors[1] / np.linalg.norm(vectors[0]) / np.linalg.norm(vectors[1]))
    assert cosine < 0.999, f"two different proof states embed alike (cosine {cosine:.5f})"


@pytest.fixture(scope="module")
def hf_hidden(engine, token_ids):
    """Independent reference: transformers' ``output_hidden_states`` for each text alone, as plain
    tokens with no BOS (its last entry is the final norm's output)."""
    with torch.inference_mode():
        return [engine.backend.reference_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
                for ids in token_ids]


@pytest.mark.parametrize("layer,pool", [(None, "mean"), (None, "last"), (5, "mean"), (5, "last")])
def test_embed_pools_transformers_hidden_states(engine, hf_hidden, layer, pool):
    index = -1 if layer is None else hidden_states_index(layer)
    expected = np.stack([(h[index][0].mean(0) if pool == "mean" else h[index][0, -1]).numpy() for h in hf_hidden])
    got = engine.embed(TEXTS, layer=layer, pool=pool)
    scale = max(1.0, float(np.abs(expected).max()))
    worst = float(np.abs(got - expected).max())
    assert worst <= FP32_NOISE_TOL * scale, (f"layer={layer} pool={pool} differs from output_hidden_states by "
                                             f"{worst:.3g} > {FP32_NOISE_TOL} x {scale:.3g}")


def test_last_layer_is_the_residual_stream_not_the_normed_output(engine):
    last = engine.backend.info.num_layers - 1
    raw, normed = engine.embed(TEXTS[:1], layer=last), engine.embed(TEXTS[:1])
    assert np.abs(raw - normed).max() > 1.0, "layer=last must be hook_resid_post, before the final norm"


@pytest.mark.parametrize("kwargs,error,message", [
    ({"pool": "max"}, InvalidRequestError, "`pool` must be one of mean, last"),
    ({"layer": 10_000}, LayerOutOfRangeError, "`layer` must be in [0,"),
    ({"texts": []}, InvalidRequestError, "at least one text"),
    ({"texts": "one string"}, InvalidRequestError, "must be a list of strings"),
    ({"texts": ["ok", ""]}, InvalidRequestError, "`texts[1]` must be a non-empty string"),
    ({"batch_size": 0}, InvalidRequestError, "`batch_size` must be an int >= 1"),
])
def test_embed_refuses_bad_arguments(engine, kwargs, error, message):
    kwargs = {"texts": TEXTS[:1], **kwargs}
    with pytest.raises(error) as info:
        engine.embed(kwargs.pop("texts"), **kwargs)
    assert message in str(info.value)
