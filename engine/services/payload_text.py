"""Text the ingest backend's database refuses, made storable before a payload is sent.

The backend keeps payloads in Postgres, whose ``text`` and ``jsonb`` hold no NUL character (a
``\\u0000`` in the JSON fails the insert: the answer is a 500) and no lone UTF-16 surrogate (not
valid UTF-8). A mod that logs ``"\\x00"``, or a model whose byte-level token decodes to it, would
otherwise make a payload that can never be delivered. :func:`storable` replaces each NUL with
``U+2400`` (␀, the symbol for NUL) and each lone surrogate with ``U+FFFD``, in every string of
the payload — keys included — and says so in the payload itself: ``request.inference_stats.
text_replaced`` holds the counts and the fields, and a ``WARNING`` entry in ``mod_logs`` names
them when a mod's record held one (a log entry must belong to a mod call). A payload with nothing
to replace is returned as it is.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["storable", "unstorable_fields", "NUL_REPLACEMENT", "SURROGATE_REPLACEMENT"]

NUL_REPLACEMENT = "\u2400"
SURROGATE_REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")
_MOD_RECORDS = ("mod_logs", "mod_calls", "actions")


def _clean(text: str, counts: dict[str, int]) -> str:
    if text.isascii():
        if "\x00" not in text:
            return text
    else:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (only these fail to encode)
            counts["surrogates"] += len(_SURROGATE.findall(text))
            text = _SURROGATE.sub(SURROGATE_REPLACEMENT, text)
    nul = text.count("\x00")
    if nul:
        counts["nul"] += nul
        text = text.replace("\x00", NUL_REPLACEMENT)
    return text


def _walk(value: Any, path: str, counts: dict[str, int], fields: list[str]) -> Any:
    if isinstance(value, str):
        before = counts["nul"] + counts["surrogates"]
        cleaned = _clean(value, counts)
        if counts["nul"] + counts["surrogates"] != before:
            fields.append(path)
        return cleaned
    if isinstance(value, dict):
        return {_walk(k, f"{path}.<key>", counts, fields) if isinstance(k, str) else k:
                _walk(v, f"{path}.{k}" if path else str(k), counts, fields) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, f"{path}[{i}]", counts, fields) for i, v in enumerate(value)]
    return value


def unstorable_fields(payload: Any) -> list[str]:
    """Where ``payload`` holds text Postgres refuses (``mod_logs[2].log_message``, …); [] if none."""
    fields: list[str] = []
    _walk(payload, "", {"nul": 0, "surrogates": 0}, fields)
    return fields


def storable(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with every string the backend's database can store (see the module's
    docstring); the same object when nothing needed replacing."""
    counts, fields = {"nul": 0, "surrogates": 0}, []  # type: ignore[var-annotated]
    cleaned = _walk(payload, "", counts, fields)
    if not fields:
        return payload
    request = cleaned.setdefault("request", {})
    stats = request.get("inference_stats")
    stats = dict(stats) if isinstance(stats, dict) else {}
    stats["text_replaced"] = {"nul": counts["nul"], "surrogates": counts["surrogates"], "fields": fields[:50]}
    request["inference_stats"] = stats
    _note_in_mod_logs(cleaned, counts, fields)
    return cleaned


def _note_in_mod_logs(payload: dict[str, Any], counts: dict[str, int], fields: list[str]) -> None:
    """A WARNING mod-log entry, on the mod call of the first mod record that held such text."""
    calls = payload.get("mod_calls") or []
    for field in fields:
        match = re.match(r"(mod_logs|mod_calls|actions)\[(\d+)\]", field)
        if match is None:
            continue
        kind, index = match.group(1), int(match.group(2))
        record = (payload.get(kind) or [])[index]
        call = index if kind == "mod_calls" else record.get("mod_call_sequence")
        if not isinstance(call, int) or not 0 <= call < len(calls):
            continue
        where = ", ".join(f for f in fields if f.startswith(_MOD_RECORDS))[:1000]
        message = (f"[raylens] replaced {counts['nul']} NUL character(s) with U+2400 and {counts['surrogates']} "
                   f"lone surrogate(s) with U+FFFD in {where}: the ingest backend's database stores neither in text "
                   "(request.inference_stats.text_replaced lists every field)")
        payload.setdefault("mod_logs", []).append({
            "mod_call_sequence": call, "mod_name": str(calls[call].get("mod_name", ""))[:255],
            "log_message": message, "log_level": "WARNING"})
        return
