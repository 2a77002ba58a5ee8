"""Strict JSON out: no ``NaN``, ``Infinity`` or ``-Infinity`` in anything raylens writes.

Python's ``json.dumps`` writes non-finite floats as the bare words ``NaN``/``Infinity`` by default.
They are not JSON: the ingest backend's parser (serde_json), ``jq`` and browsers refuse the whole
document, so one mod logging ``float("nan")`` would lose a request's payload. Every JSON document
raylens writes (ingest payloads, spool files, results lines, ``--json`` output) goes through
:func:`dumps`, which serialises with ``allow_nan=False``.

The choice for the values themselves: a non-finite float becomes ``null`` (what JavaScript's
``JSON.stringify`` does, and what the ingest schema reads as "absent" for its nullable number
fields), wherever it sits — a top-token log-probability of ``-inf`` after a mod masked the token, a
temperature, a float inside a mod's tool-call arguments. Nothing else is changed, so finite data
round-trips exactly; the conversion walks only lists, tuples and dicts (the shapes ``json``
serialises) and leaves everything else to ``json.dumps`` and its ``default``.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "finite"]


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) replaced by None; containers are copied
    only when something in them changed."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        items = {k: finite(v) for k, v in value.items()}
        return value if all(items[k] is value[k] for k in value) else items
    if isinstance(value, (list, tuple)):
        items_list = [finite(v) for v in value]
        return value if all(a is b for a, b in zip(items_list, value)) else items_list
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` that never writes NaN/Infinity: non-finite floats become ``null``.

    ``allow_nan=False`` stays on as the guard: a non-finite float that reaches the encoder some
    other way (e.g. through ``default``) raises ``ValueError`` instead of writing invalid JSON.
    """
    kwargs.pop("allow_nan", None)
    return json.dumps(finite(value), allow_nan=False, **kwargs)
