"""The conversation API mods read (``shared.conversation`` = ``quote_mod_sdk.conversation``).

The engine stores each request's chat ``messages`` (exactly as the client sent them) and its
``schemas`` (the response-format schema, then the tools) before generation; a mod reads them with
:func:`get_conversation` / :func:`get_schemas` while ModManager has set the request as the active
one in a context variable. The stores are in this process's memory, keyed by request id — the
original wrote ``/tmp/<request_id>`` files (request ids became file paths); nothing here touches
the file system.

Access rules: with no id, the active request is read (none active → ``[]``); an
explicit id that is not the active one raises ``PermissionError``, so a mod cannot read another
request's conversation. Reads return deep copies.
"""

from __future__ import annotations

import copy
import json
import threading
from contextvars import ContextVar, Token
from typing import Any, Iterable

__all__ = [
    "set_conversation",
    "get_conversation",
    "set_schemas",
    "get_schemas",
    "clear_conversation",
    "clear_request",
    "push_request_context",
    "pop_request_context",
    "tool_call_pairs",
    "schemas_from_request",
    "append_debug_logs",
    "read_debug_logs",
]

_active: ContextVar[str | None] = ContextVar("raylens_active_request", default=None)
_lock = threading.Lock()
_conversations: dict[str, list[dict[str, Any]]] = {}
_schemas: dict[str, list[Any]] = {}
_debug: dict[str, list[str]] = {}


def _json_copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


def push_request_context(request_id: str | None) -> Token | None:
    """Make ``request_id`` the active request of this context (None: no-op)."""
    return _active.set(request_id) if request_id is not None else None


def pop_request_context(token: Token | None) -> None:
    if token is not None:
        _active.reset(token)


def _resolve(request_id: str | None) -> str | None:
    active = _active.get()
    if request_id is None:
        return active
    if request_id != active:
        raise PermissionError(f"a mod may only read its own request's conversation (active: {active!r}, "
                              f"asked: {request_id!r})")
    return request_id


def set_conversation(request_id: str, messages: list[dict[str, Any]]) -> None:
    if not isinstance(request_id, str):
        raise TypeError("request_id must be a str")
    with _lock:
        _conversations[request_id] = _json_copy(messages)


def get_conversation(request_id: str | None = None) -> list[dict[str, Any]]:
    rid = _resolve(request_id)
    if rid is None:
        return []
    with _lock:
        if rid not in _conversations:
            raise FileNotFoundError(f"no conversation is stored for request {rid!r}")  # the original's type
        return copy.deepcopy(_conversations[rid])


def set_schemas(request_id: str, schemas: list[Any]) -> None:
    if not isinstance(request_id, str):
        raise TypeError("request_id must be a str")
    with _lock:
        _schemas[request_id] = _json_copy(schemas)


def get_schemas(request_id: str | None = None) -> list[Any]:
    rid = _resolve(request_id)
    if rid is None:
        return []
    with _lock:
        if rid not in _schemas:
            raise FileNotFoundError(f"no schemas are stored for request {rid!r}")
        return copy.deepcopy(_schemas[rid])


def clear_conversation(request_id: str) -> None:
    with _lock:
        del _conversations[request_id]


def clear_request(request_id: str) -> None:
    """Forget everything stored for a finished request."""
    with _lock:
        _conversations.pop(request_id, None)
        _schemas.pop(request_id, None)
        _debug.pop(request_id, None)


def schemas_from_request(response_format: Any, tools: Iterable[Any] | None) -> list[Any]:
    """The schema list of a chat request: the response format's JSON schema (or the whole
    response_format when it has none), then each tool verbatim."""
    schemas: list[Any] = []
    if response_format:
        json_schema = response_format.get("json_schema") if isinstance(response_format, dict) else None
        if json_schema:
            if isinstance(json_schema, dict) and "schema" in json_schema:
                schemas.append(json_schema["schema"])
        else:
            schemas.append(response_format)
    schemas.extend(tools or [])
    return schemas


def _response_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if content is None:
        return None
    if isinstance(content, list):
        parts: list[str] = []
        for item in content:
            if isinstance(item, str):
                parts.append(item)
            elif isinstance(item, dict):
                text = item.get("text") if isinstance(item.get("text"), str) else item.get("content")
                if isinstance(text, str):
                    parts.append(text)
            else:
                return None
        return "".join(parts) if parts else None
    try:
        return json.dumps(content)
    except (TypeError, ValueError):
        return str(content)


def tool_call_pairs(messages: list[dict[str, Any]] | None = None) -> list[tuple[dict[str, Any], str | None]]:
    """``(tool call, response text or None)`` for every assistant tool call, in order."""
    source = get_conversation() if messages is None else messages
    pairs: list[list[Any]] = []
    index: dict[str, int] = {}
    for message in source:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant":
            for call in message.get("tool_calls") or []:
                if isinstance(call, dict) and isinstance(call.get("id"), str):
                    index[call["id"]] = len(pairs)
                    pairs.append([copy.deepcopy(call), None])
        elif message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str):
            position = index.get(message["tool_call_id"])
            if position is not None:
                pairs[position][1] = _response_text(message.get("content"))
    return [(call, response) for call, response in pairs]


def append_debug_logs(request_id: str, text: str) -> None:
    """Engine-side debug text per request (kept in memory; mods do not call this)."""
    with _lock:
        _debug.setdefault(request_id, []).append(text)


def read_debug_logs(request_id: str) -> str:
    with _lock:
        return "".join(_debug.get(request_id, []))
