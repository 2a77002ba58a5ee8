"""The step's logits-sized host buffers stay in the heap from one step to the next
(``backend.host_memory``, engine/model/host_memory.py): a step that allocates and frees a few
12.6 MB buffers faults no page in once the thresholds are set, and a user's own malloc settings
are kept. Each case runs in a child interpreter: the setting is process-wide and set once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.skipif(not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"),
                                reason="the thresholds are glibc malloc's")

# a step's host buffers at 64 requests on a 49,152-token vocabulary: the logits, their log-softmax,
# the mods' copy; made and freed on a thread of its own, as the step loop does
_CHILD = r"""
import json, resource, sys, threading
import numpy as np
applied = None
if sys.argv[1] == "retain":
    from engine.model.host_memory import retain_freed_memory
    applied = retain_freed_memory()
def step():
    logits = np.ones((64, 49152), np.float32)
    logp = np.log(logits)
    copy = logp.copy()
    return float(copy[0, 0])
faults = []
def run():
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
thread = threading.Thread(target=run)
thread.start()
thread.join()
print(json.dumps({"applied": applied, "faults_per_step": faults[0]}))
"""


def _child(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    environment.update(env, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], env=environment, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_step_of_logits_sized_buffers_faults_no_pages_in_once_they_are_retained():
    plain = _child("plain")
    retained = _child("retain")
    assert retained["applied"] is True
    # 3 buffers of 12.6 MB are ~9,000 pages: glibc maps (or trims) and faults at least some of them each step
    assert plain["faults_per_step"] > 500, f"the control step faulted no pages in: {plain}"
    assert retained["faults_per_step"] * 10 < plain["faults_per_step"], (plain, retained)


def test_the_users_own_malloc_thresholds_are_kept():
    for env in ({"MALLOC_TRIM_THRESHOLD_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}):
        kept = _child("retain", **env)
        assert kept["applied"] is False, env
        assert kept["faults_per_step"] > 500, f"the user's setting was overridden: {env} {kept}"


def test_the_backend_sets_them_when_it_loads_unless_told_off(monkeypatch):
    import engine.model.hf as hf
    from engine.config import BackendConfig
    from engine.errors import ConfigError

    calls = []
    monkeypatch.setattr(hf, "retain_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(hf, "load_model_and_tokenizer", _stop_loading)
    for mode, expected in (("off", 0), ("auto", 1)):
        backend = hf.HuggingFaceBackend()
        with pytest.raises(_Stopped):
            backend.load_model("embedded", BackendConfig(model_id="embedded", device="cpu", host_memory=mode))
        # set before the model loads: the weights' and the first steps' buffers are served the same way
        assert len(calls) == expected, mode
    with pytest.raises(ConfigError, match="host_memory"):
        BackendConfig(model_id="embedded", device="cpu", host_memory="sometimes")


class _Stopped(Exception):
    pass


def _stop_loading(*_, **__):
    raise _Stopped
