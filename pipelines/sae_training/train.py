"""Train an SAE for the embedded model's residual stream with sae-lens — seeded, reproducible.

    python -m pipelines.sae_training.train [--tokens 1000000] [--out DIR]      (also: raylens train-sae)

Corpus (``--corpus broad-manuals``, the default): :mod:`pipelines.sae_training.corpus` — ordinary
English prose (fiction, encyclopaedic entries, news-like clippings, instructions, the GNU manuals of
common tools), conversations in the model's chat template, and code/documentation (the Python docs,
the standard library, man pages), all from Debian packages fetched by name into
``artifacts/sae-corpus`` (git-ignored). Users prompt the embedded model with ordinary chat; an SAE
fitted to one technical corpus reconstructs that poorly. ``--corpus broad`` is the same without the
manuals (the previous SAE's corpus). ``--corpus cpython`` uses only text that ships with CPython
itself (the Language Reference topics in ``pydoc_data``; PSF) — tiny, for smoke tests.

Collection runs only layers ``0..layer`` of the model (:func:`engine.model.capture.residual_stream`),
in batches, without grad. Position 0 of every sequence is left out: its residual norm is ~100×
the others (an attention sink) and would dominate the reconstruction loss.

Training uses sae-lens' ``TopKTrainingSAE`` and ``SAETrainer`` (with its progress bar), fed by an
iterator over shuffled activations. The last sequences of every kind of text are held out; they
give the reported explained variance, L0 and dead-feature fraction, overall and per kind, measured
on the SAE *as saved* (float16 weights, loaded as float32). The report also records the corpus
mix, every source's package, version and licence, and the weights file's size and SHA-256.

The report also carries sae-lens' own evaluation (``sae_lens.evals.run_evals``, through
:mod:`engine.services.sae_eval`) of the saved SAE on each kind's held-out sequences: CE-loss and KL
scores with the reconstruction spliced into the forward pass, explained variance, L0, and dead and
dense fractions, the figures SAE users compare (``raylens sae-eval`` computes them for any texts).
The same figures on text from outside the corpus (:mod:`pipelines.sae_training.heldout_evals`: the
GNU Coding Standards as raw paragraphs, the GNU Maintainer Information as chat turns) go under
``sae_lens_heldout``, so one run writes the whole report the committed-SAE test checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterator

from pipelines.sae_training import COMMITTED_SAE_DIR
from pipelines.sae_training.corpus import CORPORA, DEFAULT_CACHE, DEFAULT_CORPUS
from pipelines.sae_training.heldout_evals import BATCHES as OUTSIDE_EVAL_BATCHES

__all__ = ["TrainConfig", "arguments", "config_from", "collect_activations", "train", "evaluate", "sae_lens_evals",
           "run", "main"]

DEFAULT_OUT = COMMITTED_SAE_DIR


@dataclass(frozen=True)
class TrainConfig:
    # the committed SAE's settings: ~20 min of collection and ~100 min of training on 2 CPU cores
    tokens: int = 1_000_000  # activations collected (position 0 excluded); collection is the cost on CPU
    epochs: int = 7
    layer: int = 16
    width: int = 8192
    k: int = 64
    seq_len: int = 256
    collect_batch: int = 16
    train_batch: int = 4096
    lr: float = 6e-4
    holdout: float = 0.12  # of every kind: enough held-out tokens (>5k) for the smallest kind, code
    seed: int = 0
    corpus: str = DEFAULT_CORPUS
    dead_window: int = 10  # steps without firing before AuxK loss revives a feature; 0: a tenth of the steps
    aux_coefficient: float = 2.0
    sink_ratio: float = 10.0  # rows with a norm above this × the median are attention sinks: left out
    code_repeat: int = 2  # code activations appear this many times per training epoch (the smallest kind)
    save_dtype: str = "float16"  # halves the committed SAE (~19 MB)
    # sae-lens' run_evals on each kind's held-out sequences: eval_batches x eval_batch_prompts rows
    eval_context_size: int = 128
    eval_batch_prompts: int = 4
    eval_batches: int = 16
    # ... and on the texts from outside the corpus, which are longer: more tokens than features
    outside_eval_batches: int = OUTSIDE_EVAL_BATCHES


# ---------------------------------------------------------------------------------- collection


def collect_activations(model: Any, sequences: list[list[int]], cfg: TrainConfig):
    """``(n, d)`` float32 activations after ``cfg.layer`` and their ``(sequence, position)`` ids."""
    import torch
    from tqdm.auto import tqdm

    from engine.model.capture import residual_stream

    chunks = []
    for start in tqdm(range(0, len(sequences), cfg.collect_batch), desc="Collecting activations", unit="batch"):
        ids = torch.tensor(sequences[start:start + cfg.collect_batch])
        with torch.inference_mode():
            hidden = residual_stream(model, ids, cfg.layer)[:, 1:, :]  # drop position 0 (attention sink)
        chunks.append(hidden.reshape(-1, hidden.shape[-1]).clone())
    return torch.cat(chunks)


# ------------------------------------------------------------------------------------ training


def _batches(acts: Any, batch: int, seed: int) -> Iterator[Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    while True:  # epochs; the trainer decides when to stop
        order = torch.randperm(acts.shape[0], generator=generator)
        for start in range(0, acts.shape[0] - batch + 1, batch):
            yield acts[order[start:start + batch]]


def train(acts: Any, cfg: TrainConfig, *, model_name: str) -> Any:
    import torch
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.saes.sae import SAEMetadata

    torch.manual_seed(cfg.seed)  # sae-lens initialises weights from the global RNG; this is a script
    sae_cfg = TopKTrainingSAEConfig(
        d_in=acts.shape[1], d_sae=cfg.width, k=cfg.k, dtype="float32", device="cpu",
        normalize_activations="expected_average_only_in", aux_loss_coefficient=cfg.aux_coefficient,
        metadata=SAEMetadata(model_name=model_name, hook_name=f"blocks.{cfg.layer}.hook_resid_post",
                             context_size=cfg.seq_len, prepend_bos=False, seqpos_slice=(1, None)),
    )
    total = cfg.epochs * (acts.shape[0] // cfg.train_batch) * cfg.train_batch
    steps = total // cfg.train_batch
    trainer_cfg = SAETrainerConfig(
        total_training_samples=total, train_batch_size_samples=cfg.train_batch, lr=cfg.lr, lr_end=cfg.lr / 10,
        lr_warm_up_steps=max(1, steps // 20), lr_decay_steps=steps // 5, device="cpu",
        dead_feature_window=cfg.dead_window or max(10, steps // 10), feature_sampling_window=max(10, steps // 5),
        n_batches_for_norm_estimate=min(50, max(1, acts.shape[0] // cfg.train_batch)),
    )
    sae = TopKTrainingSAE(sae_cfg)
    return SAETrainer(trainer_cfg, sae, _batches(acts, cfg.train_batch, cfg.seed)).fit()


@dataclass(frozen=True)
class SAEReport:
    explained_variance: float
    l0: float
    dead_fraction: float
    heldout_tokens: int


def evaluate(sae: Any, acts: Any, batch: int = 4096) -> SAEReport:
    """Explained variance, mean L0 and never-active fraction on ``acts`` (held out)."""
    import torch

    mean = acts.mean(dim=0)
    sse = sst = 0.0
    l0 = 0.0
    fired = torch.zeros(sae.cfg.d_sae, dtype=torch.bool)
    with torch.no_grad():
        for start in range(0, acts.shape[0], batch):
            x = acts[start:start + batch]
            feats = sae.encode(x)
            recon = sae.decode(feats)
            sse += float(((x - recon) ** 2).sum())
            sst += float(((x - mean) ** 2).sum())
            active = feats > 0
            l0 += float(active.sum())
            fired |= active.any(dim=0)
    return SAEReport(1.0 - sse / sst, l0 / acts.shape[0], float((~fired).float().mean()), int(acts.shape[0]))


def sae_lens_evals(sae: Any, model_path: str, tokenizer: Any, held_out: dict[str, list[list[int]]],
                   settings: Any = None) -> dict[str, Any]:
    """sae-lens' ``run_evals`` figures of ``sae`` on each kind's held-out sequences (a kind with
    too few tokens for the settings is reported as skipped, with the reason)."""
    from engine.errors import InvalidRequestError
    from engine.services.sae_eval import (SAEEvalSettings, hooked_transformer, rows_from_sequences, run_sae_lens_evals,
                                          separator_id)

    settings = settings or SAEEvalSettings()
    model = hooked_transformer(model_path, tokenizer)
    by_kind: dict[str, Any] = {}
    for kind, sequences in held_out.items():
        try:
            rows = rows_from_sequences(sequences, settings, separator_id(tokenizer))
            by_kind[kind] = run_sae_lens_evals(sae, model, rows, settings, text=kind)[0].as_dict()
        except InvalidRequestError as err:  # too little text, or too few rows without an attention sink
            by_kind[kind] = {"skipped": str(err)}
    return {"settings": asdict(settings), "by_kind": by_kind}


def feature_examples(sae: Any, acts: Any, where: list[tuple[int, int]], sequences: list[list[int]], tokenizer: Any,
                     features: int = 6, top: int = 5) -> list[dict[str, Any]]:
    """The held-out tokens that activate a few of the most frequent features most strongly;
    ``where[row]`` is the (sequence, position) of activation row ``row``."""
    import torch

    with torch.no_grad():
        feats = torch.cat([sae.encode(acts[i:i + 4096]) for i in range(0, acts.shape[0], 4096)])
    frequency = (feats > 0).float().mean(dim=0)
    chosen = torch.argsort(frequency, descending=True)[5:5 + features * 20:20]  # spread over common ones
    examples = []
    for feature in chosen.tolist():
        column = feats[:, feature]
        best = torch.topk(column, top).indices.tolist()
        tokens = []
        for index in best:
            seq, pos = where[index]
            window = sequences[seq][max(1, pos - 6):pos + 1]  # a little context, the token last
            tokens.append({"token": tokenizer.decode([sequences[seq][pos]]),
                           "context": tokenizer.decode(window), "activation": round(float(column[index]), 3)})
        examples.append({"feature": feature, "frequency": round(float(frequency[feature]), 4), "top": tokens})
    return examples


# ------------------------------------------------------------------------------------------ cli


def arguments() -> argparse.ArgumentParser:
    """The training options as a parent parser: ``python -m pipelines.sae_training.train`` and
    ``raylens train-sae`` take the same ones."""
    defaults = TrainConfig()
    p = argparse.ArgumentParser(add_help=False)
    for name in ("tokens", "epochs", "layer", "width", "k", "seq_len", "seed", "train_batch", "dead_window",
                 "code_repeat", "eval_context_size", "eval_batch_prompts", "eval_batches", "outside_eval_batches"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--holdout", type=float, default=defaults.holdout, help="held-out share of every kind of text")
    p.add_argument("--aux-coefficient", type=float, default=defaults.aux_coefficient)
    p.add_argument("--sink-ratio", type=float, default=defaults.sink_ratio)
    p.add_argument("--corpus", choices=list(CORPORA), default=defaults.corpus,
                   help="broad-manuals: the committed SAE's corpus; broad: the same without the GNU manuals")
    p.add_argument("--corpus-cache", type=Path, default=DEFAULT_CACHE,
                   help="where the corpus packages are downloaded and unpacked (git-ignored)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--activations-cache", type=Path, help="save/reuse collected activations (.pt)")
    p.add_argument("--config", help="raylens config naming the model (default configs/local.yaml)")
    return p


def config_from(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the parsed options name (fields without an option keep their defaults)."""
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})


def _parse(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="raylens train-sae", description=__doc__.splitlines()[0], parents=[arguments()])
    args = p.parse_args(argv)
    return config_from(args), args


def _holdout(kinds: list[str], fraction: float) -> list[bool]:
    """Per sequence: held out? The last ``fraction`` of every kind's sequences (at least 2 each)."""
    held = [False] * len(kinds)
    for kind in dict.fromkeys(kinds):
        indices = [i for i, k in enumerate(kinds) if k == kind]
        for i in indices[len(indices) - max(2, round(len(indices) * fraction)):]:
            held[i] = True
    return held


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    cfg, args = _parse(argv)
    return run(cfg, args)


def run(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """Collect, train, save and report (``args``: the paths and config the options name)."""
    import torch
    from sae_lens import SAE

    from engine.config import load_config
    from engine.model.loading import load_model_and_tokenizer, resolve_model_path
    from engine.services.sae_eval import SAEEvalSettings
    from pipelines.sae_training.corpus import build_corpus
    from pipelines.sae_training.heldout_evals import evaluate as outside_corpus_evals

    started = time.perf_counter()
    backend_cfg = load_config(args.config).backend
    model, tokenizer = load_model_and_tokenizer(backend_cfg.model_id, cache_dir=backend_cfg.model_cache_dir,
                                                device="cpu", dtype=torch.float32, attn_implementation="sdpa",
                                                hf_token=backend_cfg.hf_token)
    n_sequences = -(-cfg.tokens // (cfg.seq_len - 1))
    corpus = build_corpus(tokenizer, n_sequences, cfg.seq_len, seed=cfg.seed, corpus=cfg.corpus,
                          cache=args.corpus_cache)
    sequences, kinds = corpus.sequences, corpus.kinds
    fingerprint = hashlib.sha256(json.dumps(sequences).encode()).hexdigest()
    cached = torch.load(args.activations_cache) if args.activations_cache and args.activations_cache.is_file() \
        else None
    if cached is not None and cached.get("corpus_sha256") == fingerprint and cached.get("layer") == cfg.layer:
        acts = cached["acts"]
    else:
        acts = collect_activations(model, sequences, cfg)
        if args.activations_cache:
            torch.save({"acts": acts, "corpus_sha256": fingerprint, "layer": cfg.layer}, args.activations_cache)
    per_seq = cfg.seq_len - 1  # activations are sequence-major, position 0 left out
    held = _holdout(kinds, cfg.holdout)
    row_held = torch.tensor(held).repeat_interleave(per_seq)
    kind_ids = {kind: i for i, kind in enumerate(dict.fromkeys(kinds))}
    row_kind = torch.tensor([kind_ids[k] for k in kinds]).repeat_interleave(per_seq)
    # A few rows (a sequence that starts mid-text makes position 1 an attention sink) have norms
    # ~100x the median; they would dominate the MSE and the input-norm estimate. Left out.
    norms = acts.norm(dim=1)
    sink = norms > cfg.sink_ratio * norms.median()
    code = row_kind == kind_ids.get("code", -1)
    train_rows = ~row_held & ~sink
    train_acts = torch.cat([acts[train_rows]] + [acts[train_rows & code]] * (cfg.code_repeat - 1))
    held_rows = torch.nonzero(row_held & ~sink).flatten()
    held_acts, held_row_kind = acts[held_rows], row_kind[held_rows]
    trained = train(train_acts, cfg, model_name=backend_cfg.model_id)

    args.out.mkdir(parents=True, exist_ok=True)
    trained.to(dtype=getattr(torch, cfg.save_dtype))
    trained.cfg.dtype = cfg.save_dtype
    trained.save_inference_model(args.out)
    saved = SAE.load_from_disk(args.out, dtype="float32")  # measure what ships
    report = evaluate(saved, held_acts)
    by_kind = {}
    for kind, kind_id in kind_ids.items():
        by_kind[kind] = asdict(evaluate(saved, held_acts[held_row_kind == kind_id]))
    where = [divmod(int(row), per_seq) for row in held_rows]
    examples = feature_examples(saved, held_acts, [(seq, pos + 1) for seq, pos in where], sequences, tokenizer)
    held_sequences = {kind: [seq for seq, k, h in zip(sequences, kinds, held) if h and k == kind] for kind in kind_ids}
    eval_settings = SAEEvalSettings(context_size=cfg.eval_context_size, batch_prompts=cfg.eval_batch_prompts,
                                    batches=cfg.eval_batches)
    evals = sae_lens_evals(saved, resolve_model_path(backend_cfg.model_id, backend_cfg.model_cache_dir), tokenizer,
                           held_sequences, eval_settings)
    outside = outside_corpus_evals(args.out, args.corpus_cache, replace(eval_settings, batches=cfg.outside_eval_batches),
                                   args.config)
    weights = args.out / "sae_weights.safetensors"
    summary = {
        "model": backend_cfg.model_id,
        "hook_name": f"blocks.{cfg.layer}.hook_resid_post",
        "corpus": corpus.manifest(),
        "corpus_sha256": fingerprint,
        "train_tokens": int(train_rows.sum()),
        "train_rows_per_epoch": int(train_acts.shape[0]),
        "attention_sink_rows_left_out": {"train": int((sink & ~row_held).sum()), "heldout": int((sink & row_held).sum())},
        "training_samples": cfg.epochs * (train_acts.shape[0] // cfg.train_batch) * cfg.train_batch,
        "config": asdict(cfg),
        "goals": {"explained_variance_min": 0.85, "l0_max": 64, "dead_fraction_max": 0.05},
        "heldout": asdict(report),
        "heldout_by_kind": by_kind,
        "sae_lens_evals": evals,
        "sae_lens_heldout": outside,
        "weights": {"file": weights.name, "size_bytes": weights.stat().st_size, "sha256": _sha256(weights)},
        "size_bytes": sum(p.stat().st_size for p in args.out.iterdir()
                          if p.is_file() and p.name != "training_report.json"),
        "wall_s": round(time.perf_counter() - started, 1),
        "feature_examples": examples,
    }
    (args.out / "training_report.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print(json.dumps({k: summary[k] for k in ("train_tokens", "heldout", "heldout_by_kind", "size_bytes", "wall_s")},
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
