"""The committed SAE for the embedded model: its training report meets the goals and matches the weights
and the README's tables.

Reads only files in the repository (no model, no sae-lens): the held-out figures in
``training_report.json``, overall and per kind of text, meet the goals the SAE was trained for;
the report names every corpus source with its package and licence; and the weights and config
on disk are the ones the report describes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from engine.services.sae import SAE_REGISTRY

NAME = "smollm2-135m-instruct-l16"
DIRECTORY = SAE_REGISTRY[NAME].path
EV_MIN, L0_MAX, DEAD_MAX = 0.85, 64, 0.05
KINDS = ("prose", "chat", "code")


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((DIRECTORY / "training_report.json").read_text(encoding="utf-8"))


def _sparse_and_measured(figures: dict, where: str) -> None:
    assert 0 < figures["l0"] <= L0_MAX, f"{where}: L0 {figures['l0']}"
    assert figures["heldout_tokens"] >= 5_000, f"{where}: only {figures['heldout_tokens']} held-out tokens"
    assert figures["explained_variance"] > 0.75, f"{where}: explained variance {figures['explained_variance']:.3f}"


def test_the_held_out_figures_meet_the_sparsity_and_dead_feature_goals(report):
    assert report["goals"] == {"explained_variance_min": EV_MIN, "l0_max": L0_MAX, "dead_fraction_max": DEAD_MAX}
    _sparse_and_measured(report["heldout"], "overall")
    # dead = never active on the whole held-out mix (per kind, features of the other kinds stay silent)
    assert report["heldout"]["dead_fraction"] < DEAD_MAX, f"dead fraction {report['heldout']['dead_fraction']:.3f}"


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_text_is_measured_and_sparse(report, kind):
    _sparse_and_measured(report["heldout_by_kind"][kind], kind)


def test_the_explained_variance_goal_is_met_on_the_held_out_mix(report):
    assert report["heldout"]["explained_variance"] >= EV_MIN


@pytest.mark.parametrize("kind", KINDS)
def test_the_explained_variance_goal_is_met_for_each_kind_of_text(report, kind):
    assert report["heldout_by_kind"][kind]["explained_variance"] >= EV_MIN


def test_the_held_out_set_is_the_sum_of_the_kinds(report):
    assert sum(report["heldout_by_kind"][k]["heldout_tokens"] for k in KINDS) == report["heldout"]["heldout_tokens"]


def test_the_report_lists_every_corpus_source_with_its_package_and_licence(report):
    corpus = report["corpus"]
    assert set(corpus["kinds"]) == set(KINDS)
    sources = corpus["sources"]
    assert len(sources) >= 8
    genres = {s["genre"] for s in sources}
    assert {"fiction", "encyclopaedic", "instructions", "code", "documentation"} <= genres
    for source in sources:
        assert source["licence"].strip() and source["package"].strip() and source["version"].strip(), source
        assert sum(source["tokens"].values()) > 0, f"{source['name']} contributed no tokens"
    assert any(s["package"] == "python3.11-doc" for s in sources)  # the Python docs stay one part


def test_the_default_corpus_is_the_one_the_committed_sae_was_trained_on(report):
    from pipelines.sae_training import corpus
    from pipelines.sae_training.train import TrainConfig

    trained = report["config"]["corpus"]
    assert trained == TrainConfig().corpus, "the training defaults must rebuild the committed SAE's corpus"
    mix = corpus.CORPORA[trained]
    assert [(s.name, s.package, s.licence) for s in mix.sources] == \
        [(s["name"], s["package"], s["licence"]) for s in report["corpus"]["sources"]]
    assert {k: round(v, 3) for k, v in mix.shares.items()} == \
        {k: figures["share"] for k, figures in report["corpus"]["kinds"].items()}


def test_training_writes_where_the_engine_reads_the_committed_sae():
    from pipelines.sae_training import COMMITTED_SAE_DIR
    from pipelines.sae_training.train import _parse

    assert COMMITTED_SAE_DIR == DIRECTORY and _parse([])[1].out == DIRECTORY


def test_the_weights_on_disk_are_the_ones_the_report_describes(report):
    weights = DIRECTORY / report["weights"]["file"]
    assert weights.stat().st_size == report["weights"]["size_bytes"]
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == report["weights"]["sha256"]


def test_the_sae_config_matches_the_report(report):
    cfg = json.loads((DIRECTORY / "cfg.json").read_text(encoding="utf-8"))
    trained = report["config"]
    assert cfg["d_sae"] == trained["width"] and cfg["k"] == trained["k"] and cfg["d_in"] == 576
    assert cfg["metadata"]["hook_name"] == report["hook_name"] == f"blocks.{trained['layer']}.hook_resid_post"


def test_the_local_config_reads_the_committed_sae_at_its_layer(report):
    import yaml

    local = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "local.yaml").read_text())
    assert local["sae"]["sae_id"] == NAME and local["sae"]["layer"] == report["config"]["layer"]
    assert local["sae"]["top_k"] <= report["config"]["k"]


# ------------------------------------------------------- sae-lens' evaluation on text outside the corpus

CE_LOSS_SCORE_MIN = 0.9
HELDOUT_TEXTS = ("raw", "chat")
#: "Dead" here is "never fired in the sample", so the sample must hold more tokens than the SAE has
#: features, or rare features count as dead for want of text (with 8192 features: 5.9 % on ~8k
#: chat tokens, 3.3 % on ~16k).
SAMPLE_TOKENS_PER_FEATURE = 2


def test_sae_lens_figures_on_text_outside_the_corpus_name_their_source_and_licence(report):
    heldout = report["sae_lens_heldout"]
    source = heldout["source"]
    assert source["package"] not in {s["package"] for s in report["corpus"]["sources"]}, "must be outside the corpus"
    assert source["version"].strip() and "GFDL" in source["licence"]
    assert set(heldout["by_text"]) == set(HELDOUT_TEXTS)
    settings = heldout["settings"]
    for kind in HELDOUT_TEXTS:
        figures = heldout["by_text"][kind]
        assert figures["text"] == kind and figures["rows"] == settings["batches"] * settings["batch_prompts"]
        assert figures["tokens"] == figures["rows"] * settings["context_size"], figures
        assert figures["tokens"] >= SAMPLE_TOKENS_PER_FEATURE * report["config"]["width"], figures
        assert 0 <= figures["rows_left_out"] < figures["rows"] // 4, figures  # attention-sink rows, counted
        # positive control of the CE-loss score: zeroing the hook must cost far more than the SAE does
        assert figures["ce_loss_with_ablation"] > figures["ce_loss_with_sae"] >= figures["ce_loss_without_sae"] * 0.99


@pytest.mark.parametrize("kind", KINDS)
def test_sae_lens_figures_on_each_kinds_held_out_sequences_meet_the_goals(report, kind):
    figures = report["sae_lens_evals"]["by_kind"][kind]
    assert figures["ce_loss_score"] >= CE_LOSS_SCORE_MIN and figures["explained_variance"] >= EV_MIN, figures
    assert 0 < figures["l0"] <= L0_MAX and figures["dead_fraction"] < DEAD_MAX, figures


@pytest.mark.parametrize("kind", HELDOUT_TEXTS)
def test_sae_lens_ce_loss_score_and_sparsity_goals_hold_outside_the_corpus(report, kind):
    figures = report["sae_lens_heldout"]["by_text"][kind]
    assert figures["ce_loss_score"] >= CE_LOSS_SCORE_MIN, figures
    assert 0 < figures["l0"] <= L0_MAX, figures


@pytest.mark.parametrize("kind", HELDOUT_TEXTS)
def test_sae_lens_dead_feature_goal_holds_outside_the_corpus(report, kind):
    assert report["sae_lens_heldout"]["by_text"][kind]["dead_fraction"] < DEAD_MAX


@pytest.mark.parametrize("kind", HELDOUT_TEXTS)
def test_sae_lens_explained_variance_goal_outside_the_corpus(report, kind):
    assert report["sae_lens_heldout"]["by_text"][kind]["explained_variance"] >= EV_MIN


# ------------------------------------------------------------------------ the README shows these figures


def _readme_row(label: str) -> list[str]:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    rows = [line for line in readme.splitlines() if line.startswith(f"| {label} |")]
    assert len(rows) == 1, f"the README should have one table row for {label!r}, found {len(rows)}"
    return [cell.strip().strip("*").replace(",", "") for cell in rows[0].strip("|").split("|")][1:]


@pytest.mark.parametrize("label, kind", [("prose", "prose"), ("chat", "chat"), ("code", "code"), ("**all**", None)])
def test_the_readme_held_out_table_is_the_reports(report, label, kind):
    figures = report["heldout"] if kind is None else report["heldout_by_kind"][kind]
    tokens, ev, l0, dead = _readme_row(label)
    assert int(tokens) == figures["heldout_tokens"]
    assert ev == f"{figures['explained_variance']:.3f}" and l0 == f"{figures['l0']:.0f}"
    assert dead == f"{100 * figures['dead_fraction']:.1f} %"


@pytest.mark.parametrize("label, text", [("raw paragraphs", "raw"), ("chat-templated", "chat")])
def test_the_readme_sae_lens_table_is_the_reports(report, label, text):
    figures = report["sae_lens_heldout"]["by_text"][text]
    ce, kl, ev, l0, dead = _readme_row(label)
    assert [ce, kl, ev] == [f"{figures[k]:.3f}" for k in ("ce_loss_score", "kl_div_score", "explained_variance")]
    assert l0 == f"{figures['l0']:.0f}" and dead == f"{100 * figures['dead_fraction']:.1f} %"
