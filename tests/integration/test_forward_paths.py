"""Every forward path that runs on a CPU gives the eager forward's results: the default one
(oneDNN-prepacked linear weights), the paged read (``paged_attention: reference`` — a kernel
reading the KV pool in place — with the static decode buffers) and the compiled decode step
(``graph_decode: compile``).

The eager forward's results are ``tests/data/core_fixtures.json`` (``test_core_fixtures`` holds
today's eager forward to it): one request, 5 concurrent requests whose mods adjust logits,
Backtrack, force tokens and adjust the prefill, a prefix-cache hit, a chunked prefill beside a
decoding neighbour and the inline SAE's stored rows. Added here: 8 concurrent requests with those
mods, compared with the eager forward run alongside.

Tokens, texts, event order, actions and payload structure must be equal; floats within float32
noise: a value within a relative 1e-4 (the fixture test's bound), and a tensor's digest — its sum —
within 1e-4 of what that relative noise can move a sum of its ``n`` values by,
``sqrt(n · sum of squares)`` (a sum of values that cancel is ill-conditioned: two GEMM libraries
adding the same products in another order move it by more than 1e-4 of itself)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.core_fixtures import BATCH_PROMPTS, FIXTURE, RECORDED_FORWARD, build_engines, digest, record
from tests.helpers import TEST_MODS, build_config

pytestmark = pytest.mark.slow
REL_TOL = 1e-4
PATHS = {
    "default": {},  # what a CPU runs unless told otherwise: prepacked weights, gathering attention, eager decode
    # a static pool is allocated whole, max_batch × max_sequence positions: the model's 8,192 would
    # hold ~3 GB per engine (~13 GB for the test); no request here comes near 1,024 positions
    "paged-static": {"paged_attention": "reference", "graph_decode": "static", "max_sequence": 1024},
}


def _close(now: float, then: float, scale: float = 0.0) -> bool:
    return math.isclose(now, then, rel_tol=REL_TOL, abs_tol=max(REL_TOL, REL_TOL * scale)) or \
        (math.isnan(now) and math.isnan(then))


def _compare(now: Any, then: Any, path: str, diffs: list[str]) -> None:
    if len(diffs) >= 20:
        return
    if isinstance(then, dict) and {"sum", "sumsq", "shape"} <= then.keys() and isinstance(now, dict):
        n = math.prod(then["shape"]) or 1
        bound = math.sqrt(n * max(then["sumsq"], 0.0))  # what relative noise can move the sum by, over 1e-4
        rms = math.sqrt(max(then["sumsq"], 0.0) / n)
        for key in then:
            scale = bound if key == "sum" else rms if key in ("head", "tail") else 0.0
            if key in ("head", "tail") and isinstance(then[key], list) and isinstance(now.get(key), list) \
                    and len(now[key]) == len(then[key]):
                for i, (a, b) in enumerate(zip(now[key], then[key])):
                    if not _close(a, b, scale):
                        diffs.append(f"{path}.{key}[{i}]: {a!r} vs eager {b!r} (scale {scale:.3g})")
            elif isinstance(then[key], float):
                if not isinstance(now.get(key), (int, float)) or not _close(now[key], then[key], scale):
                    diffs.append(f"{path}.{key}: {now.get(key)!r} vs eager {then[key]!r} (scale {scale:.3g})")
            else:
                _compare(now.get(key), then[key], f"{path}.{key}", diffs)
    elif isinstance(then, dict):
        if not isinstance(now, dict) or now.keys() != then.keys():
            diffs.append(f"{path}: keys {sorted(now) if isinstance(now, dict) else now!r} vs eager {sorted(then)}")
            return
        for key in then:
            _compare(now[key], then[key], f"{path}.{key}", diffs)
    elif isinstance(then, list):
        if not isinstance(now, list) or len(now) != len(then):
            diffs.append(f"{path}: {len(now) if isinstance(now, list) else now!r} items vs eager {len(then)}")
            return
        for i, (a, b) in enumerate(zip(now, then)):
            _compare(a, b, f"{path}[{i}]", diffs)
    elif isinstance(then, float) and isinstance(now, (int, float)) and not isinstance(now, bool):
        if not _close(now, then):
            diffs.append(f"{path}: {now!r} vs eager {then!r} (relative tolerance {REL_TOL})")
    elif now != then:
        diffs.append(f"{path}: {now!r} vs eager {then!r}")


def _eight(engine: Any) -> dict[str, Any]:
    """8 concurrent requests admitted in one step, the fixture's mods on five of them."""
    specs = list(BATCH_PROMPTS.items()) + [(f"plain{i}", (f"Name {i + 2} colours of the sky.", None))
                                           for i in range(3)]
    handles = {}
    with engine.loop.admission_held():
        for name, (prompt, mod_file) in specs:
            mods = [str(TEST_MODS / mod_file)] if mod_file else None
            handles[name] = engine.submit(prompt, max_tokens=12, temperature=0.0, mods=mods,
                                          request_id=f"eight-{name}", keep_logits=True)  # digested after
    return {name: digest(h.result(timeout=600)) for name, h in handles.items()}


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))  # the fixture's JSON round trip


@pytest.fixture(scope="module")
def eager_eight():
    from engine import Engine

    with Engine(build_config(max_batch=8, **RECORDED_FORWARD)) as engine:
        return _json(_eight(engine))


@pytest.mark.parametrize("forward", list(PATHS))
def test_forward_path_gives_the_eager_forwards_results(forward, eager_eight, tmp_path):
    from engine import Engine

    overrides = PATHS[forward]
    engine, small, sae_engine = build_engines(tmp_path, **overrides)
    try:
        now = _json(record(engine, small, sae_engine))
        stats = dict(engine.backend.graph_stats)
        kernel = engine.backend.paged_kernel
        prepacked = engine.backend.prepacked
    finally:
        sae_engine.close()
        small.close()
        engine.close()
    with Engine(build_config(max_batch=8, **overrides)) as eight_engine:
        eight = _json(_eight(eight_engine))
    # positive controls: the path under test is the one that ran
    if forward == "default":
        assert prepacked > 0, "no linear layer was prepacked: the default path was not exercised"
    if "paged_attention" in overrides:
        assert kernel is not None and kernel.name == "reference"
    if overrides.get("graph_decode") in ("static", "compile"):
        assert stats["static_steps"] > 0, f"the static decode never ran: {stats}"
    recorded = json.loads(FIXTURE.read_text())
    diffs: list[str] = []
    for scenario in recorded:
        _compare(now[scenario], recorded[scenario], scenario, diffs)
    _compare(eight, eager_eight, "eight", diffs)
    assert not diffs, f"the {forward} forward's results moved from eager's (first differences):\n" + "\n".join(diffs)
