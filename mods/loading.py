"""Loading mods: from a ``.py`` file, from a payload dict (compat §3.3), or as given callables.

Legacy code imports this module as ``quote.mods.sdk_bridge``. Every path here installs the
legacy import names first (:mod:`mods.legacy_names`), so existing mod files load unchanged.

A mod *file* is executed as a fresh module under a private name, so two files with the same
stem never collide and re-loading a file gives fresh module state. The mod in it is the
function named after ``:`` (``path/to/mod.py:my_mod``), else the single ``@mod``-decorated
function the file defines.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .legacy_names import install_legacy_names
from .types import ModAction, ModEvent, Noop
from .validation import InvalidActionError, validate_action

__all__ = [
    "ModLoadError",
    "ModPayloadError",
    "load_mod_from_path",
    "load_mod_from_payload",
    "resolve_mods",
]


class ModPayloadError(ValueError):
    """A mod payload is malformed or its mod failed (the original's name and base class)."""


class ModLoadError(ModPayloadError):
    """A mod file cannot be loaded; the message says which file and what to change."""


ModSpec = Callable[..., Any] | str | Path | Mapping[str, Any]


# ------------------------------------------------------------------------------------ from a file


def _split_entry(spec: str | Path) -> tuple[Path, str | None]:
    text = str(spec)
    head, sep, tail = text.rpartition(":")
    if sep and head.endswith(".py") and tail.isidentifier():
        return Path(head), tail
    return Path(text), None


def _decorated_functions(module: types.ModuleType) -> list[str]:
    return sorted(
        name
        for name, value in vars(module).items()
        if callable(value) and hasattr(value, "__wrapped__")
        and getattr(getattr(value, "__wrapped__"), "__module__", None) == module.__name__
    )


def load_mod_from_path(spec: str | Path) -> Callable[..., Any]:
    """Load the mod in a Python file; ``"file.py:name"`` picks a function by name."""
    path, entry = _split_entry(spec)
    if not path.is_file():
        raise ModLoadError(f"mod file `{path}` does not exist; pass the path of a .py file that defines a @mod function")
    if path.suffix != ".py":
        raise ModLoadError(f"mod file `{path}` must be a .py file")
    install_legacy_names()
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"raylens_mod_{resolved.stem}_{digest}"
    source = resolved.read_text(encoding="utf-8")
    try:
        code = compile(source, str(resolved), "exec")
    except SyntaxError as err:
        raise ModLoadError(f"mod file `{path}` has a syntax error at line {err.lineno}: {err.msg}") from None
    module = types.ModuleType(module_name)
    module.__file__ = str(resolved)
    module.__spec__ = importlib.util.spec_from_file_location(module_name, resolved)
    sys.modules[module_name] = module  # before exec, so dataclasses and pickling in the mod work
    try:
        exec(code, module.__dict__)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise ModLoadError(f"mod file `{path}` failed while loading: {type(err).__name__}: {err}") from err
    return _pick_entry(module, entry, where=f"`{path}`")


def _pick_entry(module: types.ModuleType, entry: str | None, *, where: str) -> Callable[..., Any]:
    if entry is not None:
        candidate = getattr(module, entry, None)
        if not callable(candidate):
            raise ModLoadError(f"{where} has no callable named `{entry}`")
        return candidate
    found = _decorated_functions(module)
    if len(found) == 1:
        return getattr(module, found[0])
    if not found:
        raise ModLoadError(f"{where} defines no @mod-decorated function; add one, or name it as FILE.py:function")
    raise ModLoadError(f"{where} defines several mods ({', '.join(found)}); pick one as FILE.py:function")


# --------------------------------------------------------------------------------- from a payload


def _bridge(candidate: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Wrap a payload mod as the original bridge did (compat §3.3), keeping the cause chained."""

    def wrapped(event: ModEvent, tokenizer: Any = None) -> ModAction:
        try:
            try:
                result = candidate(event, tokenizer)
            except TypeError:
                result = candidate(event)
        except Exception as err:
            raise ModPayloadError(f"Mod raised exception: {err}") from err
        if result is None:
            return Noop()
        if not isinstance(result, ModAction):
            raise ModPayloadError(f"Mod returned {type(result).__name__}, expected a ModAction")
        try:
            return validate_action(event, result)
        except InvalidActionError as err:
            raise ModPayloadError(str(err)) from err

    wrapped.__name__ = name
    wrapped.__qualname__ = name
    return wrapped


def _require_str(payload: Mapping[str, Any], key: str) -> str:
    value = payload.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ModPayloadError(f"mod payload field `{key}` must be a non-empty string, got {value!r}")
    return value


def _load_inline(payload: Mapping[str, Any], entrypoint: str) -> Callable[..., Any]:
    module_name = payload.get("module") or "client_mod"
    if not isinstance(module_name, str):
        raise ModPayloadError(f"mod payload field `module` must be a string, got {module_name!r}")
    module = types.ModuleType(module_name)
    module.__package__ = None
    sys.modules[module_name] = module
    try:
        exec(compile(textwrap.dedent(payload["source"]), f"<mod {module_name}>", "exec"), module.__dict__)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise ModPayloadError(f"inline mod `{module_name}` failed while loading: {type(err).__name__}: {err}") from err
    candidate = getattr(module, entrypoint, None)
    if not callable(candidate):
        raise ModPayloadError(f"inline mod `{module_name}` has no callable named `{entrypoint}`")
    return candidate


def load_mod_from_payload(payload: Mapping[str, Any]) -> Callable[..., Any]:
    """Load a mod from a payload dict: ``{"language": "python", "entrypoint", "source", ...}``."""
    if not isinstance(payload, Mapping):
        raise ModPayloadError(f"mod payload must be a JSON object, got {type(payload).__name__}")
    if payload.get("language") != "python":
        raise ModPayloadError("Only Python mods are supported in v0 (payload field `language` must be \"python\")")
    entrypoint = _require_str(payload, "entrypoint")
    install_legacy_names()
    source = payload.get("source")
    if isinstance(source, str) and source.strip():
        candidate = _load_inline(payload, entrypoint)
    else:
        raise ModPayloadError("mod payload needs `source`: a non-empty string of Python code")
    return _bridge(candidate, entrypoint)


# ------------------------------------------------------------------------------------ any of them


def resolve_mods(specs: Iterable[ModSpec] | None) -> list[Callable[..., Any]]:
    """Turn what a user passed as ``mods=`` into callables, in order."""
    resolved: list[Callable[..., Any]] = []
    for spec in specs or []:
        if isinstance(spec, (str, Path)):
            resolved.append(load_mod_from_path(spec))
        elif isinstance(spec, Mapping):
            resolved.append(load_mod_from_payload(spec))
        elif callable(spec):
            if not _takes_event_and_tokenizer(spec):
                raise ModLoadError(
                    f"mod {getattr(spec, '__name__', spec)!r} must accept (event, tokenizer); "
                    "decorate a handler with @mod to get that signature"
                )
            resolved.append(spec)
        else:
            raise ModLoadError(f"a mod must be a callable, a .py path or a payload dict, got {type(spec).__name__}")
    return resolved


def _takes_event_and_tokenizer(obj: Callable[..., Any]) -> bool:
    try:
        inspect.signature(obj, follow_wrapped=False).bind(None, None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True
