"""The Backend protocol: what the step loop needs from a model runtime, and nothing else.

A backend holds the model, its tokenizer and a KV cache with room for every active request. The
core tells it which requests are active (:meth:`Backend.acquire` / :meth:`Backend.release`) and
hands it, once per step, every row that needs a forward (:meth:`Backend.forward`): the tokens a
request has not fed yet and the position of the first. Positions are data: a request that
backtracked simply feeds from an earlier position again; the backend never learns why.

A backend over a paged cache (:class:`~engine.model.hf.HuggingFaceBackend`) offers three more
methods the step loop uses when present: ``reserve(request_id, tokens) -> bool`` (admission by
tokens: False means wait), ``reuse_prefix(request_id, prompt, plan)`` (the prefix cache: the
reused length and the internals a forward of it would have captured, or None) and
``cache_stats()`` (blocks used and free, hit rate). A backend without them admits by ``max_batch``
alone and never reuses a prefix.

Shapes (``d`` hidden size, ``V`` logits width, ``q`` tokens fed, ``kv`` the request's context):
:class:`RowOutput` logits ``(V,)`` float32 for the position after the last fed token;
internals per :class:`~engine.model.capture.RowCapture`. Tensors stay on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from engine.config import BackendConfig
from engine.model.capture import CapturePlan, RowCapture
from engine.model.hook_names import BLOCK_HOOKS, GLOBAL_HOOKS, HookSet

__all__ = ["Backend", "ModelInfo", "ForwardRow", "RowOutput", "ForwardRecord", "FORWARD_TOP_K", "top_logprobs"]

# Every forward's most likely next tokens, which observability payloads record per ForwardPass.
# Computed once for the whole batch (inside the replayed graph on a GPU): per request, a
# log-softmax and a top-k over a 128k vocabulary are two more launches and host work on every row.
FORWARD_TOP_K = 20


def top_logprobs(logits: Any, k: int = FORWARD_TOP_K) -> tuple[Any, Any]:
    """``logits (B, V)`` → the ``k`` largest log-probabilities ``(B, k)`` and their ids ``(B, k)``."""
    values, indices = torch.log_softmax(logits.float(), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
    return values, indices


@dataclass(frozen=True)
class ModelInfo:
    """Dimensions read from the loaded model's config (never hard-coded)."""

    model_id: str
    vocab_size: int  # logits width V (may exceed len(tokenizer))
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str
    family: str | None = None  # engine/model/families.py (None: a stand-in backend with no model)
    block_hooks: tuple[str, ...] = BLOCK_HOOKS  # the per-block names this model computes
    model_hooks: tuple[str, ...] = GLOBAL_HOOKS  # and its model-wide ones

    @property
    def hooks(self) -> HookSet:
        """The names this model computes (every name of the vocabulary for a stand-in backend)."""
        return HookSet(tuple(self.block_hooks), tuple(self.model_hooks))


@dataclass(frozen=True)
class ForwardRow:
    """One request's part of a step's forward: feed ``tokens`` at positions ``start, start+1, …``
    (the keys/values before ``start`` are already in the request's slot)."""

    request_id: str
    start: int
    tokens: tuple[int, ...]
    plan: CapturePlan = CapturePlan()
    steer: Any = None  # (d,) added to this row's residual stream after ``steer_layer`` (SAE steering)
    steer_layer: int | None = None


@dataclass(frozen=True)
class RowOutput:
    logits: Any  # (V,) float32, on device
    captured: RowCapture
    top: tuple[Any, Any]  # the logits' FORWARD_TOP_K log-probs (k,) and ids (k,), on device (top_logprobs)


@dataclass(frozen=True)
class ForwardRecord:
    """The tokens one forward read and their hidden states, for SAE encoding.

    ``hidden[layer]`` is ``(len(token_ids), d)``, on the model's device; the tokens sit at
    positions ``start_position, start_position + 1, …``.
    """

    start_position: int
    token_ids: tuple[int, ...]
    hidden: dict[int, Any]


@runtime_checkable
class Backend(Protocol):
    """Everything the engine asks of a model runtime. ``reference_model`` is the one way to the
    model object itself, and only for *independent* references — a benchmark's plain-transformers
    baseline, a test's ``generate``/``output_hidden_states`` — never for serving: a runtime whose
    model is not a transformers module has none to give."""

    info: ModelInfo
    config: BackendConfig
    device: Any  # torch.device the model's tensors live on (samplers' generators, logits edits)

    def tokenizer(self) -> Any: ...

    @property
    def max_batch(self) -> int:
        """How many requests can hold a slot at once."""
        ...

    @property
    def max_sequence(self) -> int:
        """The most positions one request may use (prompt + generated)."""
        ...

    def acquire(self, request_id: str) -> None:
        """Give ``request_id`` room in the KV cache (the caller keeps at most ``max_batch`` active)."""
        ...

    def release(self, request_id: str) -> None: ...

    def forward(self, rows: Sequence[ForwardRow]) -> list[RowOutput]:
        """One step's forwards for ``rows`` (each request at most once), outputs in row order."""
        ...

    def embed(self, token_ids: Sequence[Sequence[int]], *, layer: int | None = None, pool: str = "mean",
              batch_size: int = 16) -> Any:
        """``(len(token_ids), d)`` float32 numpy embeddings of plain-text token ids (one list per
        text), from fresh forwards that use no slot: the final normed hidden states, or the
        residual stream after block ``layer``, pooled by ``"mean"`` or ``"last"``
        (:mod:`engine.model.embeddings`)."""
        ...

    def capture(self, input_ids: Sequence[int], names: Sequence[str], *, out: Any = None) -> dict[str, Any]:
        """``{name: tensor}`` (batch dimension dropped, forward order) of every internal matching
        ``names`` (globs) in one fresh forward over ``input_ids`` that uses no slot; with ``out``,
        also written there (:mod:`engine.model.named_capture`)."""
        ...

    @property
    def reference_model(self) -> Any:
        """The underlying transformers model, for independent references only (see the class)."""
        ...

    def shutdown(self) -> None: ...
