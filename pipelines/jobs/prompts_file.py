"""Reading a prompts file: one JSON request per line, every value checked before anything runs.

A line holds ``prompt`` (a user turn), ``messages`` (a chat) or ``input_ids``, and optionally
``mods`` (mod file paths, ``file.py:function``, or payload objects), ``request_id``,
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_tokens``, ``ignore_eos``
and ``tools``.

Why everything is checked here: a job runs on shared actors, and a value the engine refuses half
way through (an out-of-range ``top_p``) used to kill the whole job with a traceback naming no
line. The sampling values go through the engine's own :class:`engine.config.GenerationConfig`
checks (ranges, finite floats, 32-bit integers, 64-bit seeds) and the request id through
:func:`engine.config.check_request_id`, so the two can never disagree. Only the shape of the
prompt itself (:data:`_SHAPES`) is restated here, because the engine checks it while tokenizing,
which needs the model. A line that still fails at run time fails alone (``pipelines.jobs.generate``).

Mods are read here to be shipped as payloads, but their code is only *parsed*
(:func:`mods.loading.check_payload`, :func:`mods.loading.payload_for_file`): a prompts file is
checked on the submitting machine, where no mod code may run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.errors import InvalidRequestError

__all__ = ["InputError", "PromptLine", "read_prompts", "parse_line"]

_PARAMS: dict[str, type | tuple[type, ...]] = {
    "max_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int, "seed": int,
    "stop_tokens": list, "tools": list, "ignore_eos": bool}
_SOURCES = ("prompt", "messages", "input_ids")
_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop_tokens")
_INT32 = 2**31 - 1


class InputError(InvalidRequestError):
    """A prompts file problem; the message names the file and line. Fix the file (exit code 2)."""


@dataclass(frozen=True)
class PromptLine:
    line: int
    request: dict[str, Any]  # Engine.generate keyword arguments, mods as payload dicts


def _ints(value: Any, low: int, high: int) -> bool:
    return isinstance(value, list) and all(type(v) is int and low <= v <= high for v in value)


#: What ``Engine.encode`` requires of the prompt, checked without a tokenizer: (field, ok, constraint).
_SHAPES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("input_ids", lambda v: bool(v) and _ints(v, 0, _INT32), f"a non-empty list of token ids in [0, {_INT32}]"),
    ("prompt", lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string"),
    ("messages", lambda v: isinstance(v, list) and bool(v) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in v),
     "a non-empty list of objects with a string `role`"),
    ("tools", lambda v: all(isinstance(t, dict) for t in v), "a list of objects (OpenAI tool shapes)"),
)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}… ({len(text)} characters)"


def _check_values(data: dict[str, Any], where: str) -> None:
    """The engine's own checks (GenerationConfig, check_request_id), then :data:`_SHAPES`."""
    from engine.config import GenerationConfig, check_request_id
    from engine.errors import ConfigError

    try:
        dataclasses.replace(GenerationConfig(), **{k: data[k] for k in _SAMPLING if k in data})
        if "request_id" in data:
            check_request_id(data["request_id"])
    except (ConfigError, InvalidRequestError) as err:
        raise InputError(f"{where}: {err}", parameter=err.parameter, value=err.value) from None
    for name, ok, constraint in _SHAPES:
        if name in data and not ok(data[name]):
            raise InputError(f"{where}: `{name}` must be {constraint}, got {_shown(data[name])}", parameter=name,
                             value=data[name])


def _mod_payloads(specs: Any, where: str) -> list[dict[str, Any]]:
    from mods.loading import ModPayloadError, check_payload, payload_for_file

    if not isinstance(specs, list):
        raise InputError(f"{where}: `mods` must be a list of mod file paths or payload objects")
    payloads = []
    for spec in specs:
        try:
            if isinstance(spec, dict):
                check_payload(spec)  # parses; the code runs only on the generator
                payloads.append(dict(spec))
            elif isinstance(spec, str):
                payloads.append(payload_for_file(spec))  # the code travels; the path need not exist there
            else:
                raise InputError(f"{where}: a mod must be a path string or a payload object, got {_shown(spec)}")
        except ModPayloadError as err:
            raise InputError(f"{where}: bad mod: {err}") from None
    return payloads


def _refuse_constant(name: str) -> Any:
    """Python's json reads NaN and Infinity; strict JSON (and the ingest backend) does not."""
    raise ValueError(f"{name} is not a JSON number; give a finite value")


def parse_line(text: str, where: str) -> dict[str, Any]:
    """One line → the keyword arguments of ``Engine.generate`` (mods as payloads), or InputError."""
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except ValueError as err:
        raise InputError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise InputError(f"{where}: each line must be a JSON object")
    given = [k for k in _SOURCES if k in data]
    if len(given) != 1:
        raise InputError(f"{where}: give exactly one of prompt, messages, input_ids (got {given or 'none'})")
    unknown = sorted(set(data) - set(_SOURCES) - set(_PARAMS) - {"mods", "request_id"})
    if unknown:
        raise InputError(f"{where}: unknown field(s) {', '.join(unknown)}; known: "
                         f"{', '.join(list(_SOURCES) + list(_PARAMS) + ['mods', 'request_id'])}")
    for key, kind in _PARAMS.items():
        if key in data and (not isinstance(data[key], kind) or isinstance(data[key], bool) and kind is not bool):
            raise InputError(f"{where}: `{key}` has the wrong type ({type(data[key]).__name__})", parameter=key,
                             value=data[key])
    _check_values(data, where)
    request = {k: v for k, v in data.items() if k != "mods"}
    request["mods"] = _mod_payloads(data.get("mods", []), where)
    request.setdefault("request_id", str(uuid.uuid4()))
    return request


def read_prompts(path: str | Path) -> list[PromptLine]:
    """Every request of a prompts file, checked; :class:`InputError` names the first bad line."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"prompts file `{file}` does not exist")
    lines = []
    for number, text in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if text.strip():
            lines.append(PromptLine(number, parse_line(text, f"{file}:{number}")))
    if not lines:
        raise InputError(f"prompts file `{file}` holds no requests")
    return lines
