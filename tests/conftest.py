"""Shared fixtures. Nothing here loads a model at import time; the embedded model loads once per
session, on first use, through :func:`engine`."""

from __future__ import annotations

import os

import pytest

# No test may reach a model hub: everything comes from the embedded model's local cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray on Linux swaps 127.0.0.1 for the machine's outward IP when it connects; this flag (read
# when ray is imported) keeps every Ray address and listener on loopback, as tests must.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# No Ray started by a test (a head, a job's own cluster, `ray.init()`) reports usage statistics.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def _ray_token_for_tests() -> None:
    """Ray 2.60 turns on token authentication once ~/.ray/auth_token exists, after which clients
    without RAY_AUTH_MODE=token are refused. Tests run with token auth on, with a token of their
    own, so they pass the same whether or not this machine's home holds one."""
    import secrets
    import tempfile

    if "RAY_AUTH_TOKEN_PATH" in os.environ or "RAY_AUTH_TOKEN" in os.environ:
        return
    path = os.path.join(tempfile.gettempdir(), f"raylens-test-ray-token-{os.getpid()}")
    with open(path, "w") as handle:
        handle.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_TOKEN_PATH"] = path
    os.environ.setdefault("RAY_AUTH_MODE", "token")


_ray_token_for_tests()


@pytest.fixture
def release_stuck_mods():
    """An event the tests' stuck mods wait on; set at teardown, when every thread abandoned in a
    mod must end (its mod returned) within a bound."""
    import threading

    from mods.manager import abandoned_mod_threads

    event = threading.Event()
    yield event
    event.set()
    for thread in abandoned_mod_threads():
        thread.join(timeout=10)
    assert not abandoned_mod_threads(), "a thread abandoned in a mod did not end after its mod returned"


@pytest.fixture(scope="session")
def engine():
    """The embedded SmolLM2-135M-Instruct on CPU, loaded once; treat it as read-only."""
    from engine import Engine

    from .helpers import build_config

    with Engine(build_config()) as eng:
        yield eng


@pytest.fixture(scope="session")
def tokenizer(engine):
    return engine.tokenizer


@pytest.fixture(scope="session")
def model_id(engine):
    """The embedded model's id, as the servers list it."""
    return engine.backend.info.model_id


@pytest.fixture
def seed() -> int:
    return 1234


@pytest.fixture(scope="session")
def ingest_schema():
    import json
    from pathlib import Path

    from .helpers import SHARED_DOCS

    return json.loads((Path(SHARED_DOCS) / "ingest-payload.schema.json").read_text())
