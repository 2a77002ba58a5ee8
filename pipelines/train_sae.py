"""Train an SAE for the embedded model's residual stream with sae-lens — seeded, reproducible.

    python -m pipelines.train_sae [--tokens 1000000] [--out DIR]      (also: raylens train-sae)

Corpus: the reStructuredText sources of the Python 3.11 documentation, as Debian's
``python3.11-doc`` package installs them (``/usr/share/doc/python3.11/html/_sources``; PSF
licence; ``apt-get install python3.11-doc``). Half of the chunks are wrapped in the model's chat
template as an assistant answer, so features also cover the template tokens and the assistant
turn. ``--corpus cpython`` uses only text that ships with CPython itself (the Language
Reference topics in ``pydoc_data``; also PSF) — smaller, for smoke tests.

Collection runs only layers ``0..layer`` of the model (:func:`engine.model.capture.residual_stream`),
in batches, without grad. Position 0 of every sequence is left out: its residual norm is ~100×
the others (an attention sink) and would dominate the reconstruction loss.

Training uses sae-lens' ``TopKTrainingSAE`` and ``SAETrainer`` (with its progress bar), fed by an
iterator over shuffled activations; held-out activations give the reported explained variance,
L0 and dead-feature fraction, measured on the SAE *as saved* (float16 weights, loaded as float32).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

__all__ = ["TrainConfig", "build_sequences", "collect_activations", "train", "evaluate", "main"]

DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "engine" / "assets" / "saes" / "smollm2-135m-instruct-l16"
_QUESTIONS = ("Explain this part of the Python documentation.", "What does the documentation say here?",
              "Summarise this section for me.", "Can you show me the relevant docs?")


@dataclass(frozen=True)
class TrainConfig:
    tokens: int = 1_000_000  # activations collected (position 0 excluded)
    epochs: int = 4
    layer: int = 16
    width: int = 1536  # wider SAEs left most features dead on this corpus (see the README)
    k: int = 48
    seq_len: int = 256
    collect_batch: int = 8
    train_batch: int = 4096
    lr: float = 4e-4
    holdout: float = 0.05
    seed: int = 0
    corpus: str = "python-docs"
    dead_window: int = 10  # steps without firing before AuxK loss revives a feature; 0: a tenth of the steps
    aux_coefficient: float = 2.0
    save_dtype: str = "float16"  # keeps the committed SAE under 15 MB


# -------------------------------------------------------------------------------------- corpus


def _corpus_texts(corpus: str) -> list[str]:
    if corpus == "cpython":
        from pydoc_data.topics import topics

        return [topics[key] for key in sorted(topics)]
    if corpus != "python-docs":
        raise SystemExit(f"--corpus must be python-docs or cpython, got {corpus!r}")
    if not DOCS_DIR.is_dir():
        raise SystemExit(f"{DOCS_DIR} is missing: `apt-get install python3.11-doc`, or use --corpus cpython")
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(DOCS_DIR.rglob("*.rst.txt"))]


def _chunks(text: str, size: int = 1200) -> Iterator[str]:
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip() and set(p.strip()) - set("=-~*^#")]
    current = ""
    for paragraph in paragraphs:
        if current and len(current) + len(paragraph) > size:
            yield current
            current = ""
        current = f"{current}\n\n{paragraph}" if current else paragraph
    if current:
        yield current


def build_sequences(tokenizer: Any, cfg: TrainConfig, n_sequences: int) -> list[list[int]]:
    """Deterministic (seeded) token sequences of ``seq_len``: corpus chunks, half chat-formatted."""
    rng = random.Random(cfg.seed)
    chunks = [c for text in _corpus_texts(cfg.corpus) for c in _chunks(text)]
    rng.shuffle(chunks)
    stream: list[int] = []
    sequences: list[list[int]] = []
    for chunk in chunks:
        if rng.random() < 0.5:
            messages = [{"role": "user", "content": rng.choice(_QUESTIONS)}, {"role": "assistant", "content": chunk}]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        else:
            text = chunk + "\n\n"
        stream.extend(tokenizer.encode(text, add_special_tokens=False))
        while len(stream) >= cfg.seq_len:
            sequences.append(stream[: cfg.seq_len])
            del stream[: cfg.seq_len]
            if len(sequences) == n_sequences:
                return sequences
    if len(sequences) < n_sequences:
        print(f"train_sae: the corpus gives {len(sequences)} sequences, fewer than {n_sequences}; using all",
              file=sys.stderr)
    return sequences


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


def feature_examples(sae: Any, acts: Any, token_ids: list[int], tokenizer: Any, seq_len: int,
                     features: int = 6, top: int = 5) -> list[dict[str, Any]]:
    """The held-out tokens that activate a few of the most frequent features most strongly."""
    import torch

    with torch.no_grad():
        feats = torch.cat([sae.encode(acts[i:i + 4096]) for i in range(0, acts.shape[0], 4096)])
    frequency = (feats > 0).float().mean(dim=0)
    chosen = torch.argsort(frequency, descending=True)[5:5 + features * 20:20]  # spread over common ones
    width = seq_len - 1
    examples = []
    for feature in chosen.tolist():
        column = feats[:, feature]
        best = torch.topk(column, top).indices.tolist()
        tokens = []
        for index in best:
            seq, pos = divmod(index, width)
            base = seq * seq_len
            window = token_ids[base + max(1, pos - 5):base + pos + 2]  # a little context, the token last
            tokens.append({"token": tokenizer.decode([token_ids[base + pos + 1]]),
                           "context": tokenizer.decode(window), "activation": round(float(column[index]), 3)})
        examples.append({"feature": feature, "frequency": round(float(frequency[feature]), 4), "top": tokens})
    return examples


# ------------------------------------------------------------------------------------------ cli


def _parse(argv: list[str] | None) -> tuple[TrainConfig, argparse.Namespace]:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(prog="raylens train-sae", description=__doc__.splitlines()[0])
    for name in ("tokens", "epochs", "layer", "width", "k", "seq_len", "seed", "train_batch", "dead_window"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--aux-coefficient", type=float, default=defaults.aux_coefficient)
    p.add_argument("--corpus", choices=["python-docs", "cpython"], default=defaults.corpus)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--activations-cache", type=Path, help="save/reuse collected activations (.pt)")
    p.add_argument("--config", help="raylens config naming the model (default configs/local.yaml)")
    args = p.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in ("tokens", "epochs", "layer", "width", "k", "seq_len", "seed",
                                                         "train_batch", "lr", "corpus", "dead_window",
                                                         "aux_coefficient")})
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    import torch
    from sae_lens import SAE

    from engine.config import load_config
    from engine.model.loading import load_model_and_tokenizer

    cfg, args = _parse(argv)
    started = time.perf_counter()
    backend_cfg = load_config(args.config).backend
    model, tokenizer = load_model_and_tokenizer(backend_cfg.model_id, cache_dir=backend_cfg.model_cache_dir,
                                                device="cpu", dtype=torch.float32, attn_implementation="sdpa",
                                                hf_token=backend_cfg.hf_token)
    n_sequences = -(-cfg.tokens // (cfg.seq_len - 1))
    sequences = build_sequences(tokenizer, cfg, n_sequences)
    if args.activations_cache and args.activations_cache.is_file():
        acts = torch.load(args.activations_cache)
    else:
        acts = collect_activations(model, sequences, cfg)
        if args.activations_cache:
            torch.save(acts, args.activations_cache)
    hold_sequences = max(4, round(len(sequences) * cfg.holdout))  # activations are sequence-major
    n_hold = hold_sequences * (cfg.seq_len - 1)
    train_acts, held_acts = acts[:-n_hold], acts[-n_hold:]
    trained = train(train_acts, cfg, model_name=backend_cfg.model_id)

    args.out.mkdir(parents=True, exist_ok=True)
    trained.to(dtype=getattr(torch, cfg.save_dtype))
    trained.cfg.dtype = cfg.save_dtype
    trained.save_inference_model(args.out)
    saved = SAE.load_from_disk(args.out, dtype="float32")  # measure what ships
    report = evaluate(saved, held_acts)
    held_tokens = [t for s in sequences[-hold_sequences:] for t in s]
    examples = feature_examples(saved, held_acts, held_tokens, tokenizer, cfg.seq_len)
    summary = {
        "model": backend_cfg.model_id,
        "hook_name": f"blocks.{cfg.layer}.hook_resid_post",
        "corpus": {"python-docs": "Python 3.11 documentation sources (Debian python3.11-doc, PSF licence), "
                                  "half chat-formatted",
                   "cpython": "pydoc_data Language Reference topics (ships with CPython, PSF licence)"}[cfg.corpus],
        "train_tokens": int(train_acts.shape[0]),
        "training_samples": cfg.epochs * (train_acts.shape[0] // cfg.train_batch) * cfg.train_batch,
        "config": asdict(cfg),
        "heldout": asdict(report),
        "size_bytes": sum(p.stat().st_size for p in args.out.iterdir() if p.is_file()),
        "wall_s": round(time.perf_counter() - started, 1),
        "feature_examples": examples,
    }
    (args.out / "training_report.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    print(json.dumps({k: summary[k] for k in ("train_tokens", "heldout", "size_bytes", "wall_s")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
