"""``raylens sae-eval``, run in-process through ``main``: its figures are sae-lens' own.

The reference calls sae-lens directly, written here without raylens' evaluation module: the SAE
loaded with ``SAE.load_from_disk``, TransformerLens' model of the converted directory, sae-lens'
``ActivationsStore`` over the same rows and ``run_evals``. The command's JSON must hold the same
numbers. User mistakes exit 2 with one line naming the fix, before the model loads.
"""

from __future__ import annotations

import json
import math

import pytest

from pipelines.cli import main

TEXTS = [
    "The lighthouse keeper climbed the stairs every evening at dusk, lit the great lamp and wrote the "
    "state of the sea in a leather book that nobody else ever read.",
    "When the ferry stopped running in winter, the island's children learned their lessons by radio, "
    "and the teacher on the mainland read their answers aloud on Friday afternoons.",
    "A good loaf needs only flour, water, salt and time; the baker's skill lies in knowing when the "
    "dough has risen enough and when the oven is hot enough to take it.",
]
SMALL = ("--context-size", "32", "--batch-prompts", "2", "--batches", "1")  # 64 tokens: a CPU-sized run
SAE_NAME = "smollm2-135m-instruct-l16"
# Both runs do the same float32 operations in the same order on CPU; a last-bit difference
# (e.g. a reduction's thread split) is the most that may separate them.
SAME_RUN_RTOL = 1e-6


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sae-eval") / "texts.txt"
    path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return path


def _direct_sae_lens_metrics(engine) -> dict:
    """sae-lens' run_evals called directly on the rows the command builds: the BOS token, then
    the texts' tokens end to end, 31 per row."""
    import warnings

    import torch
    from datasets import Dataset
    from sae_lens import SAE
    from sae_lens.evals import EvalConfig, run_evals
    from sae_lens.training.activation_scaler import ActivationScaler
    from sae_lens.training.activations_store import ActivationsStore
    from transformer_lens import HookedTransformer
    from transformer_lens import loading_from_pretrained as tl_loading

    from engine.model.loading import resolve_model_path
    from engine.services.sae import SAE_REGISTRY

    backend = engine.config.backend
    path = resolve_model_path(backend.model_id, backend.model_cache_dir)
    tokenizer = engine.tokenizer
    stream = [t for text in TEXTS for t in tokenizer.encode(text, add_special_tokens=False)]
    rows = [[tokenizer.bos_token_id] + stream[i * 31:(i + 1) * 31] for i in range(2)]
    cfg = tl_loading.get_pretrained_model_config(path, fold_ln=False, device="cpu", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = HookedTransformer(cfg, tokenizer=tokenizer)
    model.load_and_process_state_dict(tl_loading.get_pretrained_state_dict(path, cfg), fold_ln=False,
                                      center_writing_weights=False, center_unembed=False, fold_value_biases=False,
                                      refactor_factored_attn_matrices=False)
    sae = SAE.load_from_disk(SAE_REGISTRY[SAE_NAME].path, dtype="float32")
    store = ActivationsStore.from_sae(model.eval(), sae, dataset=Dataset.from_dict({"input_ids": rows}),
                                      context_size=32, streaming=False, store_batch_size_prompts=2, device="cpu")
    config = EvalConfig(batch_size_prompts=2, n_eval_reconstruction_batches=1, n_eval_sparsity_variance_batches=1,
                        compute_kl=True, compute_ce_loss=True, compute_sparsity_metrics=True,
                        compute_variance_metrics=True, compute_featurewise_density_statistics=True)
    metrics, _ = run_evals(sae, store, model, ActivationScaler(), config)
    return metrics


def test_sae_eval_prints_and_writes_sae_lens_own_figures(capsys, engine, texts_file, tmp_path):
    out = tmp_path / "eval.json"
    code, stdout, err = run(capsys, "sae-eval", "--sae", SAE_NAME, "--texts-file", str(texts_file), "--kind", "raw",
                            *SMALL, "--out", str(out))
    assert code == 0, err
    report = json.loads(out.read_text(encoding="utf-8"))
    figures = report["figures"]
    assert report["hook_name"] == "blocks.16.hook_resid_post" and figures["rows"] == 2 and figures["tokens"] == 64
    for label in ("CE-loss score", "KL score", "explained variance", "L0", "dead fraction", "dense fraction"):
        assert label in stdout, f"the table lacks {label}:\n{stdout}"
    assert f"{figures['explained_variance']:.4f}" in stdout

    direct = _direct_sae_lens_metrics(engine)
    pairs = {
        "ce_loss_score": direct["model_performance_preservation"]["ce_loss_score"],
        "ce_loss_with_sae": direct["model_performance_preservation"]["ce_loss_with_sae"],
        "ce_loss_without_sae": direct["model_performance_preservation"]["ce_loss_without_sae"],
        "kl_div_score": direct["model_behavior_preservation"]["kl_div_score"],
        "explained_variance": direct["reconstruction_quality"]["explained_variance"],
        "l0": direct["sparsity"]["l0"],
    }
    for key, expected in pairs.items():
        assert math.isclose(figures[key], expected, rel_tol=SAME_RUN_RTOL), (key, figures[key], expected)
    assert report["sae_lens_metrics"]["sparsity"]["l0"] == pytest.approx(direct["sparsity"]["l0"], rel=SAME_RUN_RTOL)
    # what the figures mean, on ordinary prose: the SAE keeps most of the loss, is sparse, and
    # splicing it in is far better than zeroing the residual stream (positive control: the
    # ablation's loss is much higher than the original's)
    assert figures["ce_loss_with_ablation"] > 1.5 * figures["ce_loss_without_sae"]
    # the score is (ablation - with SAE) / (ablation - without): above 1 when the reconstruction
    # happens to lower the loss, as it can on these 64 tokens
    score = (figures["ce_loss_with_ablation"] - figures["ce_loss_with_sae"]) / \
        (figures["ce_loss_with_ablation"] - figures["ce_loss_without_sae"])
    assert math.isclose(figures["ce_loss_score"], score, rel_tol=1e-4), (figures["ce_loss_score"], score)
    assert 0.5 < figures["ce_loss_score"] < 1.1 and 0.0 < figures["l0"] <= 64
    assert 0.0 <= figures["dead_fraction"] < 1.0 and 0.0 <= figures["dense_fraction"] < 1.0


@pytest.mark.parametrize("argv,message", [
    (("--texts-file", "missing.txt"), "`--texts-file` must be an existing file"),
    (("--batches", "0"), "`batches` must be an int >= 1, got 0"),
    (("--context-size", "1"), "`context_size` must be an int >= 2, got 1"),
    (("--sae", "no-such-sae"), "`sae_id` must be one of"),
    (("--context-size", "512", "--batches", "8"), "the texts must give at least"),
])
def test_user_mistakes_exit_2_with_one_line_and_no_traceback(capsys, texts_file, tmp_path, argv, message):
    defaults = {"--texts-file": str(texts_file), "--out": str(tmp_path / "eval.json")}
    given = dict(zip(argv[::2], argv[1::2]))
    merged = {**defaults, **given}
    code, stdout, err = run(capsys, "sae-eval", *[part for pair in merged.items() for part in pair])
    assert code == 2, (stdout, err)
    assert message in err and "Traceback" not in err, err
    assert err.strip().count("\n") == 0, f"one line expected, got:\n{err}"
    assert not (tmp_path / "eval.json").exists()


def test_out_must_be_a_json_file(capsys, texts_file, tmp_path):
    code, _, err = run(capsys, "sae-eval", "--texts-file", str(texts_file), "--out", str(tmp_path / "eval.txt"))
    assert code == 2 and "`--out` must be a .json file" in err and "Traceback" not in err


def test_a_row_whose_first_word_is_an_attention_sink_is_left_out(engine):
    """After the opening BOS, " graphical" becomes a second attention sink (norm ~100x the median
    at layer 16: the model decides that from positions 0-1 alone). Its row is left out and the
    next one evaluated: the figures equal those of the ordinary rows alone."""
    from sae_lens import SAE

    from engine.model.loading import resolve_model_path
    from engine.services.sae import SAE_REGISTRY
    from engine.services.sae_eval import SAEEvalSettings, hooked_transformer, run_sae_lens_evals, sink_rows

    backend = engine.config.backend
    tokenizer = engine.tokenizer
    model = hooked_transformer(resolve_model_path(backend.model_id, backend.model_cache_dir), tokenizer)
    sae = SAE.load_from_disk(SAE_REGISTRY[SAE_NAME].path, dtype="float32")
    settings = SAEEvalSettings(context_size=32, batch_prompts=2, batches=1)
    stream = [t for text in TEXTS for t in tokenizer.encode(text, add_special_tokens=False)]
    sink = [tokenizer.bos_token_id] + tokenizer.encode(
        " graphical interface, the window manager draws every frame of every window, and the toolkit lays out "
        "the widgets inside each of them before the compositor puts the frames together", add_special_tokens=False)
    ordinary = [[tokenizer.bos_token_id] + stream[i * 31:(i + 1) * 31] for i in range(2)]
    rows = [sink[:32]] + ordinary
    assert len(rows[0]) == 32
    assert sink_rows(model, sae.cfg.metadata.hook_name, rows, settings) == [True, False, False]
    left, _, _ = run_sae_lens_evals(sae, model, rows, settings, text="raw")
    alone, _, _ = run_sae_lens_evals(sae, model, ordinary, settings, text="raw")
    assert left.rows_left_out == 1 and alone.rows_left_out == 0
    assert left.explained_variance == alone.explained_variance and left.ce_loss_score == alone.ce_loss_score
    # positive control: evaluated with the sink's row, the figures would differ
    with_sink, _, _ = run_sae_lens_evals(sae, model, rows, SAEEvalSettings(context_size=32, batch_prompts=2,
                                                                         batches=1, sink_ratio=1e9), text="raw")
    assert with_sink.rows_left_out == 0 and with_sink.explained_variance != alone.explained_variance
