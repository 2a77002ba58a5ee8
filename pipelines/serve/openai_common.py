"""What every OpenAI route shares: the model string's mods, stop strings, ``stream_options``, the
fingerprint, SSE framing and the mapping of a mod's ToolCalls payload to OpenAI ``tool_calls``."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from .errors import ApiError, ErrorCode
from .service import Service
from .settings import raylens_version

__all__ = ["service_of", "resolve_model", "fingerprint", "StreamOptions", "stream_options", "usage", "parse_stops", "tool_calls", "sse",
           "refuse_unsupported", "UNSUPPORTED", "SSE_DONE", "SSE_HEADERS"]

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def service_of(request: Request) -> Service:
    return request.app.state.service


def resolve_model(service: Service, model: str) -> list[Any]:
    """The mods a ``model`` string selects: none for the model id, one for ``<model id>/<mod>``."""
    base = service.model_id
    if model == base:
        return []
    if model.startswith(base + "/"):
        return [service.mod(model[len(base) + 1:])]
    raise ApiError(ErrorCode.NOT_FOUND, f"`model` must be {base!r} or {base!r}/<registered mod>, got {model!r}. "
                                        f"See GET /v1/models.", "model")


def fingerprint() -> str:
    """``system_fingerprint``: this server's build (OpenAI's reference wants a string, or nothing)."""
    return f"raylens-{raylens_version()}"


@dataclass(frozen=True)
class StreamOptions:
    """``stream_options``. ``include_usage``: one more chunk after the last, ``choices: []`` and
    the ``usage`` (OpenAI). ``continuous``: ``continuous_usage_stats`` (vLLM's extension, which
    guidellm sends): every chunk also carries the usage so far; only with ``include_usage``."""

    include_usage: bool = False
    continuous: bool = False


def stream_options(options: dict[str, Any] | None, stream: bool) -> StreamOptions:
    """``stream_options``: ``include_usage`` and ``continuous_usage_stats`` (bools), only with ``stream``."""
    if options is None:
        return StreamOptions()
    if not stream:
        raise ApiError(ErrorCode.INVALID_REQUEST, "`stream_options` must be used with `stream: true`, got "
                                                  "stream false.", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`stream_options` must hold only include_usage and "
                                                  f"continuous_usage_stats, got {', '.join(unknown)}.",
                       f"stream_options.{unknown[0]}")
    values = {}
    for name in ("include_usage", "continuous_usage_stats"):
        value = options.get(name, False)
        if not isinstance(value, bool):
            raise ApiError(ErrorCode.INVALID_REQUEST, f"`stream_options.{name}` must be true or false, got "
                                                      f"{value!r}.", f"stream_options.{name}")
        values[name] = value
    return StreamOptions(values["include_usage"], values["include_usage"] and values["continuous_usage_stats"])


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


#: OpenAI request fields this text-only server cannot honour: refused when set, never ignored
UNSUPPORTED = {
    "audio": "null (this model reads and writes text only)",
    "modalities": 'null or ["text"] (this model writes text only)',
    "prediction": "null (no predicted outputs)",
    "web_search_options": "null (no web search)",
    "functions": "null: use `tools` (the deprecated `functions` is not read)",
    "function_call": "null: use `tools` (the deprecated `function_call` is not read)",
}


def refuse_unsupported(extra: dict[str, Any] | None) -> None:
    """A 400 naming the first field of :data:`UNSUPPORTED` the body sets (``extra``: the fields
    the body's model does not declare)."""
    for name, constraint in UNSUPPORTED.items():
        value = (extra or {}).get(name)
        if value is None or (name == "modalities" and value == ["text"]):
            continue
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`{name}` must be {constraint}, got {str(value)[:80]}.", name)


def parse_stops(stop: str | list[str] | None) -> list[str]:
    """``stop``: one string or up to 4, none empty."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not isinstance(s, str) or not s for s in stops):
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`stop` must be up to 4 non-empty strings, got {stops!r}.", "stop")
    return stops


def sse(body: dict[str, Any]) -> str:
    """One server-sent event carrying ``body`` as JSON."""
    return f"data: {json.dumps(body)}\n\n"


def tool_calls(raw: Any) -> list[dict[str, Any]]:
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
        fn = call["function"] if isinstance(call.get("function"), dict) else {}
        name = fn.get("name") or call.get("name") or ""
        args = fn.get("arguments", call.get("arguments"))
        calls.append({"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": call.get("type") or "function",
                      "function": {"name": name,
                                   "arguments": args if isinstance(args, str) else json.dumps(args or {})}})
    return calls
