"""Loading mods: from a ``.py`` file, from a payload dict (compat §3.3), or as given callables.

Legacy code imports this module as ``quote.mods.sdk_bridge``. Every path here installs the
legacy import names first (:mod:`mods.legacy_names`), so existing mod files load unchanged.

A mod *file* is executed as a fresh module under a private name, so two files with the same
stem never collide and re-loading a file gives fresh module state. The mod in it is the
function named after ``:`` (``path/to/mod.py:my_mod``), else the single ``@mod``-decorated
function the file defines.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.abc
import importlib.util
import inspect
import os
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
    "bundle_payload",
    "payload_for_file",
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
    if _has_relative_imports(source):  # a module of a package (e.g. examples/tau2/mod.py)
        return _load_package_file(resolved, entry, shown=path)
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


def _has_relative_imports(source: str) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.level > 0 for node in ast.walk(ast.parse(source)))


def _load_package_file(file: Path, entry: str | None, *, shown: Path) -> Callable[..., Any]:
    payload = bundle_payload(file, entry or "_")
    try:
        module = _import_bundle(payload["source"], payload["module"])
    except ModPayloadError as err:
        raise ModLoadError(f"mod file `{shown}`: {err}") from err.__cause__
    return _pick_entry(module, entry, where=f"`{shown}`")


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


def _bundle_module_name(path: str) -> str:
    """``a/b.py`` → ``a.b``; ``a/b/__init__.py`` → ``a.b`` (leading ``.``/``/`` stripped)."""
    clean = path.replace("\\", "/").lstrip("./")
    if clean.endswith("/__init__.py"):
        clean = clean[: -len("/__init__.py")]
    elif clean.endswith(".py"):
        clean = clean[:-3]
    return clean.replace("/", ".")


class _BundleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a bundle's in-memory modules (and the packages their names imply) during import."""

    def __init__(self, sources: Mapping[str, str]) -> None:
        self.code: dict[str, tuple[str, str, bool]] = {}  # module → (source, origin, is_package)
        for path, text in sources.items():
            name = _bundle_module_name(path)
            self.code[name] = (text, f"<bundle {path}>", path.replace("\\", "/").endswith("/__init__.py"))
        self.packages = {prefix for name in self.code for prefix in self._prefixes(name)}

    @staticmethod
    def _prefixes(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts))]

    def top_levels(self) -> set[str]:
        return {name.split(".")[0] for name in self.code}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname in self.code or fullname in self.packages:
            is_package = fullname in self.packages or self.code.get(fullname, ("", "", False))[2]
            return importlib.util.spec_from_loader(fullname, self, is_package=is_package)
        return None

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        if name in self.packages:
            module.__path__ = []  # type: ignore[attr-defined]
        module.__package__ = name if name in self.packages else name.rpartition(".")[0]
        if name in self.code:
            text, origin, _ = self.code[name]
            exec(compile(textwrap.dedent(text), origin, "exec"), module.__dict__)


def _import_bundle(sources: Mapping[str, str], module_name: str) -> types.ModuleType:
    """Import ``module_name`` from in-memory ``sources``; the finder is on ``sys.meta_path`` only
    during the import, and every earlier module of the bundle's top-level names is dropped first."""
    finder = _BundleFinder(sources)
    if module_name not in finder.code:
        raise ModPayloadError(f"bundle has no module `{module_name}` (it has {', '.join(sorted(finder.code))})")
    for name in list(sys.modules):
        if name.split(".")[0] in finder.top_levels():
            del sys.modules[name]
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(module_name)
    except Exception as err:
        raise ModPayloadError(f"bundle module `{module_name}` failed while loading: {type(err).__name__}: {err}") from err
    finally:
        sys.meta_path.remove(finder)


def _load_bundle(payload: Mapping[str, Any], entrypoint: str) -> Callable[..., Any]:
    sources = payload["source"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in sources.items()):
        raise ModPayloadError("a bundle's `source` must map relative paths (strings) to code (strings)")
    module_name = payload.get("module")
    if not isinstance(module_name, str) or not module_name:
        raise ModPayloadError("a bundle payload needs `module`: the dotted name of the entry module")
    module = _import_bundle(sources, module_name)
    candidate = getattr(module, entrypoint, None)
    if not callable(candidate):
        raise ModPayloadError(f"bundle module `{module_name}` has no callable named `{entrypoint}`")
    return candidate


def _load_from_directory(payload: Mapping[str, Any], entrypoint: str) -> Callable[..., Any]:
    module_name = payload.get("module")
    if not isinstance(module_name, str) or not module_name:
        raise ModPayloadError("a directory payload needs `module`: the dotted name of the entry module")
    relative = Path(*module_name.split(".")).with_suffix(".py")
    if payload.get("dir") is not None:
        start = Path(str(payload["dir"]))
        if not start.is_dir():
            raise ModPayloadError(f"mod payload `dir` {start} is not a directory")
    else:
        files = payload.get("files")
        if not isinstance(files, list) or not files:
            raise ModPayloadError("a directory payload needs `dir` or a non-empty `files` list")
        start = Path(os.path.commonpath([str(Path(str(f)).resolve().parent) for f in files]))
    start = start.resolve()
    root = next((d for d in (start, *start.parents) if (d / relative).is_file()), None)
    for entry in ([str(root)] if root is not None else [str(start), os.getcwd()]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    top = module_name.split(".")[0]  # a fresh import of the module's whole package family
    for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
        del sys.modules[name]
    try:
        module = importlib.import_module(module_name)
    except Exception as err:
        raise ModPayloadError(f"mod module `{module_name}` failed while loading: {type(err).__name__}: {err}") from err
    candidate = getattr(module, entrypoint, None)
    if not callable(candidate):
        raise ModPayloadError(f"mod module `{module_name}` has no callable named `{entrypoint}`")
    return candidate


def load_mod_from_payload(payload: Mapping[str, Any]) -> Callable[..., Any]:
    """Load a mod from a payload dict (compat §3.3), in this order of forms:

    * bundle — ``source`` maps relative paths to code, ``module`` names the entry module;
    * directory — ``dir`` (or ``files``) plus ``module``;
    * inline — ``source`` is the code of one module (``module`` defaults to ``client_mod``).
    """
    if not isinstance(payload, Mapping):
        raise ModPayloadError(f"mod payload must be a JSON object, got {type(payload).__name__}")
    if payload.get("language") != "python":
        raise ModPayloadError("Only Python mods are supported in v0 (payload field `language` must be \"python\")")
    entrypoint = _require_str(payload, "entrypoint")
    install_legacy_names()
    source = payload.get("source")
    if isinstance(source, Mapping) and source:
        candidate = _load_bundle(payload, entrypoint)
    elif payload.get("dir") is not None or payload.get("files"):
        candidate = _load_from_directory(payload, entrypoint)
    elif isinstance(source, str) and source.strip():
        candidate = _load_inline(payload, entrypoint)
    else:
        raise ModPayloadError("mod payload needs `source` (code, or a {path: code} bundle) or `dir`/`files`")
    return _bridge(candidate, entrypoint)


def payload_for_file(spec: str | Path) -> dict[str, Any]:
    """A payload that carries a mod file's code (to run where the file does not exist, e.g. a Ray
    actor): inline source, or a bundle when the file is a module of a package."""
    path, _ = _split_entry(spec)
    entry = load_mod_from_path(spec).__name__  # validates the file and finds its mod
    source = path.read_text(encoding="utf-8")
    if _has_relative_imports(source):
        return bundle_payload(path, entry)
    module = f"raylens_shipped_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]}"
    return {"language": "python", "entrypoint": entry, "source": source, "module": module, "name": entry}


def bundle_payload(path: str | Path, entrypoint: str) -> dict[str, Any]:
    """The bundle payload of a mod file that lives in a package (relative imports): every ``.py``
    file of its directory, keyed relative to the parent of the nearest ancestor directory named
    ``examples`` (else the directory's parent), as the original uploader built them."""
    file = Path(path).resolve()
    directory = file.parent
    examples = next((d for d in (directory, *directory.parents) if d.name == "examples"), None)
    base = examples.parent if examples is not None else directory.parent
    sources = {str(p.relative_to(base)).replace(os.sep, "/"): p.read_text(encoding="utf-8")
               for p in sorted(directory.rglob("*.py")) if "__pycache__" not in p.parts}
    return {"language": "python", "entrypoint": entrypoint, "source": sources,
            "module": _bundle_module_name(str(file.relative_to(base)).replace(os.sep, "/")), "name": entrypoint}


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
