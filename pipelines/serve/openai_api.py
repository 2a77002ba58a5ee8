"""The OpenAI-compatible API: models, chat completions (plain and streamed), mod registration.

Behaviour follows the original engine's OpenAI server, so existing clients and mods work unchanged:

* ``model`` = ``<model id>/<mod name>`` runs the mod registered under that name with
  ``POST /v1/mods`` (payload ``{"name", "language": "python", "entrypoint", "source"}`` or the
  other forms the mod loader accepts); answer ``{"name", "replaced", "description"}``.
* A mod's ForceOutput becomes the message content (finish ``stop``); ToolCalls becomes
  ``message.tool_calls`` with ``content`` null (finish ``tool_calls``); EmitError becomes an
  error: HTTP 400 with ``type`` ``mod_error``, or, once a stream has started, a final chunk with
  an ``error`` object and empty ``choices``.
* Streams send one ``delta.content`` chunk per token; a mod's Backtrack sends
  ``delta.removed = n`` (the newest ``n`` streamed tokens are gone), and a final output that
  differs from what was streamed (ForceOutput, ToolCalls) is sent as ``removed`` then content.
  With ``stream_options: {"include_usage": true}`` one more chunk follows the finishing one,
  with ``choices: []`` and the ``usage`` (none otherwise, as OpenAI's reference has it).

Deliberate differences: an unknown model or mod name is a 404 rather than being ignored; tool
calls also stream (as one ``delta.tool_calls`` chunk at the end); ``usage`` counts real prompt
tokens; parameters the engine cannot honour (``n`` > 1, presence/frequency penalties) are
refused with 400 instead of being dropped.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Body, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.core.inputs import GenerationRequest
from engine.errors import InvalidRequestError

from .bridge import Stream, open_stream
from .engine_stream import Erased, TokenEvent
from .errors import ApiError, ErrorCode, api_error_from, validation_error
from .service import Service
from .settings import raylens_version

__all__ = ["router", "ChatCompletionRequest", "resolve_model"]

router = APIRouter(prefix="/v1", tags=["openai"])


class OpenAIErrorBody(BaseModel):
    error: dict[str, Any]


_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": OpenAIErrorBody} for code in (400, 401, 403, 404, 413, 503, 504)}


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


def _service(request: Request) -> Service:
    return request.app.state.service


# ----------------------------------------------------------------------------------- routes


@router.get("/models")
def list_models(request: Request) -> dict[str, Any]:
    service = _service(request)
    ids = [service.model_id] + [f"{service.model_id}/{name}" for name in service.mods.names()]
    return {"object": "list", "data": [{"id": i, "object": "model", "created": 0, "owned_by": "raylens"} for i in ids]}


@router.post("/mods", responses=_ERRORS)
def register_mod(request: Request, body: dict[str, Any] = Body(...)) -> dict[str, Any]:
    service = _service(request)
    if not service.settings.allow_mod_registration:
        raise ApiError(ErrorCode.FORBIDDEN, "mod registration must be enabled to upload mods, got it off: start the "
                                            "server with --allow-mod-registration (mods run arbitrary code).")
    from pydantic import ValidationError

    from mods.loading import ModPayloadError

    try:
        payload = ModPayload.model_validate(body)
    except ValidationError as err:
        raise validation_error(err.errors()) from None

    try:
        replaced = service.mods.register(payload.name, body, load_timeout_s=service.settings.mod_load_timeout_s)
    except ModPayloadError as err:
        raise ApiError(ErrorCode.INVALID_REQUEST, str(err), "source") from err
    return {"name": payload.name, "replaced": replaced, "description": payload.description}


def resolve_model(service: Service, model: str) -> list[Any]:
    """The mods a ``model`` string selects: none for the model id, one for ``<model id>/<mod>``."""
    base = service.model_id
    if model == base:
        return []
    if model.startswith(base + "/"):
        return [service.mod(model[len(base) + 1:])]
    raise ApiError(ErrorCode.NOT_FOUND, f"`model` must be {base!r} or {base!r}/<registered mod>, got {model!r}. "
                                        f"See GET /v1/models.", "model")


@router.post("/chat/completions", responses=_ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    service = _service(request)
    call = _Call(service, body)
    stream = await open_stream(service.engine, call.request, timeout_s=service.settings.request_timeout_s)
    call.stop_ids = stream.handle.request.stop_ids
    if body.stream:
        return StreamingResponse(call.sse(stream), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await call.complete(stream)


# ------------------------------------------------------------------------------ one request


def _text_content(message: ChatMessage, index: int) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        parts = []
        for part in message.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(ErrorCode.INVALID_REQUEST, f"`messages[{index}].content` parts must be text parts, got "
                                                          f"type {part.get('type')!r}; this model reads text only.",
                               f"messages[{index}].content")
            parts.append(part["text"])
        data["content"] = "".join(parts)
    return data


def _fingerprint() -> str:
    """``system_fingerprint``: this server's build (OpenAI's reference wants a string, or nothing)."""
    return f"raylens-{raylens_version()}"


def _include_usage(options: dict[str, Any] | None, stream: bool) -> bool:
    """``stream_options``: only ``include_usage`` (a bool), and only with ``stream``."""
    if options is None:
        return False
    if not stream:
        raise ApiError(ErrorCode.INVALID_REQUEST, "`stream_options` must be used with `stream: true`, got "
                                                  "stream false.", "stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`stream_options` must hold only include_usage, got "
                                                  f"{', '.join(unknown)}.", f"stream_options.{unknown[0]}")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`stream_options.include_usage` must be true or false, got "
                                                  f"{value!r}.", "stream_options.include_usage")
    return value


class _Call:
    """One chat completion: validation, engine arguments, and the answer in both shapes."""

    def __init__(self, service: Service, body: ChatCompletionRequest) -> None:
        self.service, self.body = service, body
        self.mods = resolve_model(service, body.model)
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not isinstance(s, str) or not s for s in stops):
            raise ApiError(ErrorCode.INVALID_REQUEST, f"`stop` must be up to 4 non-empty strings, got {stops!r}.", "stop")
        self.stops = stops
        self.top_logprobs = (body.top_logprobs or 0) if body.logprobs else 0
        self.include_usage = _include_usage(body.stream_options, body.stream)
        self.messages = [_text_content(m, i) for i, m in enumerate(body.messages)]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            self.request = GenerationRequest(
                messages=self.messages, mods=tuple(self.mods), max_tokens=max_tokens, temperature=body.temperature,
                top_p=body.top_p, top_k=body.top_k, seed=body.seed, tools=body.tools,
                response_format=body.response_format, repetition_penalty=body.repetition_penalty,
                top_logprobs=self.top_logprobs, max_tokens_cap=service.settings.max_new_tokens)
        except InvalidRequestError as err:  # the same rule and message as from every other door
            raise api_error_from(err) from None
        self.stop_ids: frozenset[int] = frozenset()  # the engine's stop set, once the request is accepted
        # what the client has seen: token ids and the text each one added
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.stopped_by_string = False

    # ----------------------------------------------------------------------- token tracking

    def _text(self) -> str:
        return "".join(self.pieces)

    def push(self, event: Any) -> list[str]:
        """Record an event's visible tokens; the text pieces to send (one per token)."""
        tok = self.service.tokenizer
        out = []
        for i, token_id in enumerate(event.token_ids):
            if token_id in self.stop_ids:
                continue
            before = tok.decode(self.ids, skip_special_tokens=True)
            self.ids.append(int(token_id))
            piece = tok.decode(self.ids, skip_special_tokens=True)[len(before):]
            self.pieces.append(piece)
            if self.top_logprobs or self.body.logprobs:
                self.logprobs.append(self._logprob_entry(event, i, token_id, piece))
            out.append(piece)
        return out

    def erase(self, n: int) -> int:
        n = min(n, len(self.ids))
        for store in (self.ids, self.pieces):
            del store[len(store) - n:]
        if self.logprobs:
            del self.logprobs[max(0, len(self.logprobs) - n):]
        return n

    def _logprob_entry(self, event: Any, i: int, token_id: int, piece: str) -> dict[str, Any]:
        tok = self.service.tokenizer
        lp = event.logprobs[i] if i < len(event.logprobs) else None
        top = event.top_logprobs[i] if event.top_logprobs is not None and i < len(event.top_logprobs) else ()
        entry = lambda text, value: {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}  # noqa: E731
        return {**entry(piece, lp if lp is not None else 0.0),
                "top_logprobs": [entry(tok.decode([t]), float(v)) for t, v in top][: self.top_logprobs]}

    def hit_stop_string(self) -> bool:
        """True once the text holds a stop string; the text is cut before it."""
        text = self._text()
        cuts = [text.find(s) for s in self.stops if s in text]
        if not cuts:
            return False
        keep = min(cuts)
        while len(self._text()) > keep and self.pieces:
            if len(self._text()) - len(self.pieces[-1]) >= keep:
                self.erase(1)
            else:
                self.pieces[-1] = self.pieces[-1][: keep - (len(self._text()) - len(self.pieces[-1]))]
        self.stopped_by_string = True
        return True

    def held_back(self) -> int:
        """Characters at the end that might start a stop string, kept until the next token decides."""
        text, hold = self._text(), 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold

    # ------------------------------------------------------------------------------ endings

    def finish(self, result: Any) -> tuple[str, str | None, list[dict[str, Any]] | None]:
        """(finish_reason, content, tool_calls) of the finished request."""
        reason = str(result.finish_reason)
        if reason == "error":
            raise ApiError(ErrorCode.MOD_ERROR, f"a mod ended the request with an error: {result.error}")
        if self.stopped_by_string:
            return "stop", self._text(), None
        if reason == "tool_calls":
            return "tool_calls", None, _tool_calls(result.tool_calls)
        if reason == "cancelled":
            return "stop", self._text(), None
        return reason, result.output_text, None

    def usage(self, result: Any, completion_tokens: int) -> dict[str, int]:
        prompt = len(result.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.body.model,
                "system_fingerprint": _fingerprint(), "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                         "logprobs": extra.pop("logprobs", None)}], **extra}
        return f"data: {json.dumps(body)}\n\n"

    # ---------------------------------------------------------------------------- responses

    async def _consume(self, stream: Stream) -> AsyncIterator[tuple[str, Any]]:
        """("delta", text) / ("removed", n) as tokens arrive, honouring stop strings."""
        sent = 0  # characters of the text already sent
        async for event in stream:
            if isinstance(event, Erased):
                n = self.erase(event.n)
                sent = min(sent, len(self._text()))
                if n:
                    yield "removed", n
                continue
            if not isinstance(event, TokenEvent):
                continue
            self.push(event)
            if self.stops and self.hit_stop_string():
                stream.cancel()
                text = self._text()
                if len(text) > sent:
                    yield "delta", text[sent:]
                return
            text = self._text()
            ready = len(text) - self.held_back()
            if ready > sent:
                yield "delta", text[sent:ready]
                sent = ready
        text = self._text()
        if len(text) > sent:
            yield "delta", text[sent:]

    async def complete(self, stream: Stream) -> dict[str, Any]:
        try:
            async for _ in self._consume(stream):
                pass
            result = await stream.result()
        finally:
            stream.cancel()
        finish, content, tool_calls = self.finish(result)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if tool_calls is not None:
            message["tool_calls"] = tool_calls
        completion = len(result.output_ids) if not self.stopped_by_string else len(self.ids)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.body.model,
                "system_fingerprint": _fingerprint(),
                "choices": [{"index": 0, "message": message, "finish_reason": finish,
                             "logprobs": {"content": self.logprobs, "refusal": None} if self.body.logprobs
                             else None}],
                "usage": self.usage(result, completion)}

    async def sse(self, stream: Stream) -> AsyncIterator[str]:
        """The SSE body; leaving it early (the client disconnected) cancels the request."""
        try:
            yield self.chunk({"role": "assistant", "content": ""})
            streamed = 0  # logprob entries already sent
            async for kind, value in self._consume(stream):
                if kind == "removed":
                    streamed = min(streamed, len(self.logprobs))
                    yield self.chunk({"removed": value})
                    continue
                extra = {}
                if self.body.logprobs:
                    extra["logprobs"] = {"content": self.logprobs[streamed:]}
                    streamed = len(self.logprobs)
                yield self.chunk({"content": value}, **extra)
            result = await stream.result()
            finish, content, tool_calls = self.finish(result)
            if content is not None and content != self._text():
                yield self.chunk({"removed": len(self.ids)})
                yield self.chunk({"content": content})
            elif tool_calls is not None:
                if self.ids:
                    yield self.chunk({"removed": len(self.ids)})
                yield self.chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]})
            completion = len(result.output_ids) if not self.stopped_by_string else len(self.ids)
            yield self.chunk({}, finish)
            if self.include_usage:  # OpenAI's shape: one more chunk, no choices, the usage
                body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.body.model, "system_fingerprint": _fingerprint(), "choices": [],
                        "usage": self.usage(result, completion)}
                yield f"data: {json.dumps(body)}\n\n"
        except ApiError as err:
            body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.body.model, "choices": [], **err.openai_body()}
            yield f"data: {json.dumps(body)}\n\n"
        finally:
            stream.cancel()
        yield "data: [DONE]\n\n"


def _tool_calls(raw: Any) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` from a mod's ToolCalls payload: one call, a list of calls, or an object
    holding ``tool_calls`` / ``function_call``; ``arguments`` always a JSON string."""
    items: list[Any] = []
    for entry in raw or []:
        if isinstance(entry, dict) and isinstance(entry.get("tool_calls"), list):
            items.extend(entry["tool_calls"])
        elif isinstance(entry, dict) and isinstance(entry.get("function_call"), dict):
            items.append({"type": "function", "function": entry["function_call"]})
        elif isinstance(entry, list):
            items.extend(entry)
        else:
            items.append(entry)
    calls = []
    for call in items:
        if not isinstance(call, dict):
            continue
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        name = fn.get("name") or call.get("name") or ""
        args = fn.get("arguments", call.get("arguments"))
        calls.append({"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": call.get("type") or "function",
                      "function": {"name": name,
                                   "arguments": args if isinstance(args, str) else json.dumps(args or {})}})
    return calls
