"""A request id reused in-process with the SAE on runs under a fresh id, as a Ray job's lines do:
the store's rows of the first request keep describing its tokens, and the second gets its own."""

from __future__ import annotations

import dataclasses

from engine import Engine
from tests.helpers import build_config


def test_a_reused_request_id_runs_under_a_fresh_one_and_keeps_the_first_requests_rows(engine, tmp_path):
    cfg = build_config()
    cfg = dataclasses.replace(
        cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp_path / "s.duckdb")),
        sae=dataclasses.replace(cfg.sae, enabled=True, mode="inline"))
    with Engine(cfg, backend=engine.backend) as eng:
        first = eng.generate("Tell me about dragons", max_tokens=6, temperature=0.0, request_id="same")
        eng.flush()
        before = eng.store.request_counts(["same"])
        assert first.request_id == "same" and before["activations"] > 0, before  # positive control
        second = eng.generate("Name three fruits", max_tokens=4, temperature=0.0, request_id="same")
        eng.flush()
        assert second.request_id != "same" and second.request_id.startswith("same~")
        assert second.metadata["given_request_id"] == "same" and "given_request_id" not in first.metadata
        assert eng.store.request_counts(["same"]) == before, "the first request's rows changed"
        assert eng.store.request_counts([second.request_id])["activations"] > 0
        [(output,)] = eng.store.cursor().execute("SELECT output_text FROM requests WHERE request_id = ?",
                                                ["same"]).fetchall()
        assert output == first.output_text
        fresh = eng.generate("Hi", max_tokens=2, temperature=0.0)  # a generated id is never renamed
        assert "given_request_id" not in fresh.metadata
