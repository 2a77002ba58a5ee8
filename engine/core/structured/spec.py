"""What a request constrains its output to, as plain data: :class:`GrammarSpec`, read from the
request's ``response_format`` and ``tool_choice`` without the model or the grammar library (so a
request is checked the same way at every door, and the spec's text is the compile cache's key).

Shapes (OpenAI's, plus two raylens extensions):

* ``{"type": "json_object"}``: any JSON object.
* ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``: an instance of the
  schema (no ``schema``: any JSON value).
* ``{"type": "regex", "regex": "..."}`` (raylens): text matching the regex, whole.
* ``{"type": "grammar", "grammar": "..."}`` (raylens): text of the Lark-syntax grammar (llguidance's
  dialect: ``start:`` rule, ``/regex/`` terminals).
* ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name": ...}}``: one JSON
  object ``{"name": <a tool's name>, "arguments": <an instance of that tool's parameters>}``,
  reported as a tool call. ``tool_choice`` wins over ``response_format`` (its output is no message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from engine.errors import GrammarError

__all__ = ["GrammarSpec", "grammar_spec", "tool_call_schema", "TOOL_CHOICES"]

TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class GrammarSpec:
    """``kind``: ``json`` (a JSON schema, ``json_object`` included), ``regex``, ``grammar`` or
    ``tool_call`` (a JSON schema whose instance becomes a tool call). ``source``: the schema as
    canonical JSON text, the regex, or the grammar text — the compile cache's key. ``parameter``:
    the request field an error about it names. ``tool_names``: the tools it may call."""

    kind: str
    source: str
    parameter: str
    tool_names: tuple[str, ...] = ()

    @property
    def is_tool_call(self) -> bool:
        return self.kind == "tool_call"


def _canonical(schema: Any, parameter: str) -> str:
    try:
        return json.dumps(schema, sort_keys=True, separators=(",", ":"))
    except RecursionError:  # deeper than Python's recursion limit (the grammar compiler allows 128)
        raise GrammarError(f"`{parameter}` must nest at most 128 levels deep, got far deeper; flatten it "
                           "with $defs", parameter=parameter) from None


def tool_call_schema(tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``{"name": <one tool's name>, "arguments": <its parameters>}``, any of ``tools``."""
    options = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]},
                                                         "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}


def _chosen_tools(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
    """The tools a ``tool_choice`` forces a call to (None: it forces none). The request checked
    the shape and that a named tool exists."""
    if tool_choice == "required":
        return list(tools)
    if isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        return [t for t in tools if t["function"]["name"] == name]
    return None


def grammar_spec(response_format: Mapping[str, Any] | None, tool_choice: Any,
                 tools: Sequence[Mapping[str, Any]] | None) -> GrammarSpec | None:
    """The request's constraint, or None when its output is free text."""
    chosen = _chosen_tools(tool_choice, tools or ())
    if chosen:
        return GrammarSpec("tool_call", _canonical(tool_call_schema(chosen), "tool_choice"), "tool_choice",
                           tuple(t["function"]["name"] for t in chosen))
    kind = response_format.get("type") if response_format else None
    if kind == "json_object":
        return GrammarSpec("json", _canonical({"type": "object"}, "response_format"), "response_format")
    if kind == "json_schema":
        schema = response_format["json_schema"].get("schema", {})  # type: ignore[index]
        parameter = "response_format.json_schema.schema"
        return GrammarSpec("json", _canonical(schema, parameter), parameter)
    if kind == "regex":
        return GrammarSpec("regex", response_format["regex"], "response_format.regex")  # type: ignore[index]
    if kind == "grammar":
        return GrammarSpec("grammar", response_format["grammar"], "response_format.grammar")  # type: ignore[index]
    return None
