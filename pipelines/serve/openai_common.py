"""What every OpenAI route shares: the model string's mods, stop strings, ``stream_options``, the
fingerprint, SSE framing and the mapping of a mod's ToolCalls payload to OpenAI ``tool_calls``."""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Request

from .errors import ApiError, ErrorCode
from .service import Service
from .settings import raylens_version

__all__ = ["service_of", "resolve_model", "fingerprint", "include_usage", "parse_stops", "tool_calls", "sse",
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


def include_usage(options: dict[str, Any] | None, stream: bool) -> bool:
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
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        name = fn.get("name") or call.get("name") or ""
        args = fn.get("arguments", call.get("arguments"))
        calls.append({"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": call.get("type") or "function",
                      "function": {"name": name,
                                   "arguments": args if isinstance(args, str) else json.dumps(args or {})}})
    return calls
