"""A closed engine gives back its memory: nothing global keeps its backend, KV pool or step loop
alive. A process that opens and closes engines (a test suite, a restarted actor, a benchmark) must
not grow by a backend each time."""

from __future__ import annotations

import gc
import weakref

from engine import Engine
from tests.helpers import build_config


def _open_run_close() -> tuple[weakref.ref, weakref.ref]:
    engine = Engine(build_config())
    try:
        assert engine.generate("Hello there", max_tokens=4).output_ids  # the loop ran a request
        backend, loop = weakref.ref(engine.backend), weakref.ref(engine.loop)
    finally:
        engine.close()
    return backend, loop


def test_a_closed_engine_leaves_no_backend_or_step_loop_alive():
    backend, loop = _open_run_close()
    gc.collect()
    assert loop() is None, "the closed engine's step loop is still reachable"
    assert backend() is None, "the closed engine's backend (and its KV pool) is still reachable"
