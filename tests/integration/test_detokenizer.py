"""The incremental detokenizer (engine/core/detokenizer.py) against a full decode of the same ids,
with the embedded model's byte-level tokenizer: multi-byte characters split over tokens, special
tokens kept and skipped, erasures anywhere — and the streamed OpenAI text built on it."""

from __future__ import annotations

import random

import pytest

from engine.core.detokenizer import IncrementalDetokenizer, token_pieces

TEXT = ("Héllo wörld — 日本語のテキスト 🙂👍🏽 naïve café <|im_start|>user\nok<|im_end|> ∑∫√ Ünïcödé "
        "and then some plain English words to make it longer.")


@pytest.fixture(scope="module")
def ids(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    special = set(tokenizer.all_special_ids)
    # positive controls: the text splits characters over tokens and holds special tokens
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids), "no token ends inside a character"
    assert special & set(ids), "no special token in the text"
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_the_text_equals_a_full_decode_on_every_prefix(tokenizer, ids, skip):
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    pending_seen = 0
    for i, token in enumerate(ids):
        detokenizer.push(token)
        full = tokenizer.decode(ids[:i + 1], skip_special_tokens=skip)
        assert detokenizer.text + detokenizer.flush() == full, f"prefix of {i + 1} tokens"
        assert full.startswith(detokenizer.text), "streamed text must never need taking back"
        pending_seen += bool(detokenizer.flush())
    assert pending_seen > 0, "positive control: some character waited for a later token"
    assert detokenizer.text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_erasing_any_number_of_tokens_keeps_the_text_equal_to_a_full_decode(tokenizer, ids):
    rng = random.Random(0)
    for trial in range(50):
        detokenizer, kept = IncrementalDetokenizer(tokenizer), []
        for token in ids:
            detokenizer.push(token)
            kept.append(token)
            if rng.random() < 0.25:
                n = rng.randint(0, 4)
                assert detokenizer.erase(n) == min(n, len(kept) - 0)
                del kept[len(kept) - min(n, len(kept)):]
            assert detokenizer.text + detokenizer.flush() == tokenizer.decode(kept, skip_special_tokens=True), trial
            assert detokenizer.ids == kept


def test_each_token_decodes_a_bounded_window_not_the_whole_output(tokenizer):
    """O(1) work per token: the ids a push decodes do not grow with the output's length."""
    widths: list[int] = []

    class Counting:
        def decode(self, ids, **kwargs):
            widths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    long_ids = tokenizer.encode(" word" * 400, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(Counting())
    for token in long_ids:
        detokenizer.push(token)
    assert len(long_ids) >= 400 and max(widths) <= 8, f"widest decode {max(widths)} ids"
    assert detokenizer.text == tokenizer.decode(long_ids)


def test_token_pieces_concatenate_to_the_decoded_prompt(tokenizer, ids):
    pieces = token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids)
    assert "" in pieces  # a token that only starts a character adds nothing of its own
