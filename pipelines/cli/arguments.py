"""What several ``raylens`` commands share: the usage error, JSON files, and the request source
(exactly one of ``--prompt``, ``--messages-file``, ``--input-ids``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["UsageError"]


class UsageError(Exception):
    """A command-line argument is wrong."""


def _read_json(path: str, what: str) -> Any:
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{what} `{path}` does not exist")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise UsageError(f"{what} `{path}` must be UTF-8 text, got byte 0x{err.object[err.start]:02x} at offset "
                         f"{err.start}; save it as UTF-8") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{what} `{path}` is not valid JSON: line {err.lineno}: {err.msg}") from None


def _messages_from_file(path: str) -> tuple[Any, Any, Any]:
    """A chat file is a JSON list of messages, or ``{"messages", "tools", "response_format"}``."""
    data = _read_json(path, "messages file")
    if isinstance(data, dict):
        return data.get("messages"), data.get("tools"), data.get("response_format")
    return data, None, None


def _add_source(p: argparse.ArgumentParser) -> None:
    """Exactly one of --prompt, --messages-file, --input-ids: what a request reads."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (chat-templated)")
    src.add_argument("--messages-file", help="JSON chat: a list of messages, or {messages, tools, response_format}")
    src.add_argument("--input-ids", help="comma-separated token ids, used as is")


def _source(args: argparse.Namespace) -> tuple[Any, Any, Any, list[int] | None]:
    """``(messages, tools, response_format, input_ids)`` from :func:`_add_source`'s arguments."""
    messages = tools = response_format = None
    if args.messages_file:
        messages, tools, response_format = _messages_from_file(args.messages_file)
    return messages, tools, response_format, _input_ids(args.input_ids)


def _input_ids(text: str | None) -> list[int] | None:
    """``--input-ids 1,2,3`` as a list (None when not given)."""
    if not text:
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError("--input-ids must be comma-separated integers") from None
