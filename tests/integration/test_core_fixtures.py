"""The generation core gives today what it gave when ``tests/data/core_fixtures.json`` was recorded
(before the core was rebuilt around a scheduler that owns requests and KV blocks): the same
tokens, the same events with the same internals, the same payloads and the same SAE rows, for one
request, a batch whose mods take every kind of action, a prefix-cache hit, a chunked prefill
beside a decoding neighbour and the inline SAE (``tests/core_fixtures.py`` says what each digest
holds). Token ids, texts, event order and payload structure must match exactly; floats within
float32 noise (a value's relative change of 1e-4)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from tests.core_fixtures import FIXTURE, RECORDED_FORWARD, build_engines, record

pytestmark = pytest.mark.slow
REL_TOL = 1e-4


def _compare(now: Any, then: Any, path: str, diffs: list[str]) -> None:
    if len(diffs) >= 20:
        return
    if isinstance(then, dict):
        if not isinstance(now, dict) or now.keys() != then.keys():
            diffs.append(f"{path}: keys {sorted(now) if isinstance(now, dict) else type(now).__name__} "
                         f"vs recorded {sorted(then)}")
            return
        for key in then:
            _compare(now[key], then[key], f"{path}.{key}", diffs)
    elif isinstance(then, list):
        if not isinstance(now, list) or len(now) != len(then):
            diffs.append(f"{path}: {len(now) if isinstance(now, list) else now!r} items vs recorded {len(then)}")
            return
        for i, (a, b) in enumerate(zip(now, then)):
            _compare(a, b, f"{path}[{i}]", diffs)
    elif isinstance(then, float) and isinstance(now, (int, float)) and not isinstance(now, bool):
        if not (math.isclose(now, then, rel_tol=REL_TOL, abs_tol=REL_TOL) or (math.isnan(now) and math.isnan(then))):
            diffs.append(f"{path}: {now!r} vs recorded {then!r} (relative tolerance {REL_TOL})")
    elif now != then:
        diffs.append(f"{path}: {now!r} vs recorded {then!r}")


@pytest.fixture(scope="module")
def digests(tmp_path_factory):
    engine, small, sae_engine = build_engines(tmp_path_factory.mktemp("core-fixtures"), **RECORDED_FORWARD)
    try:
        yield record(engine, small, sae_engine)
    finally:
        sae_engine.close()
        small.close()
        engine.close()


@pytest.mark.parametrize("scenario", ["single", "batch", "prefix", "chunked", "sae"])
def test_core_gives_the_recorded_results(digests, scenario):
    recorded = json.loads(FIXTURE.read_text())
    now = json.loads(json.dumps(digests[scenario]))  # the same JSON round trip the recording took
    diffs: list[str] = []
    _compare(now, recorded[scenario], scenario, diffs)
    assert not diffs, "the core's results moved from the recorded ones (first differences):\n" + "\n".join(diffs)


def test_the_recorded_scenarios_exercise_what_they_claim(digests):
    """Positive controls: each mod acted, the prefix was reused, the long prompt was chunked,
    and the SAE stored rows — else the comparison above would hold vacuously."""
    batch = digests["batch"]
    plain = batch["plain"]["sequence_ids"]
    assert batch["logits"]["payload"]["actions"][0]["action_type"] == "AdjustedLogits"
    assert {a["action_type"] for a in batch["backtrack"]["payload"]["actions"]} == {"Backtrack"}
    assert {a["action_type"] for a in batch["forced"]["payload"]["actions"]} == {"ForceTokens"}
    assert batch["prefill"]["payload"]["actions"][0]["action_type"] == "AdjustedPrefill"
    assert len(plain) > 0
    assert digests["prefix"]["hit_tokens"] >= 16, digests["prefix"].get("hit_tokens")
    long = digests["chunked"]["long"]
    assert len(long["prompt_ids"]) > 24, "the long prompt must exceed the 24-token step budget to be chunked"
    assert long["events"][0]["hidden_states"]["shape"][0] == len(long["prompt_ids"])
    assert len(digests["sae"]["rows"]) > 0
