"""sae-lens' evaluation of the committed SAE on text outside its training corpus, into its report.

    python -m pipelines.sae_training.heldout_evals [--sae-dir DIR] [--batches 32]

The training report's held-out figures come from the last sequences of the training corpus's own
sources; users send other text. This measures the SAE with sae-lens' ``run_evals``
(:mod:`engine.services.sae_eval`) on two texts from a Debian package the corpus does not use,
GNU's ``gnu-standards`` (the GNU Coding Standards and the GNU Maintainer Information, FSF,
GFDL-1.3+), fetched by name like the corpus's packages:

``raw``   paragraphs of the Coding Standards as plain text;
``chat``  paragraphs of the Maintainer Information, each a user turn in the model's chat template.

The figures (CE-loss score, KL score, explained variance, L0, dead and dense fractions) go into the
SAE directory's ``training_report.json`` under ``sae_lens_heldout``, with the package, version and
licence; the committed-report test asserts them. A training run writes them itself; this command
measures any SAE directory again. Dead and dense fractions here count features over these
:data:`BATCHES` × 4 rows of 128 tokens (~16k) only (a feature that fires once in 100k tokens looks
dead here); the report's ``heldout.dead_fraction`` is the one over the whole held-out mix.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path
from typing import Any

from pipelines.sae_training import COMMITTED_SAE_DIR
from pipelines.sae_training.corpus import DEFAULT_CACHE
from pipelines.sae_training.debian_packages import fetch_package

__all__ = ["PACKAGE", "LICENCE", "TEXTS", "BATCHES", "paragraphs", "heldout_texts", "evaluate", "main"]

PACKAGE = "gnu-standards"
LICENCE = "GFDL-1.3+ (GNU Coding Standards, GNU Maintainer Information; Free Software Foundation)"
#: kind → the file of the package it reads (plain-text Info output).
TEXTS = {"raw": "usr/share/doc/gnu-standards/standards.text.gz", "chat": "usr/share/doc/gnu-standards/maintain.text.gz"}
MIN_CHARS = 200  # shorter blocks are headings, menus and one-line notes, not paragraphs
#: Batches (of 4 rows of 128 tokens) per text: ~16k tokens, twice the committed SAE's 8192
#: features. "Dead" means "never fired in the sample", so a sample smaller than the width counts
#: rare features dead (over ~8k tokens, 5.9 % of the features on the chat text; over ~16k, 3.3 %).
#: Both texts have more than enough; ``raylens sae-eval`` and training's evals on its own held-out
#: sequences keep the 16-batch default of :class:`engine.services.sae_eval.SAEEvalSettings`.
BATCHES = 32


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of an Info-as-text document, each on one line: blocks between blank
    lines whose lines are indented at most three spaces (deeper: examples and code), with no
    heading underline or menu, of at least :data:`MIN_CHARS` characters."""
    out = []
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if line.strip()]
        if not lines or any(len(line) - len(line.lstrip()) > 3 for line in lines):
            continue
        if any(set(line.strip()) <= set("=-*.") or line.lstrip().startswith("* ") for line in lines):
            continue
        joined = " ".join(line.strip() for line in lines)
        letters = sum(c.isalpha() or c.isspace() for c in joined)
        if len(joined) >= MIN_CHARS and letters >= 0.9 * len(joined):
            out.append(joined)
    return out


def heldout_texts(cache: Path) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """kind → paragraphs, and the source record (package, version, licence, files)."""
    root, version = fetch_package(PACKAGE, cache)
    texts = {kind: paragraphs(gzip.decompress((root / path).read_bytes()).decode("utf-8")) for kind, path in
             TEXTS.items()}
    return texts, {"package": PACKAGE, "version": version, "licence": LICENCE, "files": TEXTS,
                   "paragraphs": {kind: len(found) for kind, found in texts.items()}}


def evaluate(sae_dir: Path, cache: Path, settings: Any, config_path: str | None = None) -> dict[str, Any]:
    """sae-lens' figures of the SAE in ``sae_dir`` on each held-out text."""
    from dataclasses import asdict

    from sae_lens import SAE
    from transformers import AutoTokenizer

    from engine.config import load_config
    from engine.model.loading import resolve_model_path
    from engine.services.sae_eval import hooked_transformer, rows_from_texts, run_sae_lens_evals

    texts, source = heldout_texts(cache)
    backend = load_config(config_path).backend
    path = resolve_model_path(backend.model_id, backend.model_cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = {kind: rows_from_texts(tokenizer, found, kind, settings) for kind, found in texts.items()}
    sae = SAE.load_from_disk(sae_dir, dtype="float32").eval()  # what ships, as the training report measures
    model = hooked_transformer(path, tokenizer)
    by_text = {kind: run_sae_lens_evals(sae, model, kind_rows, settings, text=kind)[0].as_dict()
               for kind, kind_rows in rows.items()}
    return {"source": source, "settings": asdict(settings), "by_text": by_text}


def main(argv: list[str] | None = None) -> int:
    from engine.services.sae_eval import SAEEvalSettings

    defaults = SAEEvalSettings()
    p = argparse.ArgumentParser(prog="python -m pipelines.sae_training.heldout_evals", description=__doc__.splitlines()[0])
    p.add_argument("--sae-dir", type=Path, default=COMMITTED_SAE_DIR,
                   help="SAE directory whose training_report.json to update (default: the committed SAE)")
    p.add_argument("--corpus-cache", type=Path, default=DEFAULT_CACHE, help="where Debian packages are unpacked")
    p.add_argument("--context-size", type=int, default=defaults.context_size)
    p.add_argument("--batch-prompts", type=int, default=defaults.batch_prompts)
    p.add_argument("--batches", type=int, default=BATCHES, help=f"batches per text (default {BATCHES}: ~16k tokens)")
    p.add_argument("--config", help="raylens config naming the model (default configs/local.yaml)")
    args = p.parse_args(argv)
    settings = SAEEvalSettings(context_size=args.context_size, batch_prompts=args.batch_prompts, batches=args.batches)
    report_file = args.sae_dir / "training_report.json"
    report = json.loads(report_file.read_text(encoding="utf-8"))
    report["sae_lens_heldout"] = evaluate(args.sae_dir, args.corpus_cache, settings, args.config)
    report_file.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(json.dumps(report["sae_lens_heldout"]["by_text"], indent=2), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
