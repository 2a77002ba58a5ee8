"""``serialize_mod``: a mod function as an inline-source payload.

The payload is ``language``, ``module``, ``entrypoint`` and the dedented source of the whole
defining module (plus ``name`` / ``description`` when given);
:func:`mods.loading.load_mod_from_payload` loads it back.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from typing import Any, Callable

__all__ = ["serialize_mod"]


def serialize_mod(
    mod_fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
) -> dict[str, Any]:
    """Return ``{"language", "module", "entrypoint", "source"}`` for the module defining ``mod_fn``.

    The whole defining module is captured (helpers and imports included), so the payload loads on
    its own. Raises ``ValueError`` when that module's source cannot be found.
    """
    target = getattr(mod_fn, "__wrapped__", mod_fn)
    module_name = getattr(target, "__module__", None)
    module = sys.modules.get(module_name) if module_name else None
    if module is None:
        raise ValueError(f"cannot find the module that defines {mod_fn!r}")
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError) as err:
        raise ValueError(f"cannot read the source of module {module_name!r}: {err}") from err
    payload: dict[str, Any] = {
        "language": "python",
        "module": module_name,
        "entrypoint": getattr(target, "__name__", getattr(mod_fn, "__name__", "mod")),
        "source": textwrap.dedent(source),
    }
    if name is not None:
        payload["name"] = name
    if description is not None:
        payload["description"] = description
    return payload
