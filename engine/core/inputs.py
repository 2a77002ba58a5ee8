"""One typed request in: :class:`GenerationRequest`, what every door builds.

Every door — ``Engine.generate/submit/stream/candidates``, the CLI, prompts files, Ray jobs, the
GeneratorActor, the OpenAI route and the attention route — builds a :class:`GenerationRequest`.
Building it checks everything that needs no model (types, ranges, exactly one prompt source), so a
bad value is the same :class:`~engine.errors.InvalidRequestError` naming the same field whichever
door it came through. It is frozen and holds only plain data (mods as callables, paths or payload
dicts), so it crosses Ray unchanged.

:class:`~engine.core.input_processor.InputProcessor` (one per engine: it holds the tokenizer and
the model's limits) turns it into the step loop's request. This module imports no torch, so the
CLI and a job's driver check requests without loading it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from engine.config import GenerationConfig, check_request_id
from engine.core.structured.spec import TOOL_CHOICES
from engine.errors import ConfigError, InvalidRequestError, TokenOutOfVocabularyError

__all__ = ["GenerationRequest", "MAX_TOP_LOGPROBS", "as_request"]

MAX_TOP_LOGPROBS = 20

# the fields whose rules (types, ranges) are the config's generation section's: one table for both
GENERATION_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_tokens", "ignore_eos", "keep_logits",
                     "payload_top_tokens")


def _ints(value: Any, name: str) -> tuple[int, ...] | None:
    """A sequence of token ids as a tuple, checked without the model: ints (not bools, floats or
    strings) >= 0; the vocabulary's upper bound is the processor's."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise InvalidRequestError(f"`{name}` must be a list of token ids, got {type(value).__name__}",
                                  parameter=name, value=value)
    for i, token in enumerate(value):
        if type(token) is not int:
            raise InvalidRequestError(f"`{name}[{i}]` must be an int token id, got {token!r}",
                                      parameter=f"{name}[{i}]", value=token)
        if token < 0:
            raise TokenOutOfVocabularyError(f"`{name}[{i}]` must be a token id >= 0, got {token}",
                                            parameter=f"{name}[{i}]", value=token)
    return tuple(value)


def _messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """Chat messages as the chat template reads them: each ``{role: str, content: str}``. An
    assistant message that carries ``tool_calls`` may have null (or no) content, as OpenAI's do:
    it is read as empty text. Any other content that is not a string (null, an object, a number)
    would fail inside the template, so it is refused here, naming the message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("`messages` must be a non-empty list of {role, content} objects",
                                  parameter="messages", value=type(messages).__name__)
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"`messages[{i}]` must be an object with a string `role`, got {message!r}"[:300],
                                      parameter=f"messages[{i}]", value=message)
        message = dict(message)
        content = message.get("content")
        if content is None and message["role"] == "assistant" and message.get("tool_calls"):
            message["content"] = ""
        elif not isinstance(content, str):
            shown = "nothing" if "content" not in message else "null" if content is None else \
                f"{type(content).__name__} {content!r}"[:120]
            raise InvalidRequestError(f"`messages[{i}].content` must be a string (null only on an assistant message "
                                      f"with tool_calls), got {shown}", parameter=f"messages[{i}].content",
                                      value=content)
        out.append(message)
    return tuple(out)


def _check_tools(tools: Sequence[Mapping[str, Any]]) -> None:
    """OpenAI's tool shape: ``{"type": "function", "function": {"name": str, "parameters": {...}}}``
    (mods and the chat template read these; a malformed one would fail deep inside them)."""
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, Mapping):
            raise InvalidRequestError(f"`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{...}}}}, "
                                      f"got {dict(tool)!r}"[:300], parameter=f"tools[{i}]", value=dict(tool))
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise InvalidRequestError(f"`tools[{i}].function.name` must be a non-empty string of at most 64 "
                                      f"characters, got {name!r}"[:300], parameter=f"tools[{i}].function.name",
                                      value=name)
        if "parameters" in function and not isinstance(function["parameters"], Mapping):
            raise InvalidRequestError(f"`tools[{i}].function.parameters` must be a JSON-schema object, got "
                                      f"{function['parameters']!r}"[:300], parameter=f"tools[{i}].function.parameters",
                                      value=function["parameters"])


_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")


def _check_response_format(response_format: Any) -> None:
    """OpenAI's ``response_format``: ``{"type": "text" | "json_object"}`` or ``{"type":
    "json_schema", "json_schema": {"name": str, "schema": {...}}}``."""
    if not isinstance(response_format, Mapping):
        raise InvalidRequestError(f"`response_format` must be an object, got {response_format!r}"[:300],
                                  parameter="response_format", value=response_format)
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMATS:
        raise InvalidRequestError(f"`response_format.type` must be one of {', '.join(_RESPONSE_FORMATS)}, got "
                                  f"{kind!r}", parameter="response_format.type", value=kind)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec.get("name"):
            raise InvalidRequestError("`response_format.json_schema` must be an object with a non-empty `name` "
                                      f"(and a `schema`), got {spec!r}"[:300], parameter="response_format.json_schema",
                                      value=spec)
        if "schema" in spec and not isinstance(spec["schema"], Mapping):
            raise InvalidRequestError(f"`response_format.json_schema.schema` must be a JSON-schema object, got "
                                      f"{spec['schema']!r}"[:300], parameter="response_format.json_schema.schema",
                                      value=spec["schema"])
    if kind in ("regex", "grammar"):  # raylens extensions: {"type": "regex", "regex": "..."} and the like
        text = response_format.get(kind)
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"`response_format.{kind}` must be a non-empty string (response_format "
                                      f"{{\"type\": \"{kind}\", \"{kind}\": \"...\"}}), got {text!r}"[:300],
                                      parameter=f"response_format.{kind}", value=text)


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token id (an int, or its decimal string as JSON sends it) -> a bias
    in [-100, 100]; the vocabulary's bound is the processor's."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise InvalidRequestError(f"`logit_bias` must be an object of token id -> bias, got {bias!r}"[:300],
                                  parameter="logit_bias", value=bias)
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key if type(key) is int else int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if token is None or token < 0:
            raise InvalidRequestError(f"`logit_bias` keys must be token ids (ints >= 0 or their decimal strings), "
                                      f"got {key!r}", parameter="logit_bias", value=key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise InvalidRequestError(f"`logit_bias[{token}]` must be a number in [-100, 100], got {value!r}",
                                      parameter=f"logit_bias[{token}]", value=value)
        out[token] = float(value)
    return out


def _penalty(value: Any, name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not -2.0 <= value <= 2.0):
        raise InvalidRequestError(f"`{name}` must be a number in [-2, 2] (0 is off), got {value!r}",
                                  parameter=name, value=value)


def _check_tool_choice(choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> None:
    """OpenAI's ``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type": "function",
    "function": {"name": ...}}``; the last two need ``tools`` (and the named one among them)."""
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidRequestError(f"`tool_choice` must be one of {', '.join(TOOL_CHOICES)} or {{\"type\": "
                                      f"\"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}",
                                      parameter="tool_choice", value=choice)
        if choice == "required" and not tools:
            raise InvalidRequestError("`tool_choice` must not be 'required' without `tools`, got no tools; pass "
                                      "the tools it may call", parameter="tool_choice", value=choice)
        return
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError(f"`tool_choice` must be none, auto, required or {{\"type\": \"function\", "
                                  f"\"function\": {{\"name\": ...}}}}, got {choice!r}"[:300],
                                  parameter="tool_choice", value=choice)
    names = [t["function"]["name"] for t in tools or ()]
    if name not in names:
        given = ", ".join(names) or "none given"
        raise InvalidRequestError(f"`tool_choice.function.name` must name one of `tools` ({given}), got {name!r}",
                                  parameter="tool_choice.function.name", value=name)


@dataclass(frozen=True)
class GenerationRequest:
    """What one caller asks for. Exactly one of ``prompt`` (a user turn, chat-templated),
    ``messages`` (OpenAI shape) or ``input_ids``. ``None`` means the config's default.

    ``mods``: callables, ``.py`` paths (``path.py:function`` picks one) or payload dicts, called in
    order. ``tools``/``response_format``: OpenAI shapes, read by mods through the conversation
    API. ``banned_tokens``: ids never sampled. ``repetition_penalty``: > 0, 1.0 is off.
    ``logit_bias``: token id -> bias in [-100, 100] added to its logit (string keys, as JSON sends
    them, are read as ids). ``min_tokens``: stop tokens are not drawn before that many tokens were
    generated (the grammar of a structured request still ends it where it must).
    ``presence_penalty``/``frequency_penalty``: OpenAI's, in [-2, 2], over the generated tokens.
    ``response_format``: ``text``, ``json_object``, ``json_schema`` and the raylens extensions
    ``{"type": "regex", "regex": ...}`` and ``{"type": "grammar", "grammar": <Lark>}``, enforced by
    a token mask (``docs/structured-outputs.md``). ``tool_choice``: ``none``/``auto`` (free text; a
    mod may still call tools), ``required`` or ``{"type": "function", "function": {"name": ...}}``
    (the output is one tool call, enforced, finish reason ``tool_calls``).
    ``parallel_tool_calls``: accepted either way; an enforced tool choice generates exactly one call.
    ``top_logprobs``: None no log-probs, 0 each token's, k ≤ 20 also its k best alternatives.
    ``attention="all"``: each streamed token carries every layer's newest attention row.
    ``max_tokens_cap``: a server's limit on ``max_tokens`` (its default is the config's, capped).
    """

    prompt: str | None = None
    # any sequence is taken; each is stored as a tuple (the request is frozen and hashable)
    messages: Sequence[dict[str, Any]] | None = None
    input_ids: Sequence[int] | None = None
    tools: Sequence[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    mods: tuple[Any, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_tokens: tuple[int, ...] | None = None
    ignore_eos: bool | None = None
    banned_tokens: tuple[int, ...] = ()
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None
    attention: Literal["all"] | None = None
    request_id: str | None = None
    max_tokens_cap: int | None = field(default=None, repr=False)
    prefix_cache: bool | None = None  # reuse a cached prompt prefix (None: backend.prefix_caching)
    keep_logits: bool | None = None  # the result's ForwardPass events keep their logits (None: generation.keep_logits)
    # its payload's ForwardPass records list each step's top tokens (None: generation.payload_top_tokens)
    payload_top_tokens: bool | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("prompt", "messages", "input_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise InvalidRequestError(f"give exactly one of prompt, messages, input_ids; got {given or 'none'}",
                                      parameter="prompt")
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt.strip()):
            raise InvalidRequestError("`prompt` must be a non-empty string", parameter="prompt", value=self.prompt)
        if self.messages is not None:
            object.__setattr__(self, "messages", _messages(self.messages))
        if self.input_ids is not None:
            ids = _ints(self.input_ids, "input_ids")
            if not ids:
                raise InvalidRequestError("`input_ids` must be a non-empty list of token ids, got []",
                                          parameter="input_ids", value=[])
            object.__setattr__(self, "input_ids", ids)
        if self.tools is not None:
            if not isinstance(self.tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in self.tools):
                raise InvalidRequestError(f"`tools` must be a list of objects, got {self.tools!r}"[:300],
                                          parameter="tools", value=self.tools)
            object.__setattr__(self, "tools", tuple(dict(t) for t in self.tools))
            _check_tools(self.tools)
        if self.response_format is not None:
            _check_response_format(self.response_format)
        if self.tool_choice is not None:
            _check_tool_choice(self.tool_choice, self.tools)
        if self.parallel_tool_calls is not None and not isinstance(self.parallel_tool_calls, bool):
            raise InvalidRequestError(f"`parallel_tool_calls` must be true or false, got {self.parallel_tool_calls!r}",
                                      parameter="parallel_tool_calls", value=self.parallel_tool_calls)
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        _penalty(self.presence_penalty, "presence_penalty")
        _penalty(self.frequency_penalty, "frequency_penalty")
        mt = self.min_tokens
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 0):
            raise InvalidRequestError(f"`min_tokens` must be an integer >= 0, got {mt!r}", parameter="min_tokens",
                                      value=mt)
        if mt is not None and isinstance(self.max_tokens, int) and mt > self.max_tokens:
            raise InvalidRequestError(f"`min_tokens` must be <= max_tokens ({self.max_tokens}), got {mt}",
                                      parameter="min_tokens", value=mt)
        mods = self.mods if self.mods is not None else ()
        if isinstance(mods, (str, bytes, Mapping)) or callable(mods) or not isinstance(mods, Sequence):
            mods = (mods,)
        object.__setattr__(self, "mods", tuple(mods))
        object.__setattr__(self, "stop_tokens", _ints(self.stop_tokens, "stop_tokens"))
        object.__setattr__(self, "banned_tokens", _ints(self.banned_tokens, "banned_tokens") or ())
        if self.prefix_cache is not None and not isinstance(self.prefix_cache, bool):
            raise InvalidRequestError(f"`prefix_cache` must be true, false or null, got {self.prefix_cache!r}",
                                      parameter="prefix_cache", value=self.prefix_cache)
        if self.ignore_eos is not None and not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"`ignore_eos` must be true or false, got {self.ignore_eos!r}",
                                      parameter="ignore_eos", value=self.ignore_eos)
        self._check_generation_fields()
        rp = self.repetition_penalty
        if rp is not None and not (isinstance(rp, (int, float)) and not isinstance(rp, bool)
                                   and 0 < rp < math.inf):
            raise InvalidRequestError(f"`repetition_penalty` must be a finite number > 0, got {rp!r}",
                                      parameter="repetition_penalty", value=rp)
        lp = self.top_logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not -1 <= lp <= MAX_TOP_LOGPROBS):
            raise InvalidRequestError(f"`top_logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}] (or -1 or "
                                      f"null: none), got {lp!r}",
                                      parameter="top_logprobs", value=lp)
        if self.attention not in (None, "all"):
            raise InvalidRequestError(f"`attention` must be None or 'all', got {self.attention!r}",
                                      parameter="attention", value=self.attention)
        if self.request_id is not None:
            check_request_id(self.request_id)
        cap = self.max_tokens_cap
        if cap is not None and self.max_tokens is not None and self.max_tokens > cap:
            raise InvalidRequestError(f"`max_tokens` must be <= {cap} on this server, got {self.max_tokens}",
                                      parameter="max_tokens", value=self.max_tokens)

    def _check_generation_fields(self) -> None:
        """Sampling values by the config's own rules (one table for a YAML default and a request)."""
        given = {name: getattr(self, name) for name in GENERATION_FIELDS if getattr(self, name) is not None}
        try:
            GenerationConfig(**given)
        except ConfigError as err:
            raise InvalidRequestError(str(err), parameter=err.parameter, value=err.value) from None

    @property
    def logprobs(self) -> int:
        """-1: none; 0: each token's log-prob; k > 0: also its k best alternatives."""
        return -1 if self.top_logprobs is None else self.top_logprobs

    def replace(self, **changes: Any) -> "GenerationRequest":
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)

    @property
    def user_prompt(self) -> str | None:
        """The user's own words, for the ingest payload: ``prompt`` or the first user message's text."""
        if self.prompt is not None:
            return self.prompt
        return next((m.get("content") for m in self.messages or () if m.get("role") == "user"
                     and isinstance(m.get("content"), str)), None)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What mods read through ``get_conversation``: the messages, or the prompt as one user turn."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}] if self.prompt is not None else []


def as_request(request: GenerationRequest | str | None, fields: dict[str, Any]) -> GenerationRequest:
    """The caller's request: a :class:`GenerationRequest` as it is, or one built from keyword
    fields (a positional string is the prompt); an unknown field is an error naming it."""
    if isinstance(request, GenerationRequest):
        if fields:
            raise InvalidRequestError(f"pass a GenerationRequest or its fields as keywords, not both; got "
                                      f"{sorted(fields)}", parameter=sorted(fields)[0])
        return request
    if request is not None:
        fields = {**fields, "prompt": request}
    unknown = sorted(set(fields) - _REQUEST_FIELDS)
    if unknown:
        raise InvalidRequestError(f"`{unknown[0]}` is not a request field; the fields are "
                                  f"{', '.join(sorted(_REQUEST_FIELDS))}", parameter=unknown[0])
    return GenerationRequest(**fields)


_REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationRequest))
