"""The Backend protocol: what the generation loop needs from a model runtime.

Method names follow seed 000's protocol. Every per-request method takes the ``request_id``
(seed 000 leaves it implicit) because one backend serves concurrent requests, each with its own
KV cache and sampling generator.

Sequence contract: ``prefill`` starts a request; each ``forward_pass`` returns logits for the
position after every token added so far; ``add_token`` appends tokens (fed to the model by the
next ``forward_pass``); ``rewind_kv_cache(request_id, n)`` removes the newest ``n`` tokens, so the
next ``forward_pass`` predicts the position after the kept ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from mods.types import Added, ForwardPass, Prefilled, Sampled

from engine.config import BackendConfig
from engine.model.sampling import SamplingParams

__all__ = ["Backend", "ModelInfo", "ForwardRecord"]


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


@dataclass(frozen=True)
class ForwardRecord:
    """The tokens one forward pass read and their hidden states, for SAE encoding.

    ``hidden[layer]`` is ``(len(token_ids), d)``, on the model's device; the tokens sit at
    positions ``start_position, start_position + 1, …``.
    """

    start_position: int
    token_ids: tuple[int, ...]
    hidden: dict[int, Any]


@runtime_checkable
class Backend(Protocol):
    info: ModelInfo
    config: BackendConfig

    def load_model(self, model_id: str, config: BackendConfig) -> None: ...

    def tokenizer(self) -> Any: ...

    def prefill(self, request_id: str, input_ids: Sequence[int], max_steps: int, *,
                context_info: Any = None, seed: int | None = None) -> Prefilled: ...

    def forward_pass(self, request_id: str, step: int) -> ForwardPass: ...

    def sample(self, request_id: str, step: int, logits: Any, params: SamplingParams) -> Sampled: ...

    def add_token(self, request_id: str, step: int, tokens: Sequence[int], forced: bool) -> Added: ...

    def rewind_kv_cache(self, request_id: str, n: int) -> None: ...

    def get_hidden_states(self, request_id: str, layer: int) -> Any | None: ...

    def get_attention_patterns(self, request_id: str, layer: int) -> Any | None: ...

    def take_forward_record(self, request_id: str) -> ForwardRecord | None:
        """The newest forward's record, once (None if that forward was already taken)."""
        ...

    def release(self, request_id: str) -> None: ...

    def shutdown(self) -> None: ...
