"""``raylens sae-eval``: sae-lens' own evaluation of an SAE on the configured model, for any texts.

Runs ``sae_lens.evals.run_evals`` (:mod:`engine.services.sae_eval`) and prints the figures SAE
users compare — CE-loss score, KL score, explained variance, L0, dead and dense features — as a
table, and writes them with sae-lens' own metrics to a JSON file. Every argument is checked, and
the texts are read and tokenised, before the model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .arguments import UsageError

__all__ = ["add_commands", "format_table"]

DEFAULT_SAE = "smollm2-135m-instruct-l16"
_ROWS = (("CE-loss score", "ce_loss_score"), ("KL score", "kl_div_score"),
         ("explained variance", "explained_variance"), ("L0", "l0"), ("dead fraction", "dead_fraction"),
         ("dense fraction", "dense_fraction"), ("CE loss, original", "ce_loss_without_sae"),
         ("CE loss, SAE spliced in", "ce_loss_with_sae"), ("CE loss, hook zeroed", "ce_loss_with_ablation"),
         ("KL, SAE spliced in", "kl_div_with_sae"), ("tokens per pass", "tokens"),
         ("rows left out (attention sink)", "rows_left_out"))


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sae-eval", help="sae-lens' run_evals for an SAE on texts (CE-loss/KL score, EV, L0, dead)",
                       description=__doc__.splitlines()[0])
    p.add_argument("--sae", default=DEFAULT_SAE, help=f"registered SAE name or SAE directory (default {DEFAULT_SAE})")
    p.add_argument("--texts-file", required=True, help="one text per line, or .jsonl: JSON strings or {text}")
    p.add_argument("--kind", choices=("raw", "chat"), default="raw",
                   help="raw text, or each text as a user turn in the model's chat template")
    p.add_argument("--context-size", type=int, default=128, help="tokens per row, the opening BOS included")
    p.add_argument("--batch-prompts", type=int, default=4, help="rows per forward pass")
    p.add_argument("--batches", type=int, default=16,
                   help="batches per metric pass (rows = batches x batch-prompts; default 16: ~8k tokens)")
    p.add_argument("--out", required=True, help="JSON file for the figures and sae-lens' own metrics")
    p.add_argument("--config", help="YAML config naming the model (default: configs/local.yaml or $RAYLENS_CONFIG)")
    p.set_defaults(func=_cmd_sae_eval)


def _check_out(path: str) -> Path:
    out = Path(path)
    if out.suffix != ".json":
        raise UsageError(f"`--out` must be a .json file, got `{path}`")
    if out.exists() and out.is_dir():
        raise UsageError(f"`--out` must be a file, got the directory `{path}`")
    if not out.parent.is_dir():
        raise UsageError(f"`--out` must be in an existing directory, got `{path}` (create {out.parent} first)")
    return out


def format_table(figures: Any, sae: str) -> str:
    """One line per figure, aligned: what the terminal shows."""
    values = figures.as_dict()
    width = max(len(label) for label, _ in _ROWS)
    lines = [f"sae-lens run_evals: {sae} on {values['text']} text ({values['rows']} rows)"]
    for label, key in _ROWS:
        value = values[key]
        shown = f"{value:d}" if isinstance(value, int) else f"{value:.4f}"
        lines.append(f"  {label:<{width}}  {shown}")
    return "\n".join(lines)


def _cmd_sae_eval(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from transformers import AutoConfig, AutoTokenizer

    from engine.config import load_config
    from engine.model.families import family_for_architectures
    from engine.model.loading import resolve_model_path
    from engine.services.sae import SAEEncoder, resolve_sae
    from engine.services.sae_eval import SAEEvalSettings, hooked_transformer, rows_from_texts, run_sae_lens_evals
    from pipelines.jobs.embed import read_texts

    settings = SAEEvalSettings(context_size=args.context_size, batch_prompts=args.batch_prompts, batches=args.batches)
    out = _check_out(args.out)
    resolve_sae(args.sae)  # an unknown name or a missing directory stops here
    texts = [line.text for line in read_texts(args.texts_file)]
    backend = load_config(args.config).backend
    path = resolve_model_path(backend.model_id, backend.model_cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = rows_from_texts(tokenizer, texts, args.kind, settings)  # too little text stops here
    print("raylens: loading the SAE and TransformerLens' model…", file=sys.stderr, flush=True)
    config = AutoConfig.from_pretrained(path)
    encoder = SAEEncoder.load(args.sae, layer=None, top_k=1, model_hidden_size=int(config.hidden_size),
                              model_layers=int(config.num_hidden_layers),  # refuses an SAE of another model
                              model_family=family_for_architectures(config.architectures, backend.model_id).name)
    model = hooked_transformer(path, tokenizer)
    figures, metrics, _features = run_sae_lens_evals(encoder.sae, model, rows, settings, text=args.kind)
    print(format_table(figures, args.sae))
    report = {"sae": args.sae, "model": backend.model_id, "hook_name": encoder.identity.hook_name,
              "texts_file": str(args.texts_file), "kind": args.kind, "settings": asdict(settings),
              "figures": figures.as_dict(), "sae_lens_metrics": metrics}
    out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(f"raylens: wrote {out}", file=sys.stderr)
    return 0
