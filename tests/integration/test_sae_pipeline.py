"""SAE on the embedded model: the committed SAE, both extraction modes, the CLI, the training pipeline."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine import Engine
from engine.services.sae import SAE_REGISTRY, SAEEncoder
from tests.helpers import build_config, forward_prompt

PROMPT = "Tell me about dragons"
COMMITTED = "smollm2-135m-instruct-l16"


def sae_engine(engine, tmp_path, mode: str) -> Engine:
    cfg = build_config()
    cfg = dataclasses.replace(
        cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp_path / f"{mode}.duckdb")),
        sae=dataclasses.replace(cfg.sae, enabled=True, mode=mode, block_steps=4))
    return Engine(cfg, backend=engine.backend)


def test_the_committed_sae_fits_the_embedded_model_and_reconstructs_it(engine):
    info = engine.backend.info
    encoder = SAEEncoder.load(COMMITTED, layer=16, top_k=20, model_hidden_size=info.hidden_size,
                              model_layers=info.num_layers)
    assert encoder.identity.d_in == info.hidden_size and encoder.identity.layer == 16
    report = json.loads((SAE_REGISTRY[COMMITTED].path / "training_report.json").read_text())
    assert report["heldout"]["explained_variance"] > 0.75 and report["heldout"]["dead_fraction"] < 0.05
    # a fresh positive control on text the SAE never saw: it explains most of the variance
    ids = engine.encode("The lighthouse keeper found a bottle with a letter inside.")
    hidden = forward_prompt(engine, ids, ["blocks.16.hook_resid_post"]).captured.hidden[16][1:]
    with torch.no_grad():
        recon = encoder.sae.decode(encoder.sae.encode(hidden))
    ev = 1 - ((hidden - recon) ** 2).sum() / ((hidden - hidden.mean(0)) ** 2).sum()
    assert ev > 0.5, f"explained variance on fresh text {ev:.3f}"


def test_nearline_and_inline_write_the_same_rows(engine, tmp_path):
    rows = {}
    for mode in ("inline", "nearline"):
        eng = sae_engine(engine, tmp_path, mode)
        try:
            result = eng.generate(PROMPT, max_tokens=10, temperature=0.0, request_id=f"same-{mode}")
            eng.flush()
            rows[mode] = eng.store.cursor().execute(
                "SELECT step, token_position, token_id, feature_id, rank, activation_value, source_mode "
                "FROM activations ORDER BY step, token_position, rank").fetchall()
            assert result.metadata["sae"]["blocks_missing"] == 0
        finally:
            eng.close()
    inline, nearline = rows["inline"], rows["nearline"]
    assert len(inline) == len(nearline) > 0
    for a, b in zip(inline, nearline):
        assert a[:5] == b[:5], (a, b)
        assert a[5] == pytest.approx(b[5], rel=1e-3, abs=1e-3)
    assert {r[6] for r in inline} == {"inline"} and {r[6] for r in nearline} == {"nearline"}
    steps = sorted({r[0] for r in inline})
    assert steps == list(range(10))  # prompt rows at step 0, then one token read per step


def test_the_requests_table_makes_results_readable_without_ingest(engine, tmp_path):
    eng = sae_engine(engine, tmp_path, "nearline")
    try:
        result = eng.generate(PROMPT, max_tokens=6, temperature=0.0)
        eng.flush()
        (row,) = eng.store.cursor().execute(
            "SELECT prompt_ids, output_ids, output_text, finish_reason, config FROM requests").fetchall()
    finally:
        eng.close()
    assert row[0] == result.prompt_ids and row[1] == result.output_ids and row[2] == result.output_text
    assert json.loads(row[4])["sae"]["release"] == COMMITTED


def test_generate_with_sae_then_query_from_the_cli(capsys, tmp_path, monkeypatch):
    from pipelines.cli import main

    monkeypatch.chdir(tmp_path)  # the store lands in ./artifacts/activations
    assert main(["generate", "--prompt", PROMPT, "--max-tokens", "8", "--temperature", "0", "--sae",
                 "--request-id", "cli-sae"]) == 0
    capsys.readouterr()
    assert main(["query", "top", "--request-id", "cli-sae", "--limit", "3", "--json"]) == 0
    top = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(top) == 3 and top[0]["specificity"] >= top[-1]["specificity"] > 0 and top[-1]["max_activation"] > 0
    feature = top[0]["feature_id"]
    assert main(["query", "deltas", "--request-id", "cli-sae", "--feature", str(feature), "--json"]) == 0
    deltas = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sum(d["delta"] for d in deltas) == pytest.approx(deltas[-1]["activation"], abs=1e-3)
    assert main(["query", "threshold", "--feature", str(feature), "--min", "0.001", "--since", "1h", "--json"]) == 0
    assert all(json.loads(line)["request_id"] == "cli-sae" for line in capsys.readouterr().out.splitlines())
    assert main(["query", "tokens", "--feature", str(feature), "--limit", "2"]) == 0
    assert "context" in capsys.readouterr().out
    assert main(["store", "export"]) == 0 and "by date" in capsys.readouterr().out
    assert main(["store", "retention"]) == 0 and "deleted 0 rows" in capsys.readouterr().out


def test_the_training_pipeline_runs_end_to_end_on_a_small_budget(engine, tmp_path):
    from pipelines.sae_training.train import main

    out = tmp_path / "sae"
    assert main(["--corpus", "cpython", "--tokens", "6000", "--width", "256", "--k", "8", "--train-batch", "512",
                 "--epochs", "2", "--eval-context-size", "32", "--eval-batch-prompts", "2", "--eval-batches", "1",
                 "--outside-eval-batches", "2", "--out", str(out)]) == 0
    report = json.loads((out / "training_report.json").read_text())
    assert report["train_tokens"] > 4000 and 0 < report["heldout"]["l0"] <= 8
    # sae-lens' own evaluation of the saved SAE on the held-out sequences is in the report
    evals = report["sae_lens_evals"]
    assert evals["settings"]["context_size"] == 32 and evals["by_kind"]
    for kind, figures in evals["by_kind"].items():
        assert figures["rows"] == 2 and 0 < figures["l0"] <= 8, (kind, figures)
        assert figures["ce_loss_with_ablation"] > figures["ce_loss_without_sae"], (kind, figures)
        assert {"ce_loss_score", "kl_div_score", "explained_variance", "dead_fraction", "dense_fraction"} <= set(figures)
    # and on text from outside the corpus (GNU Coding Standards raw, Maintainer Information as chat)
    outside = report["sae_lens_heldout"]
    assert outside["source"]["package"] == "gnu-standards" and outside["settings"]["context_size"] == 32
    for text, figures in outside["by_text"].items():
        assert figures["text"] == text and figures["rows"] == 4 and 0 < figures["l0"] <= 8, (text, figures)
    assert set(outside["by_text"]) == {"raw", "chat"}
    assert report["feature_examples"] and (out / "sae_weights.safetensors").stat().st_size < 15_000_000
    info = engine.backend.info
    encoder = SAEEncoder.load(str(out), layer=16, top_k=4, model_hidden_size=info.hidden_size,
                              model_layers=info.num_layers)
    assert encoder.identity.d_sae == 256
