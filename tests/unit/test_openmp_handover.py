"""The thread that hands work to the step loop gives back its OpenMP workers, so the loop's thread
holds the only team, and the loop gives back its own when it goes idle: with two teams on a small
machine libgomp wakes workers from sleep for every parallel op of the forward (engine/model/openmp.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


NEEDS_OPENMP = pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2
                                  or "OpenMP" not in torch.__config__.parallel_info(),
                                  reason="needs Linux, torch on OpenMP and at least two cores")


def _probe(source: str, *args: str) -> dict:
    """Run ``source`` in a process of its own with two OpenMP threads; what it printed last, as JSON."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", source, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# In a process of its own: the test runner's other threads (Ray's, other tests' teams) come and go
# and would blur a count of this thread's workers.
# With a folder argument, a copy of torch's libgomp is mapped first, as a wheel's vendored copy is
# (sentencepiece's, which the tokenizer loads): pausing that copy's threads reports success and
# frees none of torch's.
_PROBE = """
import ctypes, json, os, shutil, sys, threading, time
import torch
from engine.model.openmp import release_thread_team

def threads():
    return len(os.listdir("/proc/self/task"))

def mapped():
    return sorted({line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line})

box = {"torch_threads": torch.get_num_threads()}
if len(sys.argv) > 1:
    copy = os.path.join(sys.argv[1], "libgomp-copy.so.1")
    shutil.copy(mapped()[0], copy)
    ctypes.CDLL(copy)
    box["copies"] = len(mapped())

def in_a_thread():
    box["before"] = threads()
    torch.randn(2_000_000).exp_()  # large enough for torch to split it over its threads
    box["with_team"] = threads()
    box["released"] = release_thread_team()
    deadline = time.monotonic() + 10  # the workers exit on their own once told
    while threads() >= box["with_team"] and time.monotonic() < deadline:
        time.sleep(0.01)
    box["after"] = threads()
    box["again"] = release_thread_team()  # nothing held: still fine

thread = threading.Thread(target=in_a_thread)
thread.start()
thread.join(60)
print(json.dumps(box))
"""


@NEEDS_OPENMP
def test_releasing_gives_back_the_calling_threads_workers():
    box = _probe(_PROBE)
    assert box["torch_threads"] == 2
    assert box["with_team"] > box["before"], box  # positive control: the parallel op made workers
    assert box["after"] < box["with_team"], box
    assert box["released"] and box["again"]


def test_the_step_loop_releases_the_submitting_thread_and_its_own_only_when_idle(engine, monkeypatch):
    from engine.core import step_loop

    loop = engine.loop
    seen: list[tuple[str, bool]] = []  # (thread, did the loop hold requests then)
    monkeypatch.setattr(step_loop, "release_thread_team",
                        lambda: seen.append((threading.current_thread().name, bool(loop.scheduler.running))))
    result = engine.generate("Hello", max_tokens=2, temperature=0.0)
    assert result.sequence_ids  # positive control: it ran on the loop
    assert loop._thread is not None
    deadline = time.monotonic() + 30  # the loop goes idle just after the result is handed back
    while not any(name == loop._thread.name for name, _ in seen) and time.monotonic() < deadline:
        time.sleep(0.01)
    submitter = threading.current_thread().name
    assert (submitter, False) in seen, seen  # handed over before the loop took the request
    by_loop = [busy for name, busy in seen if name == loop._thread.name]
    assert by_loop, seen  # the idle loop gave its team back
    assert not any(by_loop), seen  # never between the steps of a request
    assert {name for name, _ in seen} <= {submitter, loop._thread.name}, seen


@NEEDS_OPENMP
def test_releasing_frees_torchs_workers_with_another_libgomp_mapped(tmp_path):
    box = _probe(_PROBE, str(tmp_path))
    assert box["copies"] == 2, box  # positive control: two copies mapped
    assert box["with_team"] > box["before"], box  # and the parallel op made workers
    assert box["released"], box
    assert box["after"] < box["with_team"], box


# A real engine (its tokenizer maps the other libgomp copy where sentencepiece is installed): after
# the loop's thread runs a parallel op, going idle gives its workers back.
_IDLE_LOOP_PROBE = """
import json, os, time
import torch
from engine import Engine
from tests.helpers import build_config

def threads():
    return len(os.listdir("/proc/self/task"))

def settled():
    deadline, last, since = time.monotonic() + 20, threads(), time.monotonic()
    while time.monotonic() - since < 1.0 and time.monotonic() < deadline:  # unchanged for a second
        time.sleep(0.02)
        if threads() != last:
            last, since = threads(), time.monotonic()
    return last

box = {}
with Engine(build_config()) as engine:
    box["generated"] = len(engine.generate("Hello", max_tokens=2, temperature=0.0).output_ids)
    box["idle"] = settled()

    def parallel(loop):
        torch.randn(2_000_000).exp_()  # large enough for torch to split it over its threads
        box["busy"] = threads()

    engine.loop.call(parallel)
    box["idle_again"] = settled()
print(json.dumps(box))
"""


@NEEDS_OPENMP
def test_an_idle_step_loop_holds_no_openmp_workers():
    box = _probe(_IDLE_LOOP_PROBE)
    assert box["generated"] == 2, box
    assert box["busy"] > box["idle"], box  # positive control: the loop's op made workers (none were kept)
    assert box["idle_again"] < box["busy"], box


# A manager's own mod worker: the engine's host copy of a step's logits takes no OpenMP team there.
_MODS_PROBE = """
import json, os
import torch
from engine.model.tensor import HostLogits
from mods.manager import ModManager
from mods.types import Sampled

def threads():
    return len(os.listdir("/proc/self/task"))

logits = torch.randn(64, 49_152)  # a step's batch of logits (float32, CPU)
box = {}

def reads_logits(event, tokenizer=None):
    box["lent"] = HostLogits(logits, rows=list(range(64))).lend(5) is not None
    return None

def parallel_torch(event, tokenizer=None):
    torch.randn(2_000_000).exp_()  # large enough for torch to split it over its threads
    box["during"] = threads()
    return None

manager = ModManager([lambda e, t=None: None], call_timeout_s=30.0)
manager.dispatch(Sampled("r", 0, 1))
base = threads()  # the manager's worker thread exists now, with no team
manager.mods = [reads_logits]
manager.dispatch(Sampled("r", 1, 1))
box["after_copy"] = threads() - base
manager.mods = [parallel_torch]
manager.dispatch(Sampled("r", 2, 1))
box["made"] = box["during"] - base
manager.close()
print(json.dumps(box))
"""


@NEEDS_OPENMP
def test_the_host_copy_of_the_logits_makes_no_openmp_team_on_a_mods_thread():
    box = _probe(_MODS_PROBE)
    assert box["lent"] and box["after_copy"] == 0, box  # the copy made none
    assert box["made"] > 0, box  # positive control: a mod's own parallel op on that thread makes one
