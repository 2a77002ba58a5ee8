"""sae-lens' own SAE evaluation (``sae_lens.evals.run_evals``) on the embedded model's activations.

SAE users compare SAEs by the figures sae-lens computes: the CE-loss score and KL score with the
reconstruction spliced into the forward pass (1 = the SAE loses nothing, 0 = as bad as zeroing
the hook), explained variance, L0, and the share of dead and dense features. This module runs
exactly that code rather than a re-implementation, so the numbers are the ones a sae-lens user
would get: ``run_evals`` with sae-lens' ``ActivationsStore`` over an in-memory pre-tokenised
dataset, on TransformerLens' ``HookedTransformer`` of the model built from its converted local
directory with no weight processing (the same tensors as raylens' own capture:
tests/integration/test_transformer_lens_parity.py).

Rows. Texts are tokenised (raw, or as a user turn in the model's chat template), concatenated and
cut into rows of ``context_size`` tokens, each row opening with the tokenizer's BOS (or EOS)
token. sae-lens leaves special tokens out of every metric, so the opening token — where the
attention sink sits, with a residual norm ~100x the others — is left out, as the SAE's training
left position 0 out (its ``seqpos_slice`` is ``(1, None)``).

A row cut from the middle of a text sometimes makes a second sink of its first word (about one
row in thirty here: norm ~25,000 against a median of ~180). Such a token is an artefact of the
cut, not text a user sends, and it would own most of the row set's variance: explained variance
would then measure that one token (higher than the rest: the figure would flatter the SAE).
So, as in the SAE's training, a row holding a non-special token whose norm at the SAE's hook is
over ``sink_ratio`` × the median is left out and the next row taken; the figures say how many
(``rows_left_out``). Exactly ``batches × batch_prompts`` rows are evaluated: sae-lens reads the
reconstruction metrics from them, then wraps around and reads the sparsity and variance metrics
from the same rows.

``import sae_lens`` and ``transformer_lens`` are slow (~15 s cold); both are imported when an
evaluation runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

from engine.errors import InvalidRequestError

__all__ = ["SAEEvalSettings", "SAEEvalFigures", "TEXT_KINDS", "hooked_transformer", "separator_id", "pack_rows",
           "rows_from_texts", "rows_from_sequences", "sink_rows", "activations_store", "eval_config",
           "run_sae_lens_evals", "figures_from"]

TEXT_KINDS = ("raw", "chat")


@dataclass(frozen=True)
class SAEEvalSettings:
    """How much text an evaluation reads: ``batches × batch_prompts`` rows of ``context_size``
    tokens (the opening separator included); 16 × 4 × 128 is ~8k tokens, enough that a feature
    firing once in a few thousand tokens is not counted dead. ``dense_threshold``: a feature active
    on more than this share of tokens counts as dense. ``sink_ratio``: a row with a token this many
    times the median norm is an attention sink's row, left out."""

    context_size: int = 128
    batch_prompts: int = 4
    batches: int = 16
    dense_threshold: float = 0.1
    sink_ratio: float = 10.0

    def __post_init__(self) -> None:
        for name in ("context_size", "batch_prompts", "batches"):
            value = getattr(self, name)
            low = 2 if name == "context_size" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequestError(f"`{name}` must be an int >= {low}, got {value!r}", parameter=name,
                                          value=value)
        if not 0 < self.dense_threshold <= 1:
            raise InvalidRequestError(f"`dense_threshold` must be in (0, 1], got {self.dense_threshold!r}",
                                      parameter="dense_threshold", value=self.dense_threshold)
        if not self.sink_ratio > 1:
            raise InvalidRequestError(f"`sink_ratio` must be > 1, got {self.sink_ratio!r}", parameter="sink_ratio",
                                      value=self.sink_ratio)

    @property
    def rows(self) -> int:
        return self.batches * self.batch_prompts


@dataclass(frozen=True)
class SAEEvalFigures:
    """sae-lens' figures for one SAE on one text. Scores: 1 = reconstruction as good as the
    original activations, 0 = as bad as zero-ablating the hook. ``tokens``: tokens each metric
    pass read (special tokens included; sae-lens leaves them out of every mean)."""

    text: str
    rows: int
    tokens: int
    ce_loss_score: float
    kl_div_score: float
    explained_variance: float
    l0: float
    dead_fraction: float
    dense_fraction: float
    ce_loss_without_sae: float
    ce_loss_with_sae: float
    ce_loss_with_ablation: float
    kl_div_with_sae: float
    kl_div_with_ablation: float
    mse: float
    cossim: float
    rows_left_out: int = 0  # rows skipped for an attention sink (see the module's docstring)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def hooked_transformer(model_path: str, tokenizer: Any) -> Any:
    """TransformerLens' model of the converted local directory ``model_path``, float32 on CPU,
    every weight-processing step off (no folded norms, no centring): its hook tensors are
    raylens' own (tested). Nothing is downloaded."""
    import warnings

    import torch
    from transformer_lens import HookedTransformer
    from transformer_lens import loading_from_pretrained as tl_loading

    cfg = tl_loading.get_pretrained_model_config(model_path, fold_ln=False, device="cpu", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # HookedTransformer is TransformerLens 3's stable API
        model = HookedTransformer(cfg, tokenizer=tokenizer)
    model.load_and_process_state_dict(tl_loading.get_pretrained_state_dict(model_path, cfg), fold_ln=False,
                                      center_writing_weights=False, center_unembed=False, fold_value_biases=False,
                                      refactor_factored_attn_matrices=False)
    return model.eval()


def separator_id(tokenizer: Any) -> int:
    """The token each row opens with: BOS, else EOS (a special token sae-lens leaves out)."""
    for attr in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise InvalidRequestError("the tokenizer must define a BOS or EOS token to open evaluation rows",
                              parameter="tokenizer")


def pack_rows(token_lists: Sequence[Sequence[int]], settings: SAEEvalSettings, separator: int) -> list[list[int]]:
    """Rows of ``context_size`` ids: ``[separator] + the next context_size - 1 ids`` of the texts'
    tokens end to end — ``settings.rows`` of them, and as many again where the text goes on (spares
    for rows left out for an attention sink). Too little text is refused, naming how much is needed."""
    stream = [int(t) for ids in token_lists for t in ids]
    body = settings.context_size - 1
    need = settings.rows * body
    if len(stream) < need:
        raise InvalidRequestError(
            f"the texts must give at least {need} tokens ({settings.rows} rows of {settings.context_size}), got "
            f"{len(stream)}; add text or lower --batches, --batch-prompts or --context-size", parameter="texts",
            value=len(stream))
    count = min(2 * settings.rows, len(stream) // body)
    return [[separator] + stream[i * body:(i + 1) * body] for i in range(count)]


def rows_from_texts(tokenizer: Any, texts: Sequence[str], kind: str, settings: SAEEvalSettings) -> list[list[int]]:
    """Rows of ``texts`` read as ``kind``: ``raw`` (plain text, no special tokens) or ``chat``
    (each text one user turn in the model's chat template, the template's system prompt
    included)."""
    if kind not in TEXT_KINDS:
        raise InvalidRequestError(f"`kind` must be one of {', '.join(TEXT_KINDS)}, got {kind!r}", parameter="kind",
                                  value=kind)
    if kind == "raw":
        token_lists = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    else:
        token_lists = [_chat_ids(tokenizer, text) for text in texts]
    return pack_rows(token_lists, settings, separator_id(tokenizer))


def rows_from_sequences(sequences: Sequence[Sequence[int]], settings: SAEEvalSettings,
                        separator: int) -> list[list[int]]:
    """Rows of already tokenised sequences (e.g. an SAE's held-out training sequences): each
    sequence's position 0 is left out, as in training, and the rest are packed end to end."""
    return pack_rows([list(seq)[1:] for seq in sequences], settings, separator)


def _chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 may answer a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def sink_rows(model: Any, hook_name: str, rows: list[list[int]], settings: SAEEvalSettings) -> list[bool]:
    """Per row: does a non-special token after the opening one have a norm at ``hook_name`` over
    ``settings.sink_ratio`` × the median of all such tokens (an attention sink)?"""
    import re

    import torch

    special = torch.tensor(sorted(set(getattr(model.tokenizer, "all_special_ids", None) or [])), dtype=torch.long)
    match = re.match(r"blocks\.(\d+)\.", hook_name)
    stop = int(match.group(1)) + 1 if match else None
    norms = []
    with torch.inference_mode():
        for start in range(0, len(rows), settings.batch_prompts):
            batch = torch.tensor(rows[start:start + settings.batch_prompts], dtype=torch.long)
            _, cache = model.run_with_cache(batch, names_filter=[hook_name], stop_at_layer=stop)
            norms.append(cache[hook_name].float().norm(dim=-1)[:, 1:])  # (b, context - 1)
    norm = torch.cat(norms)
    ordinary = ~torch.isin(torch.tensor(rows, dtype=torch.long)[:, 1:], special)
    median = norm[ordinary].median()
    return ((norm > settings.sink_ratio * median) & ordinary).any(dim=1).tolist()


def activations_store(model: Any, sae: Any, rows: list[list[int]], settings: SAEEvalSettings) -> Any:
    """sae-lens' ``ActivationsStore`` over ``rows`` (an in-memory pre-tokenised dataset)."""
    from datasets import Dataset
    from sae_lens.training.activations_store import ActivationsStore

    return ActivationsStore.from_sae(model, sae, dataset=Dataset.from_dict({"input_ids": rows}),
                                     context_size=settings.context_size, streaming=False,
                                     store_batch_size_prompts=settings.batch_prompts, device="cpu",
                                     total_tokens=len(rows))  # one pass over the rows: no "epochs" warning


def eval_config(settings: SAEEvalSettings) -> Any:
    """sae-lens' ``EvalConfig``: every metric these figures report, over ``settings.batches``."""
    from sae_lens.evals import EvalConfig

    return EvalConfig(batch_size_prompts=settings.batch_prompts, n_eval_reconstruction_batches=settings.batches,
                      n_eval_sparsity_variance_batches=settings.batches, compute_kl=True, compute_ce_loss=True,
                      compute_sparsity_metrics=True, compute_variance_metrics=True,
                      compute_featurewise_density_statistics=True)


def run_sae_lens_evals(sae: Any, model: Any, rows: list[list[int]], settings: SAEEvalSettings,
                       *, text: str) -> tuple[SAEEvalFigures, dict[str, Any], dict[str, Any]]:
    """``sae_lens.evals.run_evals`` on the first ``settings.rows`` of ``rows`` without an attention
    sink: the figures, and sae-lens' own ``(metrics, feature_metrics)`` as it returned them."""
    from sae_lens.evals import run_evals
    from sae_lens.training.activation_scaler import ActivationScaler

    if len(rows) < settings.rows:
        raise InvalidRequestError(f"`rows` must hold at least {settings.rows} rows (batches x batch_prompts), got "
                                  f"{len(rows)}", parameter="rows", value=len(rows))
    kept: list[list[int]] = []
    left_out = 0
    for row, sink in zip(rows, sink_rows(model, sae.cfg.metadata.hook_name, rows, settings)):
        if len(kept) == settings.rows:
            break
        left_out += sink
        if not sink:
            kept.append(row)
    if len(kept) < settings.rows:
        raise InvalidRequestError(
            f"only {len(kept)} of the {len(rows)} rows have no attention sink, {settings.rows} are needed; add text or "
            "lower --batches or --batch-prompts", parameter="texts", value=len(kept))
    store = activations_store(model, sae, kept, settings)
    metrics, feature_metrics = run_evals(sae, store, model, ActivationScaler(), eval_config(settings))
    figures = figures_from(metrics, feature_metrics, settings, text=text)
    return replace(figures, rows_left_out=left_out), metrics, feature_metrics


def figures_from(metrics: dict[str, Any], feature_metrics: dict[str, Any], settings: SAEEvalSettings, *,
                 text: str) -> SAEEvalFigures:
    """The figures out of ``run_evals``' answer; dead = never active on these tokens, dense =
    active on more than ``settings.dense_threshold`` of them."""
    density = [float(d) for d in feature_metrics["feature_density"]]
    behaviour = metrics["model_behavior_preservation"]
    performance = metrics["model_performance_preservation"]
    quality = metrics["reconstruction_quality"]
    return SAEEvalFigures(
        text=text, rows=settings.rows, tokens=int(metrics["token_stats"]["total_tokens_eval_reconstruction"]),
        ce_loss_score=float(performance["ce_loss_score"]), kl_div_score=float(behaviour["kl_div_score"]),
        explained_variance=float(quality["explained_variance"]), l0=float(metrics["sparsity"]["l0"]),
        dead_fraction=sum(d == 0 for d in density) / len(density),
        dense_fraction=sum(d > settings.dense_threshold for d in density) / len(density),
        ce_loss_without_sae=float(performance["ce_loss_without_sae"]),
        ce_loss_with_sae=float(performance["ce_loss_with_sae"]),
        ce_loss_with_ablation=float(performance["ce_loss_with_ablation"]),
        kl_div_with_sae=float(behaviour["kl_div_with_sae"]), kl_div_with_ablation=float(behaviour["kl_div_with_ablation"]),
        mse=float(quality["mse"]), cossim=float(quality["cossim"]),
    )
