"""Payload timestamps: ``iso_time`` formats the date part once per second (a payload holds one
timestamp per event), and must give exactly what ``datetime`` gives, microseconds included."""

from __future__ import annotations

import random
from datetime import datetime, timezone

import pytest

from engine.services.ingest_payload import iso_time


def _reference(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat().replace("+00:00", "Z")


def test_iso_time_equals_datetime_for_random_and_clustered_timestamps():
    rng = random.Random(7)
    spread = [rng.uniform(0, 4e9) for _ in range(20_000)]
    start = rng.uniform(1.7e9, 1.9e9)
    clustered = [start + i * 0.000137 for i in range(20_000)]  # one payload's events: many per second
    every_micro = [1_800_000_000 + k / 1e6 for k in range(0, 1_000_000, 331)]
    for epoch in spread + clustered + every_micro:
        assert iso_time(epoch) == _reference(epoch), epoch


@pytest.mark.parametrize("epoch", [0.0, 1.0, 1_800_000_000.0, 1_800_000_000.0000005, 1_800_000_000.0000015,
                                   1_800_000_000.9999995, 1_800_000_000.99999949, 1_234_567_890.0000005])
def test_iso_time_rounds_and_carries_like_datetime(epoch):
    assert iso_time(epoch) == _reference(epoch)
    assert iso_time(epoch).endswith("Z")
