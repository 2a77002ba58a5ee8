"""The import names existing mods use, mapped onto this package — in this one module only.

Mods written for the original SDK import ``quote_mod_sdk[...]``, ``sdk.quote_mod_sdk[...]``,
``shared.types``, ``shared.utils``, ``shared.conversation`` and ``max.driver.Tensor``. They must
load with zero changes, so :func:`install_legacy_names` makes those names resolve to the modules
of this package — the *same module objects*, never copies (two copies of the SDK give two
``EraseMode`` enums that do not compare equal).

Nothing happens at import time: the mod loader calls :func:`install_legacy_names` before it
executes a mod, and the engine calls it with its tensor class so ``max.driver.Tensor`` is the
class it puts into ``ForwardPass.logits`` (so ``Tensor.from_numpy(...)`` in a mod yields a
value the engine accepts).

Every alias is entered into ``sys.modules`` eagerly. A meta-path finder answers any other
``quote_mod_sdk.X`` / ``sdk.quote_mod_sdk.X`` with ``mods.X``. Eager entries matter for
``quote_mod_sdk.mod``: were it found lazily, the import system would set the *module* as the
package attribute ``mod`` and shadow the ``@mod`` decorator.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from typing import Any

from .tensor import NumpyTensor

__all__ = ["install_legacy_names", "LegacyNameConflict", "SDK_PACKAGE", "SDK_TOP_LEVEL_NAMES"]

SDK_PACKAGE = "mods"

#: Legacy SDK package prefixes, each an alias of this package.
_SDK_PREFIXES = ("quote_mod_sdk", "sdk.quote_mod_sdk")

#: SDK submodules whose legacy name differs from ours, or which must be entered eagerly.
_SDK_SUBMODULES = {
    "mod": "mods.decorator",
    "actions": "mods.actions",
    "tokenizer": "mods.tokenizer",
    "serialization": "mods.serialization",
    "conversation": "mods.conversation",
    "self_prompt": "mods.self_prompt",
    "flow": "mods.flow",
    "strategies": "mods.strategies",
    "strategies.base": "mods.strategies.base",
    "strategies.primitives": "mods.strategies.primitives",
    "strategies.list_strategy": "mods.strategies.list_strategy",
    "strategies.strategy_constructor": "mods.strategies.strategy_constructor",
    "strategies.compile": "mods.strategies.compile",
    "strategies.pattern": "mods.strategies.pattern",
}

#: Non-SDK legacy modules.
_OTHER_MODULES = {
    "shared.types": "mods.types",
    "shared.utils": "mods.validation",
    "shared.conversation": "mods.conversation",
    "quote.mods.manager": "mods.manager",
    "quote.mods.sdk_bridge": "mods.loading",
}

#: Namespace packages that exist only to hold the legacy modules.
_SYNTHETIC_PACKAGES = ("sdk", "shared", "quote", "quote.mods", "max")

#: Every top-level import name the SDK answers for: its own package and the roots of the legacy
#: names. A mod payload never provides its own module under one of these: a second copy of the SDK
#: would bring event and action classes that never match the engine's.
SDK_TOP_LEVEL_NAMES = frozenset(
    {SDK_PACKAGE, *(name.split(".")[0] for name in (*_SDK_PREFIXES, *_OTHER_MODULES, *_SYNTHETIC_PACKAGES))}
)

_MARKER = "__raylens_legacy__"
_lock = threading.Lock()


class LegacyNameConflict(ImportError):
    """A real package already owns a legacy name (e.g. Modular's ``max``)."""


def _alias_table() -> dict[str, str]:
    table: dict[str, str] = {prefix: SDK_PACKAGE for prefix in _SDK_PREFIXES}
    for prefix in _SDK_PREFIXES:
        for child, real in _SDK_SUBMODULES.items():
            table[f"{prefix}.{child}"] = real
    table.update(_OTHER_MODULES)
    return table


def _synthetic_package(name: str) -> types.ModuleType:
    existing = sys.modules.get(name)
    if existing is not None:
        if not getattr(existing, _MARKER, False):
            raise LegacyNameConflict(
                f"the module `{name}` is already imported from {getattr(existing, '__file__', '?')}; "
                f"raylens needs that name for legacy mods. Uninstall the other `{name}` package "
                "from this environment."
            )
        return existing
    module = types.ModuleType(name, f"raylens legacy namespace for existing mods ({name})")
    module.__path__ = []  # a package, so submodule imports work
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    setattr(module, _MARKER, True)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def _enter(alias: str, real: str) -> None:
    module = importlib.import_module(real)
    sys.modules[alias] = module
    parent, _, child = alias.rpartition(".")
    parent_module = sys.modules.get(parent)
    # Only the synthetic namespaces get attributes; the SDK package keeps its own (``mods.mod``
    # is the decorator, not the module).
    if parent_module is not None and getattr(parent_module, _MARKER, False):
        setattr(parent_module, child, module)


class _SDKAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``quote_mod_sdk.X`` and ``sdk.quote_mod_sdk.X`` to the module ``mods.X``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        for prefix in _SDK_PREFIXES:
            if fullname.startswith(prefix + "."):
                real = SDK_PACKAGE + fullname[len(prefix):]
                if importlib.util.find_spec(real) is None:
                    return None
                return importlib.util.spec_from_loader(fullname, self, is_package=False)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        prefix = next(p for p in _SDK_PREFIXES if spec.name.startswith(p + "."))
        return importlib.import_module(SDK_PACKAGE + spec.name[len(prefix):])

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # the real module is already executed


_finder = _SDKAliasFinder()


def install_legacy_names(tensor_class: type | None = None) -> None:
    """Make the legacy import names resolve; bind ``max.driver.Tensor`` to ``tensor_class``.

    Idempotent. Without ``tensor_class`` an already-bound class is kept (default: the numpy
    stand-in :class:`mods.tensor.NumpyTensor`).
    """
    with _lock:
        for name in _SYNTHETIC_PACKAGES:
            _synthetic_package(name)
        for alias, real in _alias_table().items():
            if sys.modules.get(alias) is not importlib.import_module(real):
                _enter(alias, real)
        driver = sys.modules.get("max.driver")
        if driver is None:
            driver = types.ModuleType("max.driver", "raylens stand-in for max.driver (Tensor only)")
            setattr(driver, _MARKER, True)
            setattr(driver, "Tensor", NumpyTensor)
            sys.modules["max.driver"] = driver
            setattr(sys.modules["max"], "driver", driver)
        elif not getattr(driver, _MARKER, False):
            raise LegacyNameConflict("`max.driver` is provided by another package; uninstall it")
        if tensor_class is not None:
            setattr(driver, "Tensor", tensor_class)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
