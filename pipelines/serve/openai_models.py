"""The OpenAI API's request bodies, as pydantic models (what ``/docs`` shows and FastAPI checks).

The schema states types; values with rules shared by every door (sampling ranges, token ids) are
checked by the engine's one request type, :class:`~engine.core.inputs.GenerationRequest`, so a bad
value gets the same error whichever door it came through. Fields that cannot change an answer
(``user``, ``metadata``, ``store`` …) are accepted and ignored (``extra="allow"``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["OpenAIErrorBody", "ERRORS", "ChatMessage", "ChatCompletionRequest", "ModPayload"]


class OpenAIErrorBody(BaseModel):
    error: dict[str, Any]


#: the error responses every route documents (OpenAI's envelope)
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIErrorBody}
                                           for code in (400, 401, 403, 404, 413, 503, 504)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(BaseModel):
    """The Chat Completions request; fields the server does not use are accepted and ignored
    only when they cannot change the answer (``user``, ``metadata``, ``store`` …)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str = Field(min_length=1, max_length=512)
    messages: list[ChatMessage] = Field(min_length=1)
    # Sampling values are checked by the engine's one request type (GenerationRequest), so every
    # door answers a bad value with the same error; the schema states only their types.
    max_tokens: int | None = Field(None, strict=True, description=">= 1 (and at most the server's serve.max_new_tokens)")
    max_completion_tokens: int | None = Field(None, strict=True, description="as max_tokens; takes precedence")
    temperature: float | None = Field(None, le=2, description=">= 0; 0 is greedy")
    top_p: float | None = Field(None, description="in (0, 1]")
    top_k: int | None = Field(None, strict=True, description=">= 0; 0 disables top-k")
    n: int = Field(1, ge=1, le=1, strict=True, description="only 1 is supported")
    stream: bool = Field(False, strict=True)
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, strict=True, description="in [0, 2**64 - 1]")
    logprobs: bool = Field(False, strict=True)
    top_logprobs: int | None = Field(None, strict=True, description="in [0, 20]")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    presence_penalty: float = Field(0.0, ge=0, le=0, description="not supported: must be 0")
    frequency_penalty: float = Field(0.0, ge=0, le=0, description="not supported: must be 0")
    repetition_penalty: float | None = Field(None, le=100, description="> 0; 1 is off")


class ModPayload(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    language: str = "python"
    entrypoint: str = Field(min_length=1)
    description: str | None = None
