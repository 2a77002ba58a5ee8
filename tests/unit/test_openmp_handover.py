"""The thread that hands work to the step loop gives back its OpenMP workers, so the loop's thread
holds the only team: with two teams on a small machine libgomp wakes workers from sleep for every
parallel op of the forward (engine/model/openmp.py)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.model.openmp import release_thread_team


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2
                    or "OpenMP" not in torch.__config__.parallel_info(),
                    reason="needs Linux, torch on OpenMP and at least two intra-op threads")
def test_releasing_gives_back_the_calling_threads_workers():
    def work() -> None:
        torch.randn(2_000_000).exp_()  # large enough for torch to split it over its threads

    box: dict[str, int] = {}

    def in_a_fresh_thread() -> None:  # a thread of its own: the test runner's other teams stay as they are
        work()
        box["with_team"] = _threads()
        box["released"] = release_thread_team()
        box["after"] = _threads()
        box["again"] = release_thread_team()  # nothing held: still fine

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join(60)
    assert box["with_team"] > box["after"], box  # positive control: the parallel op made workers
    assert box["released"] and box["again"]


def test_the_step_loop_releases_the_submitting_thread_not_its_own(engine, monkeypatch):
    from engine.core import step_loop

    seen: list[str] = []
    monkeypatch.setattr(step_loop, "release_thread_team", lambda: seen.append(threading.current_thread().name))
    result = engine.generate("Hello", max_tokens=2, temperature=0.0)
    assert result.sequence_ids  # positive control: it ran on the loop
    assert seen and set(seen) == {threading.current_thread().name}, seen
    assert engine.loop._thread is not None and engine.loop._thread.name not in seen
