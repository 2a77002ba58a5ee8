"""``raylens browse``: the feature browser alone over a store — a real process on loopback, no model
and no Ray, stopped at the end; a missing store is one line and exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.feature_rows import FEATURE_7, fill_store
from tests.helpers import REPO

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_browse_serves_a_stores_features_without_a_model(tmp_path):
    import httpx

    from engine.services.store import ActivationStore

    path = tmp_path / "store.duckdb"
    store = ActivationStore(path)
    fill_store(store)
    store.close()
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "browse", "--store", str(path), "--port",
                             str(port), "--no-tokenizer"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while True:  # bounded: until it answers, or the process ends, or the deadline
            assert proc.poll() is None, proc.stdout.read()
            try:
                health = httpx.get(f"{url}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "raylens browse did not answer within 120 s"
                time.sleep(0.2)
        assert health.json()["model"] is None
        feature = httpx.get(f"{url}/api/v1/features/7", timeout=30).json()
        top = feature["contexts"][0]
        assert top["request_id"] == FEATURE_7[0][0], feature
        assert httpx.get(f"{url}/", timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_browse_without_a_store_is_one_line_and_exit_2(tmp_path, capsys):
    from pipelines.cli import main

    assert main(["browse", "--store", str(tmp_path / "missing.duckdb")]) == 2
    err = capsys.readouterr().err
    assert "`--store` must name an existing activation store" in err and "Traceback" not in err
