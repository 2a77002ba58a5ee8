"""The taps table on a tiny randomly initialised Llama (no weights loaded): built once per model,
dies with it, reads every name in forward order. The embedded model's tests are in
tests/integration/test_taps.py."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.model.hook_names import expand_hook_names
from engine.model.kv_cache import cache_argument
from engine.model.taps import taps_of


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny():
    return _tiny_llama()


def test_the_table_is_built_once_and_dies_with_its_model():
    model = _tiny_llama()
    table = taps_of(model)
    assert taps_of(model) is table and taps_of(table) is table
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None, "the taps table kept an unloaded model alive"


def test_recording_every_name_gives_each_its_documented_shape(tiny):
    from transformers import DynamicCache

    taps = taps_of(tiny)
    names = expand_hook_names(["*"], 2, taps.hooks)
    T, d, h, g, hd, m = 5, 16, 2, 1, 8, 32
    expected = {"(T, d)": (T, d), "(T, h, hd)": (T, h, hd), "(T, g, hd)": (T, g, hd), "(h, T, T)": (h, T, T),
                "(T, m)": (T, m), "(T, 1)": (T, 1)}
    cache = DynamicCache(config=tiny.config)
    with taps.record(names) as rec, torch.inference_mode():
        taps.base(input_ids=torch.arange(T)[None], use_cache=True, **cache_argument(taps.base, cache))
    tensors = rec.tensors(cache)
    assert list(tensors) == names
    for name, tensor in tensors.items():
        assert tuple(tensor.shape[1:]) == expected[name.spec.shape], f"{name}: {tuple(tensor.shape)}"
