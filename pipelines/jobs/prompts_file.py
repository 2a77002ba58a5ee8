"""Reading a prompts file: one JSON request per line, every value checked before anything runs.

A line holds ``prompt`` (a user turn), ``messages`` (a chat) or ``input_ids``, and optionally any
other field of the engine's one request type, :class:`engine.core.inputs.GenerationRequest`
(``mods``: mod file paths, ``file.py:function``, or payload objects; ``request_id``,
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_tokens``, ``ignore_eos``,
``tools``, …).

Why everything is checked here: a job runs on shared actors, and a value the engine refuses half
way through (an out-of-range ``top_p``) used to kill the whole job with a traceback naming no
line. Each line becomes a ``GenerationRequest``, whose checks are the ones every door applies, so
a prompts file, the CLI, Python and the HTTP APIs give the same error for the same value (here
prefixed with the file and line). What needs the model (the vocabulary, the context length) is
checked by the generator; a line that still fails at run time fails alone (``pipelines.jobs.generate``).

Mods are read here to be shipped as payloads, but their code is only *parsed*
(:func:`mods.loading.check_payload`, :func:`mods.loading.payload_for_file`): a prompts file is
checked on the submitting machine, where no mod code may run.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.inputs import GenerationRequest
from engine.errors import InvalidRequestError

__all__ = ["InputError", "PromptLine", "read_prompts", "parse_line"]

# every request field a line may set (a server's cap is the server's, not a file's)
_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationRequest) if f.name != "max_tokens_cap")


class InputError(InvalidRequestError):
    """A prompts file problem; the message names the file and line. Fix the file (exit code 2)."""


@dataclass(frozen=True)
class PromptLine:
    line: int
    request: GenerationRequest  # mods as payload dicts


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}… ({len(text)} characters)"


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


def parse_line(text: str, where: str) -> GenerationRequest:
    """One line → its :class:`GenerationRequest` (mods as payloads, an id given), or InputError."""
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except ValueError as err:
        raise InputError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise InputError(f"{where}: each line must be a JSON object")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise InputError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(_FIELDS)}",
                         parameter=unknown[0])
    data["mods"] = _mod_payloads(data.get("mods", []), where)
    data.setdefault("request_id", str(uuid.uuid4()))
    try:
        return GenerationRequest(**data)
    except InvalidRequestError as err:
        raise InputError(f"{where}: {err}", parameter=err.parameter, value=err.value) from None


def read_prompts(path: str | Path) -> list[PromptLine]:
    """Every request of a prompts file, checked; :class:`InputError` names the first bad line."""
    file = Path(path)
    if not file.is_file():
        raise InputError(f"prompts file `{file}` does not exist")
    try:
        content = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"prompts file `{file}` must be UTF-8 text, got byte 0x{err.object[err.start]:02x} at offset "
                         f"{err.start}; save it as UTF-8") from None
    lines = []
    for number, text in enumerate(content.splitlines(), start=1):
        if text.strip():
            lines.append(PromptLine(number, parse_line(text, f"{file}:{number}")))
    if not lines:
        raise InputError(f"prompts file `{file}` holds no requests")
    return lines
