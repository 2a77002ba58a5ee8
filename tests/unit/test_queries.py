"""Store queries against small hand-built data with answers computed by hand."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest

from engine.services import queries
from engine.errors import InvalidRequestError
from engine.services.store import ActivationStore, RequestRecord
from engine.services.store_schema import ACTIVATION_SCHEMA

UTC = timezone.utc
NOW = datetime.now(UTC)


def table(entries: list[tuple]) -> pa.Table:
    """entries: (request_id, step, position, token_id, feature, value, rank, age_days)."""
    cols = list(zip(*entries))
    return pa.table({
        "request_id": list(cols[0]), "step": list(cols[1]), "token_position": list(cols[2]),
        "token_id": list(cols[3]), "created_at": [NOW - timedelta(days=d) for d in cols[7]],
        "sae_release": ["s"] * len(entries), "sae_layer": [16] * len(entries), "feature_id": list(cols[4]),
        "activation_value": list(cols[5]), "rank": list(cols[6]), "source_mode": ["inline"] * len(entries),
        "model_id": ["m"] * len(entries),
    }, schema=ACTIVATION_SCHEMA)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("q") / "q.duckdb"
    with ActivationStore(path) as s:
        # request A: prompt tokens at step 0 (positions 1-2), generated tokens read at steps 1-3
        s.append_activations(table([
            ("A", 0, 1, 100, 7, 1.0, 0, 0), ("A", 0, 1, 100, 9, 0.5, 1, 0),
            ("A", 0, 2, 101, 9, 2.0, 0, 0),
            ("A", 1, 3, 102, 7, 4.0, 0, 0), ("A", 1, 3, 102, 9, 3.0, 1, 0),
            ("A", 2, 4, 103, 9, 1.5, 0, 0),
            ("A", 3, 5, 104, 7, 2.5, 0, 0),
        ]), batch_id="A/0", request_id="A")
        s.append_activations(table([
            ("B", 1, 7, 200, 7, 6.0, 0, 10), ("B", 2, 8, 201, 7, 5.5, 0, 1), ("B", 2, 8, 201, 3, 9.0, 1, 1),
        ]), batch_id="B/0", request_id="B")
        s.record_request(RequestRecord("A", "m", "p", "o", [50, 100, 101], [102, 103, 104], "stop", {}))
        s.record_request(RequestRecord("B", "m", "p", "o", [60, 61, 62, 63, 64, 65, 66], [200, 201], "stop", {}))
        yield s


def test_feature_deltas_fill_gaps_with_zero_and_difference_in_time_order(store):
    result = queries.feature_deltas(store, "A", 7).to_pylist()
    assert [(r["step"], r["token_position"], r["activation"], r["delta"]) for r in result] == [
        (0, 1, 1.0, 1.0),
        (0, 2, 0.0, -1.0),  # feature 7 not in position 2's top-k
        (1, 3, 4.0, 4.0),
        (2, 4, 0.0, -4.0),
        (3, 5, 2.5, 2.5),
    ]
    assert [r["token_id"] for r in result] == [100, 101, 102, 103, 104]


def test_threshold_search_finds_every_firing_across_runs_and_respects_since(store):
    hits = queries.threshold_search(store, 7, 2.5).to_pylist()
    assert [(h["request_id"], h["step"], h["activation_value"]) for h in hits] == [
        ("B", 1, 6.0), ("B", 2, 5.5), ("A", 1, 4.0), ("A", 3, 2.5)]
    recent = queries.threshold_search(store, 7, 2.5, since=timedelta(days=7)).to_pylist()
    assert [h["request_id"] for h in recent] == ["B", "A", "A"]  # B's 10-day-old row is out


def test_top_features_per_request_and_per_step(store):
    top = queries.top_features(store, "A", order="activation").to_pylist()
    assert [(t["feature_id"], t["max_activation"], t["tokens"], t["peak_step"]) for t in top] == [
        (7, 4.0, 3, 1), (9, 3.0, 4, 1)]
    assert top[0]["mean_activation"] == pytest.approx((1.0 + 4.0 + 2.5) / 3)
    step0 = queries.top_features(store, "A", step=0, order="activation").to_pylist()
    assert [(t["feature_id"], t["max_activation"], t["peak_position"]) for t in step0] == [(9, 2.0, 2), (7, 1.0, 1)]


def test_top_features_rank_by_specificity_against_the_store_wide_mean(store):
    """7 stored tokens (A: 5, B: 2). Feature 7 fires on 5 of them (sum 19.0, mean 19/7), feature
    9 on 4 (sum 7.0, mean 1.0), feature 3 on 1 (9.0, mean 9/7). Specificity = a request's peak
    over that mean: in A, 9 scores 3.0 / 1.0 = 3 and 7 scores 4.0 / (19/7) ≈ 1.47, so 9 ranks first
    although 7 peaks higher; both fire on most tokens (dense), 3 does not."""
    top = queries.top_features(store, "A").to_pylist()
    assert [t["feature_id"] for t in top] == [9, 7]
    assert top[0]["specificity"] == pytest.approx(3.0) and top[1]["specificity"] == pytest.approx(4.0 / (19 / 7))
    assert top[1]["store_frequency"] == pytest.approx(5 / 7) and top[1]["store_mean"] == pytest.approx(19 / 7)
    assert [t["dense"] for t in top] == [True, True]
    b = queries.top_features(store, "B").to_pylist()
    assert [(t["feature_id"], t["dense"]) for t in b] == [(3, False), (7, True)]
    assert b[0]["specificity"] == pytest.approx(9.0 / (9 / 7)) and b[0]["store_frequency"] == pytest.approx(1 / 7)
    dense = queries.dense_features(store).to_pylist()
    assert [(d["feature_id"], d["tokens_fired"]) for d in dense] == [(7, 5), (9, 4)]
    assert [d["feature_id"] for d in queries.dense_features(store, request_id="B").to_pylist()] == [7]
    with pytest.raises(InvalidRequestError, match="`order` must be specificity or activation"):
        queries.top_features(store, "A", order="peak")


def test_recent_requests_preview_the_last_user_message_not_the_system_prompt(tmp_path):
    chat = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n")
    with ActivationStore(tmp_path / "p.duckdb") as s:
        s.record_request(RequestRecord("chat", "m", chat, "Light scatters.", [1], [2], "stop", {},
                                       created_at=NOW - timedelta(minutes=1)))
        s.record_request(RequestRecord("raw", "m", "Once upon a time", "…", [3], [4], "stop", {}, created_at=NOW))
        rows = queries.recent_requests(s).to_pylist()
    assert [(r["request_id"], r["prompt_preview"]) for r in rows] == [("raw", "Once upon a time"),
                                                                    ("chat", "Why is the sky blue?")]


def test_top_activating_tokens_come_with_their_context(store):
    best = queries.top_activating_tokens(store, 7, limit=2, context=3).to_pylist()
    assert [(b["request_id"], b["token_position"], b["token_id"]) for b in best] == [("B", 7, 200), ("B", 8, 201)]
    # three tokens before (positions 4..6 of B's prompt + output), then the token itself
    assert best[0]["context_ids"] == [64, 65, 66, 200]
    assert best[1]["context_ids"] == [65, 66, 200, 201]


def test_decode_tokens_adds_text(store):
    class Tok:
        def batch_decode(self, batch):
            return ["|".join(str(i) for i in ids) for ids in batch]

    decoded = queries.decode_tokens(queries.top_activating_tokens(store, 7, limit=1, context=2), Tok())
    assert decoded.column("token").to_pylist() == ["200"] and decoded.column("context").to_pylist() == ["65|66|200"]


def test_outputs_convert_to_pandas(store):
    frame = queries.top_features(store, "A", output="pandas")
    assert list(frame["feature_id"]) == [9, 7]


def test_parse_since():
    assert queries.parse_since("7d") == timedelta(days=7) and queries.parse_since("12h") == timedelta(hours=12)
    with pytest.raises(InvalidRequestError, match="must look like 7d"):
        queries.parse_since("yesterday")


# ------------------------------------------------------------------------- no rows, bad arguments


def _hf_tokenizer():
    """A real HF fast tokenizer built in memory (no model download): it decodes an empty batch as
    one empty string, which is what broke empty results."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"t{i}": i for i in range(1, 300)}}
    return PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(
        tokenizers.models.WordLevel(vocab, unk_token="[UNK]")))


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory):
    with ActivationStore(tmp_path_factory.mktemp("empty") / "e.duckdb") as s:
        yield s


QUERY_KINDS = {
    "top_features": lambda s: queries.top_features(s, "none"),
    "top_features_step": lambda s: queries.top_features(s, "none", step=3),
    "feature_deltas": lambda s: queries.feature_deltas(s, "none", 7),
    "threshold_search": lambda s: queries.threshold_search(s, 7, 0.0, since=timedelta(days=1)),
    "top_activating_tokens": lambda s: queries.top_activating_tokens(s, 7),
}


@pytest.mark.parametrize("kind", sorted(QUERY_KINDS))
def test_a_query_with_no_rows_is_an_empty_table_with_its_columns_even_decoded(empty_store, store, kind):
    empty = QUERY_KINDS[kind](empty_store)
    assert empty.num_rows == 0 and empty.column_names == QUERY_KINDS[kind](store).column_names
    decoded = queries.decode_tokens(empty, _hf_tokenizer())
    assert decoded.num_rows == 0
    assert set(decoded.column_names) - set(empty.column_names) <= {"token", "context"}


def test_decoding_with_a_real_tokenizer_still_adds_text_to_rows(store):
    # positive control for the empty case: rows get their text
    decoded = queries.decode_tokens(queries.top_activating_tokens(store, 7, limit=1, context=2), _hf_tokenizer())
    assert decoded.column("token").to_pylist() == ["t200"] and decoded.num_rows == 1


@pytest.mark.parametrize("call,name", [
    (lambda s: queries.top_features(s, "A", limit=0), "limit"),
    (lambda s: queries.top_features(s, "A", limit=2**64), "limit"),
    (lambda s: queries.top_features(s, "A", step=-1), "step"),
    (lambda s: queries.feature_deltas(s, "A", 2**63), "feature"),
    (lambda s: queries.threshold_search(s, 7, 1.0, since=timedelta(days=10**6)), "since"),
    (lambda s: queries.threshold_search(s, 7, float("nan")), "min"),
    (lambda s: queries.top_activating_tokens(s, 7, context=-1), "context"),
])
def test_out_of_range_arguments_are_refused_naming_the_argument(store, call, name):
    with pytest.raises(InvalidRequestError, match=f"`{name}` must be") as err:
        call(store)
    assert err.value.parameter == name


@pytest.mark.parametrize("text", ["0d", "99999999999999d", "9" * 5000 + "s", "36501d"])
def test_since_out_of_range_is_refused(text):
    with pytest.raises(InvalidRequestError, match="`since` must"):
        queries.parse_since(text)
    assert queries.parse_since("36500d") == timedelta(days=36500)  # the bound itself is allowed
