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


@pytest.fixture
def seed() -> int:
    return 1234


@pytest.fixture(scope="session")
def ingest_schema():
    import json
    from pathlib import Path

    from .helpers import SHARED_DOCS

    return json.loads((Path(SHARED_DOCS) / "ingest-payload.schema.json").read_text())
