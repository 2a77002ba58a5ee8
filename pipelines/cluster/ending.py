"""Ending named actors for good, and waiting until Ray no longer lists them.

``ray.kill`` only asks the cluster to end an actor: on a busy head its name stays listed for a
moment, and a get-or-create of the same name in that moment (the next job, ``raylens scale``, a
router looking again) would find the dying actor. So whoever ends actors waits, bounded, until
their names are gone.
"""

from __future__ import annotations

import time
from typing import Sequence

import ray

__all__ = ["end_named_actors", "listed_names"]


def listed_names(namespace: str) -> set[str]:
    """The names of the actors Ray lists in ``namespace`` now."""
    return {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry["namespace"] == namespace}


def end_named_actors(namespace: str, names: Sequence[str], *, timeout_s: float) -> list[str]:
    """Kill each of ``names`` (no restart) and wait, at most ``timeout_s``, until none is listed;
    the names still listed at the deadline (none when all ended)."""
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:
            pass  # ended meanwhile
    deadline = time.monotonic() + timeout_s
    while True:
        left = sorted(set(names) & listed_names(namespace))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)
