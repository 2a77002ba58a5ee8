"""Private module namespaces for mod payloads, so that mod code shares the process without
replacing anything in it.

Every loaded payload (inline source, bundle, directory, or a mod file) gets a package of its own,
``_raylens_payload_<n>_<hash>``, and its modules are imported under it: the bundle module
``examples.tau2.mod`` becomes ``_raylens_payload_3_1a2b3c4d.examples.tau2.mod``. Why: payload code
used to be imported under its own top-level names, so a bundle with a ``mods/`` folder replaced the
SDK for every later job in the process, an inline module named ``json`` replaced ``json``, and two
payloads with a module of the same name replaced each other. Here a payload never enters a name
the process uses, nothing goes on ``sys.path`` and nothing already imported is removed.

How imports inside a payload resolve:

* relative imports (``from .state import X``) work as usual: ``__package__`` lies inside the prefix;
* absolute imports of the payload's own top-level names (``from examples.tau2.prompts import X``)
  are mapped into the prefix by the ``__import__`` of the payload's modules (they share one
  ``__builtins__`` dict in which only ``__import__`` differs), at load time and in function bodies
  run later. ``importlib.import_module("examples.tau2")`` called by payload code is *not* mapped;
* every other name (``json``, ``numpy``) is the process's module. The SDK's names (``mods`` and the
  legacy ``quote_mod_sdk``, ``shared``, ``sdk``, ``quote``, ``max``) always mean the process's SDK,
  even when a payload ships a folder of that name: a second copy of the SDK would bring event and
  action classes that never match the engine's.

Each namespace is its own meta-path finder, on ``sys.meta_path`` while it is loaded, answering only
names under its prefix from its source: code held in memory, or ``.py`` files under a directory
whose real path (symlinks resolved) must stay inside an allowed directory. :meth:`unload` removes
the finder and the namespace's modules. The namespace is a boundary against accidents, not a
sandbox: payload code runs in the process and can still reach anything in it.
"""

from __future__ import annotations

import __future__
import builtins
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol

from .legacy_names import SDK_TOP_LEVEL_NAMES

__all__ = ["PAYLOAD_PREFIX", "DirectorySource", "MemorySource", "PayloadNamespace", "inside"]

#: Start of every payload package name; nothing else in the process uses it.
PAYLOAD_PREFIX = "_raylens_payload_"

#: In-memory payload code is compiled as the loader always compiled it: with postponed evaluation
#: of annotations, so existing mods whose annotations name things defined later keep loading.
_MEMORY_FLAGS = __future__.annotations.compiler_flag

_serial = itertools.count(1)


@dataclass(frozen=True)
class ModuleCode:
    """One module a source can serve."""

    text: str | None  # None: a package with no code of its own
    origin: str  # a file path, or a ``<…>`` label for code held in memory
    is_package: bool
    is_file: bool = False
    flags: int = 0  # compiler flags


class Source(Protocol):
    def find(self, name: str) -> ModuleCode | None: ...

    def has_top_level(self, name: str) -> bool: ...


def inside(path: str, root: str) -> bool:
    """Whether the real path ``path`` is ``root`` or below it (both already resolved)."""
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives
        return False


class MemorySource:
    """Modules given as code, ``{dotted name: (code, origin, is_package)}``; every proper prefix of
    a name is a package with no code of its own (as a bundle's folders are). ``located``: the
    origins are the files the code was read from (they become ``__file__``)."""

    def __init__(self, modules: Mapping[str, tuple[str, str, bool]], *, located: bool = False,
                 flags: int = _MEMORY_FLAGS) -> None:
        self._modules = {name: ModuleCode(text, origin, is_package, is_file=located, flags=flags)
                         for name, (text, origin, is_package) in modules.items()}
        parts = [name.split(".") for name in self._modules]
        self._packages = {".".join(p[:i]) for p in parts for i in range(1, len(p))}
        self._top_levels = {p[0] for p in parts}

    def names(self) -> list[str]:
        return sorted(self._modules)

    def find(self, name: str) -> ModuleCode | None:
        code = self._modules.get(name)
        if code is not None:
            return ModuleCode(code.text, code.origin, code.is_package or name in self._packages, code.is_file,
                              code.flags)
        if name in self._packages:
            return ModuleCode(None, f"<package {name}>", True)
        return None

    def has_top_level(self, name: str) -> bool:
        return name in self._top_levels


class DirectorySource:
    """``.py`` files under ``root``, found as the path finder finds them (package ``__init__.py``,
    then module ``.py``, then a folder as a namespace package). A file or folder whose real path
    leaves ``boundary`` (through ``..`` in a link or a symlink) is refused with ``ImportError``."""

    def __init__(self, root: str | Path, boundary: str | Path) -> None:
        self.root = os.path.realpath(root)
        self.boundary = os.path.realpath(boundary)
        if not inside(self.root, self.boundary):
            raise ImportError(f"mod directory {self.root} is outside {self.boundary}")
        self._tops: dict[str, bool] = {}  # cached: top-level lookups run on every import statement

    def find(self, name: str) -> ModuleCode | None:
        parts = name.split(".")
        if not all(part.isidentifier() for part in parts):
            return None
        base = os.path.join(self.root, *parts)
        for path, is_package in ((os.path.join(base, "__init__.py"), True), (base + ".py", False)):
            if os.path.isfile(path):
                real = self._checked(path)
                with open(real, "rb") as handle:
                    text = importlib.util.decode_source(handle.read())
                return ModuleCode(text, real, is_package, is_file=True)
        if os.path.isdir(base):
            return ModuleCode(None, self._checked(base), True)
        return None

    def has_top_level(self, name: str) -> bool:
        found = self._tops.get(name)
        if found is None:
            found = self._tops[name] = name.isidentifier() and self.find(name) is not None
        return found

    def _checked(self, path: str) -> str:
        real = os.path.realpath(path)
        if not inside(real, self.boundary):
            raise ImportError(f"mod file {path} resolves to {real}, outside the allowed directory {self.boundary}")
        return real


class PayloadNamespace(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The private package of one loaded payload; see the module docstring.

    ``key`` makes the prefix a function of the key (a mod file's path): loading the same file again
    replaces its earlier namespace instead of adding one, so repeated loads do not grow
    ``sys.modules``. Without a key the prefix is new for every namespace.
    """

    def __init__(self, source: Source, *, label: str, key: str | None = None) -> None:
        if key is not None:
            self.prefix = f"{PAYLOAD_PREFIX}f{hashlib.sha1(key.encode()).hexdigest()[:12]}"
        else:
            self.prefix = f"{PAYLOAD_PREFIX}{next(_serial)}_{hashlib.sha1(label.encode()).hexdigest()[:8]}"
        self._dotted = self.prefix + "."
        self._source = source
        self._real_import = builtins.__import__
        self._builtins = dict(builtins.__dict__)
        self._builtins["__import__"] = self._import

    # ----------------------------------------------------------------------------- lifecycle

    def install(self) -> None:
        for finder in list(sys.meta_path):
            if isinstance(finder, PayloadNamespace) and finder.prefix == self.prefix and finder is not self:
                finder.unload()
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)  # answers only its own prefix, so first place costs nothing

    def unload(self) -> None:
        """Remove the finder and this namespace's modules (module objects still referenced live on)."""
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        for name in [n for n in list(sys.modules) if n == self.prefix or n.startswith(self._dotted)]:
            sys.modules.pop(name, None)

    def import_module(self, name: str) -> types.ModuleType:
        """Import the payload module ``name`` (its own dotted name, without the prefix)."""
        return importlib.import_module(self._dotted + name)

    def find(self, name: str) -> ModuleCode | None:
        return self._source.find(name)

    # ------------------------------------------------------------------------ import mapping

    def _import(self, name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0):
        """``__import__`` for payload code: its own top-level names resolve inside the prefix."""
        if level == 0 and name:
            top = name.partition(".")[0]
            if self._source.has_top_level(top):
                if top in SDK_TOP_LEVEL_NAMES:
                    return self._import_sdk_name(name, globals, locals, fromlist, top)
                module = self._real_import(self._dotted + name, globals, locals, fromlist, 0)
                return module if fromlist else sys.modules[self._dotted + top]
        return self._real_import(name, globals, locals, fromlist, level)

    def _import_sdk_name(self, name: str, globals: Any, locals: Any, fromlist: Any, top: str):
        try:
            return self._real_import(name, globals, locals, fromlist, 0)
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                f"{err}. `{top}` always names the mod SDK, so the payload's own `{top}` folder is never "
                f"imported; rename that folder", name=err.name) from err

    # -------------------------------------------------------------------- finder and loader

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == self.prefix:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if not fullname.startswith(self._dotted):
            return None
        code = self._source.find(fullname[len(self._dotted):])
        if code is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=code.origin, is_package=code.is_package)
        spec.has_location = code.is_file  # sets __file__, so tracebacks and inspect find the file
        spec.loader_state = code  # what was checked is what runs (a file swapped meanwhile is not read)
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__builtins__ = self._builtins  # type: ignore[attr-defined]
        if module.__name__ == self.prefix:
            return
        code: ModuleCode | None = module.__spec__.loader_state if module.__spec__ is not None else None
        if code is not None and code.text is not None:
            compiled = compile(code.text, code.origin, "exec", flags=code.flags, dont_inherit=True)
            exec(compiled, module.__dict__)

    def get_source(self, fullname: str) -> str | None:
        """The module's code, for ``inspect.getsource`` and tracebacks of in-memory modules."""
        if not fullname.startswith(self._dotted):
            return None
        code = self._source.find(fullname[len(self._dotted):])
        return code.text if code is not None else None

    def __repr__(self) -> str:
        return f"PayloadNamespace({self.prefix})"
