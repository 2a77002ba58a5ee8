"""``POST /v1/completions``: OpenAI's legacy completions — raw text or token ids in, text out.

* ``prompt``: a string (tokenised as plain text, no chat template), a list of token ids, or a list
  of either; prompt ``p`` owns choices ``p * n`` to ``p * n + n - 1``.
* ``echo``: the prompt's text comes first in each choice's ``text``; with ``logprobs`` the prompt
  tokens' log-probs come first too (the model's own, from one scoring forward, ``Engine.score``;
  the first token's is null). ``max_tokens: 0`` with ``echo`` only scores: nothing is generated
  (what log-likelihood evaluations send).
* ``logprobs`` (0..5): OpenAI's legacy object (:mod:`.openai_legacy`).
* ``n`` choices per prompt run as one batch, choice ``i`` seeded ``seed + i`` (:mod:`.openai_choices`).
* Streams send one chunk per token (``finish_reason`` null until the last, as OpenAI sends it); a
  mod's Backtrack sends a chunk with ``removed: n`` on the choice (an extension: the newest ``n``
  tokens are gone). ``stream_options.include_usage`` adds a last chunk with ``choices: []``
  (and ``continuous_usage_stats`` the usage so far on every chunk).
* Mods by model suffix (``<model>/<mod>``) as on chat; a mod's EmitError is an error, its ToolCalls
  ends the choice with ``stop`` (completions have no tool calls).
* Refused with a 400 naming the field: ``suffix`` (no fill-in-the-middle), ``best_of`` other than
  ``n`` (no server-side ranking). The sampling fields chat has (``logit_bias``, ``min_tokens``,
  penalties, ``response_format`` with its grammar) work here too.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.core.inputs import GenerationRequest
from engine.errors import InvalidRequestError

from .bridge import run_job
from .errors import ApiError, ErrorCode, api_error_from, result_error
from .openai_choices import Choice, interleave, open_choices, seeded
from .openai_common import (SSE_DONE, SSE_HEADERS, fingerprint, parse_stops, stream_options, usage, refuse_unsupported,
                            resolve_model, service_of, sse)
from .openai_legacy import LegacyLogprobs
from .openai_models import ERRORS, MAX_TOTAL_CHOICES, CompletionRequest
from .openai_prompts import parse_prompts, token_pieces
from .openai_raylens import parse_extension
from .openai_text import ChoiceText
from .service import Service

__all__ = ["router", "CompletionCall"]

router = APIRouter(prefix="/v1", tags=["openai"])

#: ``max_tokens`` when the body leaves it out or null (OpenAI's default), capped by the server's limit
DEFAULT_MAX_TOKENS = 16


@router.post("/completions", responses=ERRORS)
async def completions(body: CompletionRequest, request: Request) -> Any:
    call = CompletionCall(service_of(request), body, request)
    await call.score_prompts()
    choices = await call.open()
    if body.stream:
        return StreamingResponse(call.sse(choices), media_type="text/event-stream", headers=SSE_HEADERS)
    return await call.complete(choices)


def _refuse(field: str, constraint: str, value: Any) -> ApiError:
    return ApiError(ErrorCode.INVALID_REQUEST, f"`{field}` must be {constraint}, got {str(value)[:80]}.", field)


class CompletionCall:
    """One completions request: validation, its engine requests, and the answer in both shapes."""

    def __init__(self, service: Service, body: CompletionRequest, http_request: Request | None = None) -> None:
        self.service, self.body = service, body
        self.http_request = http_request  # its client's disconnect cancels the prompt scoring
        self.mods = resolve_model(service, body.model)
        self.ext = parse_extension(service, body.raylens)
        if self.ext is not None:
            self.mods = self.mods + self.ext.mods()
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        if body.suffix:
            raise _refuse("suffix", "null or empty (this server does not fill in the middle)", body.suffix)
        if body.best_of is not None and body.best_of != body.n:
            raise _refuse("best_of", f"null or equal to n ({body.n}): choices are not ranked on the server; ask "
                                     f"for n choices and rank them yourself", body.best_of)
        extra = body.model_extra or {}
        refuse_unsupported(extra)
        self.stops = parse_stops(body.stop)
        self.options = stream_options(body.stream_options, body.stream)
        self.choices: list[Choice] = []
        self.prompts = parse_prompts(service, body.prompt)
        self.n = body.n
        if len(self.prompts) * self.n > MAX_TOTAL_CHOICES:
            raise _refuse("n", f"at most {MAX_TOTAL_CHOICES} choices in all (prompts times n)", body.n)
        max_tokens = body.max_tokens if body.max_tokens is not None else min(
            DEFAULT_MAX_TOKENS, service.settings.max_new_tokens)
        self.scoring_only = max_tokens == 0
        if self.scoring_only and not body.echo:
            raise _refuse("max_tokens", ">= 1, or 0 with `echo: true` (score the prompt, generate nothing)", 0)
        self.want_logprobs = body.logprobs is not None
        self.k = body.logprobs or 0
        try:  # checked even when only scoring: every field must be valid
            self.requests = [GenerationRequest(
                input_ids=tuple(p.ids), mods=tuple(self.mods),
                max_tokens=None if self.scoring_only else max_tokens,
                seed=body.seed, top_logprobs=body.logprobs, max_tokens_cap=service.settings.max_new_tokens,
                **body.engine_fields()) for p in self.prompts]
        except InvalidRequestError as err:
            raise api_error_from(err) from None
        self.scores: list[Any] = []
        self.prompt_pieces = [p.pieces(service.tokenizer) for p in self.prompts] if (
            body.echo and self.want_logprobs) else []

    async def score_prompts(self) -> None:
        """The prompt tokens' log-probs, when ``echo`` and ``logprobs`` ask for them."""
        if not (self.body.echo and self.want_logprobs):
            return
        for prompt in self.prompts:
            self.scores.append(await run_job(self.service.engine, "score", prompt.ids, top_k=self.k,
                                             request=self.http_request,
                                             timeout_s=self.service.settings.request_timeout_s))

    async def open(self) -> list[Choice]:
        """Every choice's engine request, accepted (none when only scoring)."""
        if self.scoring_only:
            return []
        choices: list[Choice] = []
        try:
            for p, request in enumerate(self.requests):
                choices += await open_choices(self.service, seeded(request, self.n), self.new_text,
                                              first_index=p * self.n)
        except BaseException:
            for choice in choices:
                choice.stream.cancel()
            raise
        return choices

    def new_text(self) -> ChoiceText:
        return ChoiceText(self.service.tokenizer, self.stops,
                          keep_samples=self.want_logprobs or (self.ext is not None and self.ext.keeps_samples))

    # ------------------------------------------------------------------------------ pieces

    def _echo(self, p: int) -> str:
        return self.prompts[p].text if self.body.echo else ""

    def _prompt_logprobs(self, p: int) -> LegacyLogprobs:
        """The legacy object holding the echoed prompt's tokens (empty without ``echo``)."""
        lp = LegacyLogprobs(self.service.tokenizer.decode, self.k)
        if self.body.echo:
            scores = self.scores[p]
            for i, piece in enumerate(self.prompt_pieces[p]):
                lp.add(piece, scores.logprobs[i], None if i == 0 else scores.top[i])
            lp.offset = len(self.prompts[p].text)
        return lp

    def _add_samples(self, lp: LegacyLogprobs, text: ChoiceText, start: int = 0) -> LegacyLogprobs:
        for sample, piece in zip(text.samples[start:], text.pieces[start:]):
            lp.add(piece, sample.logprob, sample.top)
        return lp

    def _add_replaced(self, lp: LegacyLogprobs, text: ChoiceText, result: Any) -> LegacyLogprobs:
        """A final output other than the streamed tokens (a mod's ForceOutput): its tokens, forced."""
        ids = [t for t in result.output_ids if t not in text.stop_ids]
        for piece in token_pieces(self.service.tokenizer, ids, skip_special_tokens=True):
            lp.add(piece, None, ())
        return lp

    def finish(self, text: ChoiceText, result: Any) -> tuple[str, str]:
        """(finish_reason, generated text) of a finished choice."""
        reason = str(result.finish_reason)
        if reason == "error":
            raise result_error(result)
        if text.stopped_by_string or reason == "cancelled":
            return "stop", text.text()
        return ("length" if reason == "length" else "stop"), result.output_text

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return usage(sum(len(p.ids) for p in self.prompts), completion_tokens)

    def _choice(self, index: int, text: str, finish: str | None, logprobs: LegacyLogprobs | None,
                **extra: Any) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs.body() if logprobs is not None else None,
                "finish_reason": finish, **extra}

    def _body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.body.model,
                "system_fingerprint": fingerprint(), "choices": choices, **extra}

    def _chunk(self, choice: dict[str, Any]) -> str:
        """One streamed choice; with ``continuous_usage_stats`` also the usage so far."""
        extra = {"usage": self.usage(sum(len(c.text.ids) for c in self.choices))} if self.options.continuous else {}
        return sse(self._body([choice], **extra))

    def _scored_choices(self) -> list[dict[str, Any]]:
        """``max_tokens: 0``: each choice is its echoed prompt, nothing generated."""
        return [self._choice(p * self.n + i, self._echo(p), "length",
                             self._prompt_logprobs(p) if self.want_logprobs else None)
                for p in range(len(self.prompts)) for i in range(self.n)]

    # ---------------------------------------------------------------------------- responses

    async def _complete_one(self, choice: Choice) -> tuple[dict[str, Any], int]:
        text, p = choice.text, choice.index // self.n
        result = await choice.run_to_end()
        finish, generated = self.finish(text, result)
        logprobs = None
        if self.want_logprobs:
            lp = self._prompt_logprobs(p)
            logprobs = (self._add_samples(lp, text) if generated == text.text()
                        else self._add_replaced(lp, text, result))
        found = await self.ext.choice_extra(self.service, text, result) if self.ext is not None else {}
        extra = {"raylens": found} if found else {}
        return (self._choice(choice.index, self._echo(p) + generated, finish, logprobs, **extra),
                text.completion_tokens(result))

    async def complete(self, choices: list[Choice]) -> dict[str, Any]:
        if self.scoring_only:
            return self._body(self._scored_choices(), usage=self.usage(0))
        done = await Choice.gather(choices, self._complete_one)
        return self._body([body for body, _ in done], usage=self.usage(sum(n for _, n in done)))

    async def _sse_one(self, choice: Choice, ended: list[int]) -> AsyncIterator[str]:
        """One choice's chunks; its completion tokens appended to ``ended`` at its end."""
        stream, text, index, p = choice.stream, choice.text, choice.index, choice.index // self.n
        chunk = lambda *args, **kw: self._chunk(self._choice(index, *args, **kw))  # noqa: E731
        try:
            if self.body.echo:
                yield chunk(self._echo(p), None, self._prompt_logprobs(p) if self.want_logprobs else None)
            base = len(self._echo(p))
            streamed = 0  # samples already sent
            async for kind, value in text.follow(stream):
                if kind == "removed":
                    streamed = min(streamed, len(text.samples))
                    yield chunk("", None, None, removed=value)
                    continue
                logprobs = None
                extra: dict[str, Any] = {}
                if self.want_logprobs:
                    offset = base + len("".join(text.pieces[:streamed]))
                    logprobs = self._add_samples(LegacyLogprobs(self.service.tokenizer.decode, self.k, offset=offset),
                                                 text, streamed)
                if self.ext is not None and self.ext.sae_features:
                    extra["raylens"] = {"sae_features": self.ext.token_features(text, streamed)}
                streamed = len(text.samples)
                yield chunk(value, None, logprobs, **extra)
            result = await stream.result()
            finish, generated = self.finish(text, result)
            if generated != text.text():
                if text.ids:
                    yield chunk("", None, None, removed=len(text.ids))
                replaced = (self._add_replaced(LegacyLogprobs(self.service.tokenizer.decode, self.k, offset=base),
                                               text, result) if self.want_logprobs else None)
                yield chunk(generated, None, replaced)
            ended.append(text.completion_tokens(result))
            extra = {}
            if self.ext is not None and self.ext.capture_names:
                extra["raylens"] = {"captures": await self.ext.captures(self.service, text, result)}
            yield chunk("", finish, None, **extra)
        finally:
            stream.cancel()

    async def sse(self, choices: list[Choice]) -> AsyncIterator[str]:
        """The SSE body, choices interleaved as their tokens come; leaving it early cancels them."""
        ended: list[int] = []
        self.choices = choices
        try:
            if self.scoring_only:
                for body in self._scored_choices():
                    yield self._chunk(body)
            else:
                async for item in interleave([self._sse_one(c, ended) for c in choices]):
                    yield item
            if self.options.include_usage:
                yield sse(self._body([], usage=self.usage(sum(ended))))
        except ApiError as err:
            yield sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.body.model,
                       "choices": [], **err.openai_body()})
        finally:
            for choice in choices:
                choice.stream.cancel()
        yield SSE_DONE
