"""Request ids are claimed per job run: an id any earlier run used is never reused, so stored rows
never describe two runs' tokens under one id."""

from __future__ import annotations

import pyarrow as pa

from engine.services.store import ActivationStore, RequestRecord


def test_fresh_ids_stay_and_used_ones_get_the_run_suffix(tmp_path):
    with ActivationStore(tmp_path / "s.duckdb") as store:
        assert store.claim_request_ids(["a", "b", "a"], "run1") == ["a", "b", "a~run1"]
        store.record_request(RequestRecord("c", "m", "p", "o", [1], [2], "stop", {}))
        assert store.claim_request_ids(["a", "c", "d"], "run2") == ["a~run2", "c~run2", "d"]
        assert store.claim_request_ids(["a"], "run2") == ["a~run2.2"]


def test_an_id_with_stored_blocks_only_counts_as_used(tmp_path):
    rows = pa.table({"request_id": ["x"], "step": [0], "token_position": [1], "token_id": [5],
                     "created_at": pa.array([0], pa.timestamp("us", tz="UTC")), "sae_release": ["r"],
                     "sae_layer": [1], "feature_id": [3], "activation_value": [1.0], "rank": [0],
                     "source_mode": ["nearline"], "model_id": ["m"]})
    with ActivationStore(tmp_path / "s.duckdb") as store:
        store.append_activations(rows, batch_id="x/0", request_id="x")
        assert store.claim_request_ids(["x"], "r") == ["x~r"]
        assert store.request_counts(["x"])["activations"] == 1
        assert store.request_counts(["x~r", "other"])["activations"] == 0  # a job counts its own rows only


def test_a_suffixed_id_keeps_within_the_length_limit(tmp_path):
    with ActivationStore(tmp_path / "s.duckdb") as store:
        long = "L" * 255
        assert store.claim_request_ids([long], "r1", max_chars=255) == [long]
        [again] = store.claim_request_ids([long], "r2", max_chars=255)
        [retry] = store.claim_request_ids([long + "-retry1"], "r2", max_chars=255)
        assert len(again) == len(retry) == 255 and again.endswith("~r2") and again != retry
