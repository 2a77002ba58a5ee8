"""Keep the step loop's thread the only one holding OpenMP workers.

torch's CPU kernels split work with OpenMP, and GNU libgomp (the runtime torch's Linux wheels ship)
keeps one team of worker threads per thread that ever ran a parallel region. Once the teams together
hold more threads than the machine has cores, libgomp stops spinning between regions and puts its
workers to sleep after each one: every parallel op then pays a futex wake-up. The model is loaded
and warmed up on the caller's thread, so that thread keeps a team; the step loop runs the forward
on a thread of its own and, with both teams alive, an 8-token forward of the embedded model took
~25 % longer on two cores (small element-wise ops ran at one core's speed) than on the loading
thread; a decode step parallelises less and gained a few per cent. OpenMP 5's
``omp_pause_resource_all`` hands the calling thread's team back; the thread gets a new one if it
runs a parallel op again.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Callable

__all__ = ["release_thread_team"]

log = logging.getLogger(__name__)
_OMP_PAUSE_SOFT = 1  # omp_pause_soft: free the threads, keep what is cheap to keep


@functools.lru_cache(maxsize=1)
def _pause_all() -> Callable[[int], int] | None:
    """libgomp's ``omp_pause_resource_all`` as loaded by torch, or None (another OpenMP runtime,
    torch built without OpenMP, or a libgomp older than OpenMP 5)."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    for name in _loaded_gomp():
        try:
            fn = ctypes.CDLL(name).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


def _loaded_gomp() -> list[str]:
    """Paths of the libgomp copies mapped into this process (torch's own first in practice)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:  # not Linux: no libgomp to tune
        return []
    return sorted(path for path in paths if path.startswith("/"))


def release_thread_team() -> bool:
    """Give back the OpenMP worker threads the calling thread holds (none held: nothing happens).
    Call it from a thread that hands work to the step loop and does no parallel torch work of its
    own meanwhile. True when the runtime took the request."""
    pause = _pause_all()
    if pause is None:
        return False
    rc = pause(_OMP_PAUSE_SOFT)
    if rc != 0:
        log.debug("omp_pause_resource_all returned %d", rc)
    return rc == 0
