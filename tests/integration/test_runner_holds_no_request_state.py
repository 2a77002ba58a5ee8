"""The backend is a model runner: after requests ran through it (a batch, a prefix hit, a job), it
holds no request and no block state of its own — no request id anywhere in its attributes, no
object of the core (the scheduler's KV manager, block pool, prefix index), no block table. What
it does hold is the model and the KV pool's tensors, which the scheduler's output told it how
to fill."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow


def _walk(value: Any, path: str, seen: set[int], found: list[str], ids: set[str], depth: int = 0) -> None:
    """Every request id (as a string, or a dict key) and every engine.core object reachable from
    ``value`` through plain containers and our own objects' attributes, to a bounded depth."""
    if depth > 6 or id(value) in seen or isinstance(value, (torch.Tensor, torch.nn.Module)):
        return
    seen.add(id(value))
    module = getattr(type(value), "__module__", "") or ""
    if module.startswith("engine.core"):
        found.append(f"{path}: a {type(value).__name__} of the core")
        return
    if isinstance(value, str):
        if value in ids:
            found.append(f"{path}: request id {value!r}")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _walk(key, f"{path}[key]", seen, found, ids, depth + 1)
            _walk(item, f"{path}[{key!r}]", seen, found, ids, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            _walk(item, f"{path}[{i}]", seen, found, ids, depth + 1)
    elif module.startswith(("engine.", "tests.")) and hasattr(value, "__dict__"):
        for name, item in vars(value).items():
            _walk(item, f"{path}.{name}", seen, found, ids, depth + 1)


def test_after_requests_the_backend_holds_no_request_or_block_state(engine):
    system = ("You are a careful assistant who answers in one short sentence and never uses lists, even when "
              "asked for several things at once.")
    ids = [f"stateless-{i}" for i in range(4)]
    with engine.loop.admission_held():
        handles = [engine.submit(messages=[{"role": "system", "content": system},
                                           {"role": "user", "content": f"Name a colour, number {i}."}],
                                 max_tokens=4, temperature=0.0, request_id=rid) for i, rid in enumerate(ids)]
    for handle in handles:
        handle.result(timeout=300)
    engine.score(engine.encode("A short prompt to score."), job_id="stateless-job")
    stats = engine.cache_stats()
    assert stats["prefix_lookups"] > 0 and stats["blocks_cached"] > 0, "positive control: blocks were cached"
    kv = engine.loop.scheduler.kv  # the KV manager has held them: a control for the walk itself
    probe: list[str] = []
    _walk({"kv": kv}, "probe", set(), probe, set(ids) | {"stateless-job"})
    assert probe, "positive control: the walk finds core objects"
    probe = []
    _walk({"tables": {"stateless-0": [3, 4]}}, "probe", set(), probe, set(ids))
    assert probe, "positive control: the walk finds a request id used as a key"
    found: list[str] = []
    _walk(engine.backend, "backend", set(), found, set(ids) | {"stateless-job"})
    assert not found, "the backend holds request or block state:\n" + "\n".join(found[:20])
    for name in ("acquire", "release", "reserve", "reuse_prefix", "cache_stats", "blocks"):
        assert not hasattr(engine.backend, name), f"the backend has `{name}`: block bookkeeping is the scheduler's"
