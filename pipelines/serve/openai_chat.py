"""``POST /v1/chat/completions``: one request's validation, engine requests and both answer shapes.

* A mod's ForceOutput becomes the message content (finish ``stop``); ToolCalls becomes
  ``message.tool_calls`` with ``content`` null (finish ``tool_calls``); EmitError becomes an
  error: HTTP 400 with ``type`` ``mod_error``, or, once a stream has started, a final chunk with
  an ``error`` object and empty ``choices``.
* Streams send one ``delta.content`` chunk per token; a mod's Backtrack sends
  ``delta.removed = n`` (the newest ``n`` streamed tokens are gone), and a final output that
  differs from what was streamed (ForceOutput, ToolCalls) is sent as ``removed`` then content.
  With ``stream_options: {"include_usage": true}`` one more chunk follows the finishing one,
  with ``choices: []`` and the ``usage`` (none otherwise, as OpenAI's reference has it); adding
  ``continuous_usage_stats: true`` (vLLM's extension) puts the usage so far on every chunk too.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.core.inputs import GenerationRequest
from engine.errors import InvalidRequestError

from .errors import ApiError, ErrorCode, api_error_from, result_error
from .openai_choices import Choice, interleave, open_choices, seeded
from .openai_common import (SSE_DONE, SSE_HEADERS, fingerprint, parse_stops, stream_options, usage, refuse_unsupported,
                            resolve_model, service_of, sse, tool_calls)
from .openai_models import ERRORS, ChatCompletionRequest, ChatMessage
from .openai_raylens import parse_extension
from .openai_text import ChoiceText, Sample
from .service import Service

__all__ = ["router", "ChatCall"]

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/chat/completions", responses=ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    call = ChatCall(service_of(request), body)
    choices = await open_choices(call.service, call.requests(), call.new_text)
    if body.stream:
        return StreamingResponse(call.sse(choices), media_type="text/event-stream", headers=SSE_HEADERS)
    return await call.complete(choices)


def _text_content(message: ChatMessage, index: int) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    if message.content is None:  # kept: the engine's request says whether a null content is allowed here
        data["content"] = None
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


class ChatCall:
    """One chat completion: validation, engine arguments, and the answer in both shapes."""

    def __init__(self, service: Service, body: ChatCompletionRequest) -> None:
        self.service, self.body = service, body
        self.mods = resolve_model(service, body.model)
        refuse_unsupported(body.model_extra)
        self.ext = parse_extension(service, body.raylens)
        if self.ext is not None:
            self.mods = self.mods + self.ext.mods()
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.stops = parse_stops(body.stop)
        self.top_logprobs = (body.top_logprobs or 0) if body.logprobs else 0
        self.options = stream_options(body.stream_options, body.stream)
        self.choices: list[Choice] = []
        self.messages = [_text_content(m, i) for i, m in enumerate(body.messages)]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            self.request = GenerationRequest(
                messages=self.messages, mods=tuple(self.mods), max_tokens=max_tokens, seed=body.seed,
                tools=body.tools, tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
                top_logprobs=self.top_logprobs, max_tokens_cap=service.settings.max_new_tokens,
                **body.engine_fields())
        except InvalidRequestError as err:  # the same rule and message as from every other door
            raise api_error_from(err) from None

    def requests(self) -> list[GenerationRequest]:
        """The engine requests of the ``n`` choices (choice ``i`` seeded ``seed + i``, as candidates)."""
        return seeded(self.request, self.body.n)

    def new_text(self) -> ChoiceText:
        return ChoiceText(self.service.tokenizer, self.stops,
                          keep_samples=self.body.logprobs or (self.ext is not None and self.ext.keeps_samples))

    # ------------------------------------------------------------------------------ endings

    def finish(self, text: ChoiceText, result: Any) -> tuple[str, str | None, list[dict[str, Any]] | None]:
        """(finish_reason, content, tool_calls) of a finished choice."""
        reason = str(result.finish_reason)
        if reason == "error":
            raise result_error(result)
        if text.stopped_by_string:
            return "stop", text.text(), None
        if reason == "tool_calls":
            return "tool_calls", None, tool_calls(result.tool_calls)
        if reason == "cancelled":
            return "stop", text.text(), None
        return reason, result.output_text, None

    def _logprob_entry(self, sample: Sample) -> dict[str, Any]:
        decode = self.service.tokenizer.decode
        entry = lambda text, value: {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}  # noqa: E731
        return {**entry(sample.piece, sample.logprob if sample.logprob is not None else 0.0),
                "top_logprobs": [entry(decode([t]), float(v)) for t, v in sample.top][: self.top_logprobs]}

    def usage(self, results: list[Any], completion_tokens: int) -> dict[str, int]:
        """The prompt counted once (every choice reads the same one), completions summed."""
        return usage(len(results[0].prompt_ids), completion_tokens)

    def usage_so_far(self) -> dict[str, int]:
        """``continuous_usage_stats``: the prompt and every choice's tokens streamed so far."""
        return usage(len(self.choices[0].stream.handle.request.input_ids), sum(len(c.text.ids) for c in self.choices))

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None, *, logprobs: Any = None,
              raylens: dict[str, Any] | None = None) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        if raylens:
            choice["raylens"] = raylens
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.body.model,
                "system_fingerprint": fingerprint(), "choices": [choice]}
        if self.options.continuous:
            body["usage"] = self.usage_so_far()
        return sse(body)

    # ---------------------------------------------------------------------------- responses

    async def _complete_one(self, choice: Choice) -> tuple[dict[str, Any], Any, int]:
        text = choice.text
        result = await choice.run_to_end()
        finish, content, calls = self.finish(text, result)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls is not None:
            message["tool_calls"] = calls
        logprobs = ({"content": [self._logprob_entry(s) for s in text.samples], "refusal": None}
                    if self.body.logprobs else None)
        body = {"index": choice.index, "message": message, "finish_reason": finish, "logprobs": logprobs}
        extra = await self.ext.choice_extra(self.service, text, result) if self.ext is not None else {}
        if extra:
            body["raylens"] = extra
        return body, result, text.completion_tokens(result)

    async def complete(self, choices: list[Choice]) -> dict[str, Any]:
        done = await Choice.gather(choices, self._complete_one)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.body.model,
                "system_fingerprint": fingerprint(), "choices": [body for body, _, _ in done],
                "usage": self.usage([r for _, r, _ in done], sum(n for _, _, n in done))}

    async def _sse_one(self, choice: Choice, ended: list[tuple[Any, int]]) -> AsyncIterator[str]:
        """One choice's chunks; its (result, completion tokens) appended to ``ended`` at its end."""
        stream, text, index = choice.stream, choice.text, choice.index
        try:
            yield self.chunk(index, {"role": "assistant", "content": ""})
            streamed = 0  # samples (logprob entries, features) already sent
            async for kind, value in text.follow(stream):
                if kind == "removed":
                    streamed = min(streamed, len(text.samples))
                    yield self.chunk(index, {"removed": value})
                    continue
                logprobs = raylens = None
                if self.body.logprobs:
                    logprobs = {"content": [self._logprob_entry(s) for s in text.samples[streamed:]]}
                if self.ext is not None and self.ext.sae_features:
                    raylens = {"sae_features": self.ext.token_features(text, streamed)}
                streamed = len(text.samples)
                yield self.chunk(index, {"content": value}, logprobs=logprobs, raylens=raylens)
            result = await stream.result()
            finish, content, calls = self.finish(text, result)
            if content is not None and content != text.text():
                yield self.chunk(index, {"removed": len(text.ids)})
                yield self.chunk(index, {"content": content})
            elif calls is not None:
                if text.ids:
                    yield self.chunk(index, {"removed": len(text.ids)})
                yield self.chunk(index, {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
            ended.append((result, text.completion_tokens(result)))
            captures = None
            if self.ext is not None and self.ext.capture_names:
                captures = {"captures": await self.ext.captures(self.service, text, result)}
            yield self.chunk(index, {}, finish, raylens=captures)
        finally:
            stream.cancel()

    async def sse(self, choices: list[Choice]) -> AsyncIterator[str]:
        """The SSE body, choices interleaved as their tokens come; leaving it early (the client
        disconnected) cancels every choice's request."""
        ended: list[tuple[Any, int]] = []
        self.choices = choices
        try:
            async for item in interleave([self._sse_one(c, ended) for c in choices]):
                yield item
            if self.options.include_usage:  # OpenAI's shape: one more chunk, no choices, the usage
                yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                           "model": self.body.model, "system_fingerprint": fingerprint(), "choices": [],
                           "usage": self.usage([r for r, _ in ended], sum(n for _, n in ended))})
        except ApiError as err:
            yield sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                       "model": self.body.model, "choices": [], **err.openai_body()})
        finally:
            for choice in choices:
                choice.stream.cancel()
        yield SSE_DONE

