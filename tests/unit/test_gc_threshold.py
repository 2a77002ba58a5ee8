"""Start-up freezes the objects alive then and raises the collector's young threshold (a step
allocates thousands of short-lived tracked objects); a larger threshold, or a collector the
process turned off, is left as it is."""

from __future__ import annotations

import gc

import pytest

from engine.engine import GC_YOUNG_THRESHOLD, freeze_startup_objects


@pytest.fixture
def restore_gc():
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*threshold)
    gc.unfreeze()
    if enabled:
        gc.enable()


@pytest.mark.parametrize("before, after", [
    ((700, 10, 10), (GC_YOUNG_THRESHOLD, 10, 10)),
    ((50_000, 5, 7), (50_000, 5, 7)),
    ((0, 10, 10), (0, 10, 10)),
])
def test_freeze_raises_the_young_threshold_only_upwards(restore_gc, before, after):
    gc.set_threshold(*before)
    freeze_startup_objects()
    assert gc.get_threshold() == after
    assert gc.get_freeze_count() > 0
