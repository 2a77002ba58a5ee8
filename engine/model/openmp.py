"""Keep the step loop's thread the only one holding OpenMP workers, and only while it works.

torch's CPU kernels split work with OpenMP, and GNU libgomp (the runtime torch's Linux wheels ship)
keeps one team of worker threads per thread that ever ran a parallel region. Once the teams together
hold more threads than the machine has cores, libgomp stops spinning between regions and puts its
workers to sleep after each one: every parallel op then pays a futex wake-up. On two cores a small
element-wise op (SiLU·mul over 32 × 1,536 floats) took 165 us instead of 20 us while another,
idle, thread kept its team. The model is loaded and warmed up on the caller's thread, so that
thread keeps a team; the step loop runs the forward on a thread of its own. So a thread that hands
work to the loop gives its team back, and so does the loop's thread when it goes idle (another
engine's loop, or the caller's own torch work, then runs at full speed). OpenMP 5's
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
    """``omp_pause_resource_all`` of the libgomp torch runs on, or None (another OpenMP runtime,
    torch built without OpenMP, or a libgomp older than OpenMP 5).

    The symbol is looked up through torch's own library, which finds it in the libgomp torch was
    linked against: a process may map several copies (sentencepiece's wheel ships one, loaded with
    the tokenizer), and pausing another copy's threads frees nothing of torch's while reporting
    success."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    library = _torch_cpu_library()
    if library is None:
        return None
    try:
        fn = ctypes.CDLL(library).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def _torch_cpu_library() -> str | None:
    """Path of the ``libtorch_cpu`` mapped into this process (None: not Linux, or not found)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libtorch_cpu" in line}
    except OSError:  # not Linux: no libgomp to tune
        return None
    return min((path for path in paths if path.startswith("/")), default=None)


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
