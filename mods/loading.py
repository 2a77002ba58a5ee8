"""Loading mods: from a ``.py`` file, from a payload dict, or as given callables.

Legacy code imports this module as ``quote.mods.sdk_bridge``. Every path here installs the
legacy import names first (:mod:`mods.legacy_names`), so existing mod files load unchanged.

Every mod file and payload runs in a private namespace of its own
(:mod:`mods.payload_namespace`): its modules are imported under a package prefix that nothing
else uses, so a payload cannot replace ``mods``, ``json`` or any other module of the process,
adds nothing to ``sys.path``, and two payloads (or files) with a module of the same name never
collide. Re-loading a file gives fresh module state. The mod in a file is the function named
after ``:`` (``path/to/mod.py:my_mod``), else the single ``@mod``-decorated function it defines.

Directory payloads read files of the machine that runs them, so they load only from directories
the operator allowed (``allowed_dirs``, the config's ``generation.mod_dirs``).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import os
import re
import textwrap
import types
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .legacy_names import install_legacy_names
from .payload_namespace import PAYLOAD_PREFIX, DirectorySource, MemorySource, PayloadNamespace, inside
from .types import ModAction, ModEvent, Noop
from .validation import InvalidActionError, validate_action

__all__ = [
    "ModDirNotAllowedError",
    "ModLoadError",
    "ModPayloadError",
    "load_mod_from_path",
    "load_mod_from_payload",
    "bundle_payload",
    "payload_for_file",
    "resolve_mods",
    "check_payload",
    "parse_mod_file",
]


class ModPayloadError(ValueError):
    """A mod payload is malformed or its mod failed (the original's name and base class)."""


class ModLoadError(ModPayloadError):
    """A mod file cannot be loaded; the message says which file and what to change."""


class ModDirNotAllowedError(ModPayloadError):
    """A directory payload names a path outside the operator's allowed directories (the config key
    ``generation.mod_dirs``), or none are allowed. The request is refused; it can be resent as
    inline source or a bundle. ``parameter`` is the payload field, ``value`` the path it gave."""

    def __init__(self, message: str, *, parameter: str, value: Any) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


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
    """Load the mod in a Python file; ``"file.py:name"`` picks a function by name.

    The file runs in a private namespace keyed by its path: loading it again replaces the earlier
    load (fresh module state) instead of adding modules to ``sys.modules``.
    """
    path, entry = _split_entry(spec)
    if not path.is_file():
        raise ModLoadError(f"mod file `{path}` does not exist; pass the path of a .py file that defines a @mod function")
    if path.suffix != ".py":
        raise ModLoadError(f"mod file `{path}` must be a .py file")
    install_legacy_names()
    resolved = path.resolve()
    source = resolved.read_text(encoding="utf-8")
    try:
        compile(source, str(resolved), "exec")
    except SyntaxError as err:
        raise ModLoadError(f"mod file `{path}` has a syntax error at line {err.lineno}: {err.msg}") from None
    if _has_relative_imports(source):  # a module of a package (e.g. examples/tau2/mod.py)
        payload = bundle_payload(resolved, entry or "_")
        memory = _bundle_source(payload["source"])
        module_name = payload["module"]
    else:
        module_name = re.sub(r"\W", "_", resolved.stem)
        memory = MemorySource({module_name: (source, str(resolved), False)}, located=True)
    namespace = PayloadNamespace(memory, label=str(resolved), key=str(resolved))
    try:
        module = _import_entry(namespace, module_name, f"mod file `{path}`")
    except ModPayloadError as err:
        raise ModLoadError(str(err)) from err.__cause__
    return _pick_entry(module, entry, where=f"`{path}`")


def _has_relative_imports(source: str) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.level > 0 for node in ast.walk(ast.parse(source)))


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


def _import_entry(namespace: PayloadNamespace, module_name: str, what: str) -> types.ModuleType:
    """Import a payload's entry module in its namespace; on failure the namespace is unloaded.

    ``BaseException`` is caught too: a payload that calls ``sys.exit()`` while loading must fail
    its own load, not end the process that loads it.
    """
    namespace.install()
    try:
        return namespace.import_module(module_name)
    except BaseException as err:
        namespace.unload()
        raise ModPayloadError(f"{what} failed while loading: {type(err).__name__}: {err}") from err


# --------------------------------------------------------------------------------- from a payload


def _bridge(candidate: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Wrap a payload mod as the original bridge did, keeping the cause chained.

    Only ``Exception`` becomes ``ModPayloadError``; a ``BaseException`` (``SystemExit``…) passes
    through to the ModManager, which records it and ends the request.
    """

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


def _entry_of(namespace: PayloadNamespace, module_name: str, entrypoint: str, what: str) -> Callable[..., Any]:
    module = _import_entry(namespace, module_name, what)
    candidate = getattr(module, entrypoint, None)
    if not callable(candidate):
        namespace.unload()
        raise ModPayloadError(f"{what} has no callable named `{entrypoint}`")
    return candidate


def _load_inline(payload: Mapping[str, Any], entrypoint: str) -> tuple[PayloadNamespace, Callable[..., Any]]:
    module_name = payload.get("module") or "client_mod"
    if not isinstance(module_name, str) or not all(module_name.split(".")):
        raise ModPayloadError(f"mod payload field `module` must be a dotted module name, got {module_name!r}")
    parts = module_name.split(".")
    if parts[0].startswith(PAYLOAD_PREFIX) and len(parts) > 1:  # serialized from a loaded mod
        module_name = ".".join(parts[1:])
    memory = MemorySource({module_name: (textwrap.dedent(payload["source"]), f"<mod {module_name}>", False)})
    namespace = PayloadNamespace(memory, label=payload["source"])
    return namespace, _entry_of(namespace, module_name, entrypoint, f"inline mod `{module_name}`")


def _bundle_module_name(path: str) -> str:
    """``a/b.py`` → ``a.b``; ``a/b/__init__.py`` → ``a.b`` (leading ``.``/``/`` stripped)."""
    clean = path.replace("\\", "/").lstrip("./")
    if clean.endswith("/__init__.py"):
        clean = clean[: -len("/__init__.py")]
    elif clean.endswith(".py"):
        clean = clean[:-3]
    return clean.replace("/", ".")


def _bundle_source(sources: Mapping[str, str]) -> MemorySource:
    """A bundle's files as in-memory modules; its folders are packages (``__init__.py`` gives one code)."""
    return MemorySource({
        _bundle_module_name(path): (textwrap.dedent(text), f"<bundle {path}>",
                                    path.replace("\\", "/").endswith("/__init__.py"))
        for path, text in sources.items()
    })


def _load_bundle(payload: Mapping[str, Any], entrypoint: str) -> tuple[PayloadNamespace, Callable[..., Any]]:
    sources = payload["source"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in sources.items()):
        raise ModPayloadError("a bundle's `source` must map relative paths (strings) to code (strings)")
    module_name = payload.get("module")
    if not isinstance(module_name, str) or not module_name:
        raise ModPayloadError("a bundle payload needs `module`: the dotted name of the entry module")
    memory = _bundle_source(sources)
    if module_name not in memory.names():
        raise ModPayloadError(f"bundle has no module `{module_name}` (it has {', '.join(memory.names())})")
    label = "\n".join(f"{k}\n{v}" for k, v in sorted(sources.items()))
    namespace = PayloadNamespace(memory, label=label)
    return namespace, _entry_of(namespace, module_name, entrypoint, f"bundle module `{module_name}`")


def _allowed_roots(allowed_dirs: Iterable[str | Path] | None) -> list[str]:
    return [os.path.realpath(os.fspath(d)) for d in allowed_dirs or ()]


def _named_start(payload: Mapping[str, Any], roots: list[str]) -> tuple[str, str]:
    """The directory a directory payload names (``dir``, or the common parent of ``files``), as a
    real path, and the allowed root that holds it; anything else is refused."""
    if payload.get("dir") is not None:
        named: list[tuple[str, Any]] = [("dir", payload["dir"])]
    else:
        files = payload.get("files")
        if not isinstance(files, list) or not files:
            raise ModPayloadError("a directory payload needs `dir` or a non-empty `files` list")
        named = [(f"files[{i}]", f) for i, f in enumerate(files)]
    if not roots:
        parameter, value = named[0]
        raise ModDirNotAllowedError(
            f"`generation.mod_dirs` must list the directories that directory mod payloads may load from, "
            f"got none (the payload names `{parameter}` {value!r}); add that directory to "
            "`generation.mod_dirs`, or send the mod as inline source or a bundle",
            parameter=parameter, value=value)
    reals: list[str] = []
    for parameter, value in named:
        if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
            raise ModPayloadError(f"mod payload field `{parameter}` must be a path, got {value!r}")
        real = os.path.realpath(os.fspath(value))
        if not any(inside(real, root) for root in roots):
            raise ModDirNotAllowedError(
                f"`{parameter}` must be inside a directory listed in `generation.mod_dirs` "
                f"({', '.join(roots)}), got {value!r} (resolves to {real})", parameter=parameter, value=value)
        reals.append(real)
    if payload.get("dir") is not None:
        start = reals[0]
        if not os.path.isdir(start):
            raise ModPayloadError(f"mod payload `dir` {payload['dir']} is not a directory")
    else:
        start = os.path.commonpath([os.path.dirname(r) for r in reals])
    root = next(r for r in roots if inside(start, r))
    return start, root


def _load_from_directory(payload: Mapping[str, Any], entrypoint: str, allowed_dirs: Iterable[str | Path] | None
                         ) -> tuple[PayloadNamespace, Callable[..., Any]]:
    module_name = payload.get("module")
    if not isinstance(module_name, str) or not module_name:
        raise ModPayloadError("a directory payload needs `module`: the dotted name of the entry module")
    if not all(part.isidentifier() for part in module_name.split(".")):
        raise ModPayloadError(f"mod payload field `module` must be a dotted name of identifiers, got {module_name!r}")
    start, allowed_root = _named_start(payload, _allowed_roots(allowed_dirs))
    relative = os.path.join(*module_name.split(".")) + ".py"
    # Search the named directory and its parents for the module, as the original did, but never
    # above the allowed directory that holds it.
    candidates = [start]
    while candidates[-1] != allowed_root:
        candidates.append(os.path.dirname(candidates[-1]))
    root = next((d for d in candidates if os.path.isfile(os.path.join(d, relative))), None)
    if root is None:
        raise ModPayloadError(f"mod module `{module_name}` was not found as {relative} in {start} or its parents "
                              f"up to {allowed_root}")
    try:
        source = DirectorySource(root, allowed_root)
    except ImportError as err:
        raise ModPayloadError(str(err)) from None
    namespace = PayloadNamespace(source, label=f"{root}:{module_name}")
    return namespace, _entry_of(namespace, module_name, entrypoint, f"mod module `{module_name}`")


def load_mod_from_payload(payload: Mapping[str, Any], *,
                          allowed_dirs: Iterable[str | Path] | None = None) -> Callable[..., Any]:
    """Load a mod from a payload dict, in this order of forms:

    * bundle — ``source`` maps relative paths to code, ``module`` names the entry module;
    * directory — ``dir`` (or ``files``) plus ``module``; only inside ``allowed_dirs`` (the
      operator's ``generation.mod_dirs``), after resolving ``..`` and symlinks. With no allowed
      directories every directory payload is refused (:class:`ModDirNotAllowedError`);
    * inline — ``source`` is the code of one module (``module`` defaults to ``client_mod``).

    Every form runs in a private namespace (:mod:`mods.payload_namespace`): the payload's modules
    never replace a module of the process, nothing is added to ``sys.path``, and two payloads with
    a module of the same name do not meet. The namespace is unloaded when the returned mod is
    garbage collected.
    """
    if not isinstance(payload, Mapping):
        raise ModPayloadError(f"mod payload must be a JSON object, got {type(payload).__name__}")
    if payload.get("language") != "python":
        raise ModPayloadError("Only Python mods are supported in v0 (payload field `language` must be \"python\")")
    entrypoint = _require_str(payload, "entrypoint")
    install_legacy_names()
    source = payload.get("source")
    if isinstance(source, Mapping) and source:
        namespace, candidate = _load_bundle(payload, entrypoint)
    elif payload.get("dir") is not None or payload.get("files"):
        namespace, candidate = _load_from_directory(payload, entrypoint, allowed_dirs)
    elif isinstance(source, str) and source.strip():
        namespace, candidate = _load_inline(payload, entrypoint)
    else:
        raise ModPayloadError("mod payload needs `source` (code, or a {path: code} bundle) or `dir`/`files`")
    bridged = _bridge(candidate, entrypoint)
    weakref.finalize(bridged, namespace.unload).atexit = False
    return bridged


def payload_for_file(spec: str | Path) -> dict[str, Any]:
    """A payload that carries a mod file's code (to run where the file does not exist, e.g. a Ray
    actor): inline source, or a bundle when the file is a module of a package."""
    path, entry = parse_mod_file(spec)  # checks the file and finds its mod without running it
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


# ----------------------------------------------------------------------------- parse-only checks
#
# What a submitting machine runs on a prompts file: it reads mods to ship them, but their code must
# run only where they are used (the generator), never where a job is merely checked. These parse.


def _parsed(source: str, where: str, error: type[ModPayloadError] = ModPayloadError) -> ast.Module:
    try:
        return ast.parse(textwrap.dedent(source), filename=where)
    except SyntaxError as err:
        raise error(f"{where} has a syntax error at line {err.lineno}: {err.msg}") from None


def _bound_names(tree: ast.Module) -> set[str] | None:
    """Every name the module could bind (over-approximated: any depth), or None when a star
    import makes that unknowable without running it."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
    return names


def _require_name(tree: ast.Module, name: str, where: str, error: type[ModPayloadError]) -> None:
    names = _bound_names(tree)
    if names is not None and name not in names:
        raise error(f"{where} has no callable named `{name}`")


def _decorated_by_parsing(tree: ast.Module) -> list[str]:
    """Top-level functions decorated with ``mod`` (``@mod``, ``@sdk.mod``, ``@mod(...)``); failing
    that, every decorated top-level function (a decorator under another name)."""
    def name(d: ast.expr) -> str:
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")

    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.decorator_list]
    marked = sorted(n.name for n in functions if any(name(d) == "mod" for d in n.decorator_list))
    return marked or sorted(n.name for n in functions)


def parse_mod_file(spec: str | Path) -> tuple[Path, str]:
    """The file and the name of its mod (``file.py:name`` or its one ``@mod`` function), found by
    parsing: the file's code does not run."""
    path, entry = _split_entry(spec)
    if not path.is_file():
        raise ModLoadError(f"mod file `{path}` does not exist; pass the path of a .py file that defines a @mod function")
    if path.suffix != ".py":
        raise ModLoadError(f"mod file `{path}` must be a .py file")
    tree = _parsed(path.read_text(encoding="utf-8"), f"mod file `{path}`", ModLoadError)
    if entry is not None:
        _require_name(tree, entry, f"`{path}`", ModLoadError)
        return path, entry
    found = _decorated_by_parsing(tree)
    if len(found) == 1:
        return path, found[0]
    if not found:
        raise ModLoadError(f"`{path}` defines no @mod-decorated function; add one, or name it as FILE.py:function")
    raise ModLoadError(f"`{path}` defines several mods ({', '.join(found)}); pick one as FILE.py:function")


def check_payload(payload: Any) -> None:
    """Check a mod payload's shape and parse its code, without running it: what
    :func:`load_mod_from_payload` would refuse before executing anything, plus syntax errors and
    a missing entry point. A directory payload names paths on the machine that runs it, so only
    its shape is checked here."""
    if not isinstance(payload, Mapping):
        raise ModPayloadError(f"mod payload must be a JSON object, got {type(payload).__name__}")
    if payload.get("language") != "python":
        raise ModPayloadError("Only Python mods are supported in v0 (payload field `language` must be \"python\")")
    entrypoint = _require_str(payload, "entrypoint")
    source, module = payload.get("source"), payload.get("module")
    if isinstance(source, Mapping) and source:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in source.items()):
            raise ModPayloadError("a bundle's `source` must map relative paths (strings) to code (strings)")
        if not isinstance(module, str) or not module:
            raise ModPayloadError("a bundle payload needs `module`: the dotted name of the entry module")
        trees = {_bundle_module_name(path): _parsed(code, f"bundle file `{path}`") for path, code in source.items()}
        if module not in trees:
            raise ModPayloadError(f"bundle has no module `{module}` (it has {', '.join(sorted(trees))})")
        _require_name(trees[module], entrypoint, f"bundle module `{module}`", ModPayloadError)
    elif payload.get("dir") is not None or payload.get("files"):
        if not isinstance(module, str) or not module:
            raise ModPayloadError("a directory payload needs `module`: the dotted name of the entry module")
        files = payload.get("files")
        if payload.get("dir") is None and (not isinstance(files, list) or not all(isinstance(f, str) for f in files)):
            raise ModPayloadError("a directory payload needs `dir` or a non-empty `files` list of paths")
    elif isinstance(source, str) and source.strip():
        if module is not None and not isinstance(module, str):
            raise ModPayloadError(f"mod payload field `module` must be a string, got {module!r}")
        tree = _parsed(source, f"inline mod `{module or 'client_mod'}`")
        _require_name(tree, entrypoint, f"inline mod `{module or 'client_mod'}`", ModPayloadError)
    else:
        raise ModPayloadError("mod payload needs `source` (code, or a {path: code} bundle) or `dir`/`files`")


# ------------------------------------------------------------------------------------ any of them


def resolve_mods(specs: Iterable[ModSpec] | None, *,
                 allowed_dirs: Iterable[str | Path] | None = None) -> list[Callable[..., Any]]:
    """Turn what a user passed as ``mods=`` into callables, in order. ``allowed_dirs``: where
    directory payloads may load from (see :func:`load_mod_from_payload`)."""
    resolved: list[Callable[..., Any]] = []
    allowed = tuple(allowed_dirs or ())  # an iterator would be used up by the first payload
    for spec in specs or []:
        if isinstance(spec, (str, Path)):
            resolved.append(load_mod_from_path(spec))
        elif isinstance(spec, Mapping):
            resolved.append(load_mod_from_payload(spec, allowed_dirs=allowed))
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
