"""Where a compiled decode step's work is kept between runs (``graph_decode: compile``).

``torch.compile`` pays most of its start-up in inductor: lowering each decode shape's graph and
compiling its C++ kernels (~45 s a shape for the embedded model on 2 cores). Inductor keeps that
work on disk — its FX graph cache and AOTAutograd cache, keyed by the graph, the torch version and
the inductor config — under ``TORCHINDUCTOR_CACHE_DIR``, by default a per-user folder in the
system's temporary directory, which a reboot or a tmp cleaner empties. raylens points it at
``<raylens cache>/inductor`` (``backend.compile_cache_dir`` sets another), so the compile is paid
once per machine and torch version: a later run traces each shape again (dynamo's tracing is not
cached) but loads the compiled kernels instead of building them.

torch reads the folder from its environment variable, when it first compiles, so this sets that
variable for the process: every compile in it shares the folder.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["use_compile_cache", "default_compile_cache_dir"]


def default_compile_cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("raylens")) / "inductor"


def use_compile_cache(directory: str | None) -> Path:
    """Make inductor keep its caches in ``directory`` (None: :func:`default_compile_cache_dir`);
    returns the folder."""
    folder = Path(directory) if directory else default_compile_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)  # torch's one channel for it (torch._inductor.runtime)
    return folder
