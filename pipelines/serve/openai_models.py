"""The OpenAI API's request bodies, as pydantic models (what ``/docs`` shows and FastAPI checks).

The schema states types; values with rules shared by every door (sampling ranges, token ids) are
checked by the engine's one request type, :class:`~engine.core.inputs.GenerationRequest`, so a bad
value gets the same error whichever door it came through. Fields that cannot change an answer
(``user``, ``metadata``, ``store`` …) are accepted and ignored (``extra="allow"``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

__all__ = ["OpenAIErrorBody", "ERRORS", "ChatMessage", "EngineFields", "ChatCompletionRequest", "CompletionRequest", "ModPayload",
           "MAX_CHOICES", "MAX_PROMPTS", "MAX_TOTAL_CHOICES", "MAX_LEGACY_LOGPROBS"]


#: the most choices one request may ask for (``n``; on completions, ``n`` times the prompts)
MAX_CHOICES = 16
#: the most prompts one completions request may hold
MAX_PROMPTS = 64
#: the most choices one completions request may ask for in all (prompts times ``n``)
MAX_TOTAL_CHOICES = 64
#: OpenAI's bound on legacy completions' ``logprobs``
MAX_LEGACY_LOGPROBS = 5


#: a JSON number: an int or a float, never a numeric string (``"5"``) or a boolean, which pydantic's
#: lax mode would turn into 5.0 or 1.0 behind the caller's back
Number = Annotated[float, Strict()]


class OpenAIErrorBody(BaseModel):
    error: dict[str, Any]


#: the error responses every route documents (OpenAI's envelope)
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIErrorBody}
                                           for code in (400, 401, 403, 404, 413, 503, 504)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class EngineFields(BaseModel):
    """The fields chat and completions share that the engine's request takes as they are. Their
    rules (ranges, token ids in the vocabulary, the schema a grammar can enforce) are the engine's,
    so the schema states only types."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    temperature: Number | None = Field(None, le=2, description=">= 0; 0 is greedy")
    top_p: Number | None = Field(None, description="in (0, 1]")
    top_k: int | None = Field(None, strict=True, description=">= 0; 0 disables top-k")
    ignore_eos: bool | None = Field(None, strict=True, description="true: EOS does not end the answer")
    min_tokens: int | None = Field(None, strict=True, description=">= 0: EOS and stop tokens are not drawn before "
                                                                  "this many tokens")
    logit_bias: dict[str, Number] | None = Field(None, description="token id -> bias in [-100, 100] added to its "
                                                                   "logit (a JSON number)")
    presence_penalty: Number | None = Field(None, description="in [-2, 2] (OpenAI's rule over generated tokens)")
    frequency_penalty: Number | None = Field(None, description="in [-2, 2] (OpenAI's rule over generated tokens)")
    repetition_penalty: Number | None = Field(None, le=100, description="> 0; 1 is off")
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object, json_schema (enforced by a grammar), or raylens' regex / grammar")
    prefix_cache: bool | None = Field(None, strict=True, description="extension: false skips the prefix cache for "
                                                                       "this request (default: the server's setting)")

    def engine_fields(self) -> dict[str, Any]:
        """These fields as :class:`~engine.core.inputs.GenerationRequest` keywords."""
        return {name: getattr(self, name) for name in EngineFields.model_fields}


class ChatCompletionRequest(EngineFields):
    """The Chat Completions request; fields the server does not use are accepted and ignored
    only when they cannot change the answer (``user``, ``metadata``, ``store`` …)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str = Field(min_length=1, max_length=512)
    messages: list[ChatMessage] = Field(min_length=1)
    # Sampling values are checked by the engine's one request type (GenerationRequest), so every
    # door answers a bad value with the same error; the schema states only their types.
    max_tokens: int | None = Field(None, strict=True, description=">= 1 (and at most the server's serve.max_new_tokens)")
    max_completion_tokens: int | None = Field(None, strict=True, description="as max_tokens; takes precedence")
    n: int = Field(1, ge=1, le=MAX_CHOICES, strict=True,
                   description=f"in [1, {MAX_CHOICES}]; choice i is seeded (seed + i) mod 2**64, all n run as one "
                               "batch")
    stream: bool = Field(False, strict=True)
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, strict=True, description="in [0, 2**64 - 1]")
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, strict=True, description="in [0, 20]")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto, required or {type: function, function: {name}}; required and a named "
                          "function are enforced by a grammar (one call)")
    parallel_tool_calls: bool | None = Field(None, strict=True, description="accepted; one call is generated")
    raylens: dict[str, Any] | None = Field(None, description="extension: {steer, sae_features, capture}; each off "
                                                             "unless asked (README: the raylens object)")


class ModPayload(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    language: str = "python"
    entrypoint: str = Field(min_length=1)
    description: str | None = None



class CompletionRequest(EngineFields):
    """The legacy Completions request: raw text (no chat template) or token ids in, text out."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str = Field(min_length=1, max_length=512)
    prompt: Any = Field(description="a string, a list of token ids, or a list of either (each its own choices)")
    suffix: str | None = Field(None, description="not supported: must be null or empty")
    max_tokens: int | None = Field(None, strict=True, description=">= 0 (0 only with echo: score the prompt); "
                                                                   "null: OpenAI's 16, at most the server's limit")
    n: int = Field(1, ge=1, le=MAX_CHOICES, strict=True, description=f"in [1, {MAX_CHOICES}]")
    best_of: int | None = Field(None, strict=True, description="must equal n (no server-side ranking)")
    stream: bool = Field(False, strict=True)
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, strict=True, description="in [0, 2**64 - 1]; choice i is seeded (seed + i) mod "
                                                             "2**64")
    logprobs: int | None = Field(None, ge=0, le=MAX_LEGACY_LOGPROBS, strict=True,
                                 description=f"in [0, {MAX_LEGACY_LOGPROBS}]: each token's log-prob and that many "
                                             "alternatives")
    echo: bool = Field(False, strict=True)
    raylens: dict[str, Any] | None = Field(None, description="extension: {steer, sae_features, capture}; each off "
                                                             "unless asked (README: the raylens object)")


#: the most inputs one embeddings request may hold
MAX_EMBEDDING_INPUTS = 256


class EmbeddingRequest(BaseModel):
    """The Embeddings request: text or token ids in, one vector per input out."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=512)
    input: Any = Field(description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: little-endian float32 bytes")
    dimensions: int | None = Field(None, strict=True, description="null or the model's hidden size")
