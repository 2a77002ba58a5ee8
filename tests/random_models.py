"""Tiny random models the engine loads like any local directory: a family's architecture with
random weights and a word-level tokenizer, written once per test session. Nothing is downloaded,
so they run where the embedded model's package is missing (the lent GPU machine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 512


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0", pad_token="w0", bos_token="w1",
                                   eos_token="w2")


def tiny_model_dir(root: Path, family: str = "llama", *, sliding_window: int | None = None) -> Path:
    """A saved random ``family`` model (2 layers, 4 query heads of 64, 2 key/value heads):
    ``llama``, or ``mistral`` with ``sliding_window`` positions per query."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    target = root / f"tiny-{family}-{sliding_window}"
    if (target / "config.json").is_file():
        return target
    shapes = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=VOCAB, max_position_embeddings=4096,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)  # a fixture's one-off build, not a request
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=sliding_window, **shapes))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shapes))
    model.save_pretrained(target)
    _tokenizer().save_pretrained(target)
    return target
