"""Text embeddings: pooled hidden states of one fresh forward pass per batch.

The default is the common "one network, two heads" recipe: the final hidden states after the
model's final norm (what the LM head reads), averaged over the text's tokens. ``layer=L`` pools
the residual stream after block ``L`` (``blocks.{L}.hook_resid_post``) instead; ``pool="last"``
takes the last token's vector, which under causal attention is the only position that has read
the whole text.

Texts are tokenised as plain text: no chat template and no BOS token (this tokenizer adds none
by default, and we ask for none explicitly), so an embedding depends on the text alone, not on a
prompt format. Every batch is a fresh forward with no KV cache, so the same text always gives the
same vector, whatever was embedded before.

Batching: a batch equals the texts one by one (tests bound the difference at 1e-5 in float32).
Padding goes on the right and is masked, so each text keeps positions 0..n-1 and, under causal
attention, no real token ever sees a pad. That alone is not enough: CPU float32 matmuls pick
their kernels (and so their rounding) by shape, and a text alone would run with other shapes
than inside a batch. So every text is padded to the multiple of :data:`WIDTH_MULTIPLE` strictly
above its length (at least one pad: the masked attention path, never the unmasked one) and only
texts of the same padded width share a batch: a text then meets the same shapes and kernels
whether it is embedded alone or with others. The cost is at most ``WIDTH_MULTIPLE`` pad tokens per
text. The guarantee is measured on CPU; GPU libraries may pick other algorithms per batch size,
so there a batch and one by one may differ by float32 rounding.
"""

from __future__ import annotations

from typing import Any, Generator, Literal, Sequence

import numpy as np
import torch

from engine.errors import ContextOverflowError, InvalidRequestError
from engine.model.capture import check_layer
from engine.model.hook_names import HookName, resid_post
from engine.model.named_capture import check_input_ids
from engine.model.taps import taps_of

__all__ = ["Pool", "POOLS", "WIDTH_MULTIPLE", "embed", "embed_batches", "tokenize_texts", "batches"]

Pool = Literal["mean", "last"]
POOLS: tuple[str, ...] = ("mean", "last")
WIDTH_MULTIPLE = 8  # CPU sgemm micro-kernels tile rows by 4/8: full tiles keep each row's rounding
_FINAL = HookName(None, "ln_final.hook_weighted")  # what lm_head reads


def tokenize_texts(tokenizer: Any, texts: Sequence[str], max_context: int) -> list[list[int]]:
    """Plain-text token ids of each text (no BOS, no template); empty or too long texts are refused."""
    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise InvalidRequestError(f"`texts` must be a list of strings, got {type(texts).__name__}",
                                  parameter="texts", value=type(texts).__name__)
    if not texts:
        raise InvalidRequestError("`texts` must hold at least one text, got []", parameter="texts", value=[])
    out = []
    for i, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"`texts[{i}]` must be a non-empty string, got {text!r}",
                                      parameter=f"texts[{i}]", value=text)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise InvalidRequestError(f"`texts[{i}]` must tokenise to at least one token, got {text!r}",
                                      parameter=f"texts[{i}]", value=text)
        if len(ids) > max_context:
            raise ContextOverflowError(f"`texts[{i}]` must fit the model's context of {max_context} tokens, "
                                       f"got {len(ids)}; shorten it", parameter=f"texts[{i}]", value=len(ids))
        out.append(ids)
    return out


def _pool(hidden: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, pool: str) -> torch.Tensor:
    """``hidden (B, T, d)``, ``mask (B, T)`` → ``(B, d)`` float32."""
    hidden = hidden.float()
    if pool == "last":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    weights = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * weights).sum(dim=1) / lengths.to(hidden.dtype).unsqueeze(-1)


def batches(lengths: Sequence[int], batch_size: int, max_tokens: int | None = None) -> list[tuple[int, list[int]]]:
    """``(padded width, text indices)`` per batch: texts grouped by the multiple of
    :data:`WIDTH_MULTIPLE` strictly above their length, longest first, at most ``batch_size`` each
    and, with ``max_tokens``, at most that many padded tokens (but always one text)."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault((n // WIDTH_MULTIPLE + 1) * WIDTH_MULTIPLE, []).append(i)
    size = batch_size
    out = []
    for width, members in sorted(groups.items(), reverse=True):
        if max_tokens is not None:
            size = max(1, min(batch_size, max_tokens // width))
        out += [(width, members[start:start + size]) for start in range(0, len(members), size)]
    return out


def embed(model: Any, token_ids: Sequence[Sequence[int]], *, pad_id: int | None = None, layer: int | None = None,
          pool: str = "mean", batch_size: int = 16) -> np.ndarray:
    """``(len(token_ids), d)`` float32 embeddings, row ``i`` for the text tokenised as
    ``token_ids[i]`` (:func:`tokenize_texts`): :func:`embed_batches` run to its end."""
    batches_run = embed_batches(model, token_ids, pad_id=pad_id, layer=layer, pool=pool, batch_size=batch_size)
    while True:
        try:
            next(batches_run)
        except StopIteration as done:
            return done.value


def embed_batches(model: Any, token_ids: Sequence[Sequence[int]], *, pad_id: int | None = None,
                  layer: int | None = None, pool: str = "mean", batch_size: int = 16,
                  max_tokens: int | None = None) -> Generator[int, None, np.ndarray]:
    """Embed ``token_ids`` one batch per ``next()`` (each yields the padded tokens it fed, at most
    ``max_tokens`` but always one text); the generator returns the ``(len(token_ids), d)`` float32
    embeddings. The arguments are checked before the first batch.

    ``model``: a loaded model's :class:`~engine.model.taps.Taps` (or the model). ``layer=None``:
    final hidden states after the final norm; ``layer=L``: the residual stream after block ``L``.
    ``pool``: ``"mean"`` over the text's tokens or ``"last"`` token. ``pad_id`` fills the masked
    columns (never attended; 0 when None).
    """
    taps = taps_of(model)
    model = taps.model
    num_layers = taps.num_layers
    if pool not in POOLS:
        raise InvalidRequestError(f"`pool` must be one of {', '.join(POOLS)}, got {pool!r}", parameter="pool",
                                  value=pool)
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
        raise InvalidRequestError(f"`layer` must be an int or None, got {layer!r}", parameter="layer", value=layer)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidRequestError(f"`batch_size` must be an int >= 1, got {batch_size!r}", parameter="batch_size",
                                  value=batch_size)
    name = _FINAL if layer is None else resid_post(check_layer(layer, num_layers, parameter="layer"))
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence) or not token_ids:
        raise InvalidRequestError("`token_ids` must be a non-empty list of token id lists, got "
                                  f"{type(token_ids).__name__}", parameter="token_ids", value=type(token_ids).__name__)
    ids = [check_input_ids(model, text_ids) for text_ids in token_ids]
    return _embed_batches(taps, ids, name, pad_id, pool, batch_size, max_tokens)


def _embed_batches(taps: Any, ids: list[list[int]], name: HookName, pad_id: int | None, pool: str, batch_size: int,
                   max_tokens: int | None) -> Generator[int, None, np.ndarray]:
    model = taps.model
    device = next(model.parameters()).device
    pad = 0 if pad_id is None else int(pad_id)  # never attended: masked, at the end
    out: np.ndarray = np.empty((len(ids), int(model.config.hidden_size)), dtype=np.float32)
    for width, chunk in batches([len(t) for t in ids], batch_size, max_tokens):
        lengths = torch.tensor([len(ids[i]) for i in chunk], device=device)  # (B,)
        batch = torch.full((len(chunk), width), pad, dtype=torch.long, device=device)  # (B, T)
        for row, i in enumerate(chunk):
            batch[row, : len(ids[i])] = torch.tensor(ids[i], device=device)
        mask = torch.arange(width, device=device)[None, :] < lengths[:, None]  # (B, T)
        # the decoder stack only: the LM head's vocabulary-wide matmul is not needed
        with taps.record([name]) as rec, torch.inference_mode():
            taps.base(input_ids=batch, attention_mask=mask.long(), use_cache=False)
        hidden = rec.tensors()[name]  # (B, T, d)
        out[chunk] = _pool(hidden, mask, lengths, pool).cpu().numpy()
        yield width * len(chunk)
    return out
