"""ActivationStore: schema migrations, atomic idempotent appends, retention, export, faults."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timedelta, timezone

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from engine.services.store import (
    ActivationStore,
    RequestRecord,
    StoreError,
    StoreLockedError,
    StoreNotFoundError,
    StoreSchemaError,
)
from engine.services.store_schema import ACTIVATION_SCHEMA, LATEST_VERSION, MIGRATIONS

UTC = timezone.utc


def rows(request_id="r1", n=10, *, start_step=0, created=None, seed=0) -> pa.Table:
    rng = np.random.default_rng(seed)
    created = created or datetime.now(UTC)
    return pa.table({
        "request_id": [request_id] * n,
        "step": np.arange(start_step, start_step + n, dtype=np.int32),
        "token_position": np.arange(n, dtype=np.int32) + 5,
        "token_id": rng.integers(0, 1000, n, dtype=np.int32),
        "created_at": pa.array([created] * n, pa.timestamp("us", tz="UTC")),
        "sae_release": ["test-sae"] * n,
        "sae_layer": np.full(n, 16, np.int16),
        "feature_id": rng.integers(0, 4096, n, dtype=np.int32),
        "activation_value": rng.random(n, dtype=np.float32) * 10,
        "rank": np.zeros(n, np.int16),
        "source_mode": ["inline"] * n,
        "model_id": ["m"] * n,
    }, schema=ACTIVATION_SCHEMA)


@pytest.fixture
def store(tmp_path):
    with ActivationStore(tmp_path / "a.duckdb", tmp_path / "parquet", threads=1) as s:
        yield s


def test_migrations_are_recorded_and_the_schema_is_current(store):
    assert store.schema_version() == LATEST_VERSION
    recorded = store.cursor().execute("SELECT version, description FROM schema_migrations ORDER BY version").fetchall()
    assert [v for v, _ in recorded] == [m.version for m in MIGRATIONS]
    assert store.counts() == {"activations": 0, "requests": 0, "write_batches": 0, "missing_blocks": 0,
                              "expected_blocks": 0}


def test_an_older_store_upgrades_in_place_keeping_its_rows(tmp_path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, description VARCHAR NOT NULL, "
                "applied_at TIMESTAMPTZ NOT NULL)")
    for statement in MIGRATIONS[0].statements:
        con.execute(statement)
    con.execute("INSERT INTO schema_migrations VALUES (1, 'v1', now())")
    con.register("r", rows(n=3))
    con.execute("INSERT INTO activations SELECT * FROM r")
    con.close()
    with ActivationStore(path) as upgraded:
        assert upgraded.schema_version() == LATEST_VERSION
        assert upgraded.counts()["activations"] == 3  # additive: nothing rewritten or dropped
        upgraded.cursor().execute("SELECT count(*) FROM feature_metadata").fetchall()


def test_appends_are_atomic_and_idempotent_by_batch_id(store):
    assert store.append_activations(rows(n=7), batch_id="r1/0", request_id="r1") == 7
    assert store.append_activations(rows(n=7), batch_id="r1/0", request_id="r1") == 0  # a retry
    assert store.append_activations(rows(n=4, start_step=7), batch_id="r1/1", request_id="r1") == 4
    assert store.counts()["activations"] == 11 and store.counts()["write_batches"] == 2
    bad = rows(n=2).set_column(0, "request_id", pa.array([None, None], pa.string()))
    with pytest.raises(duckdb.ConstraintException):
        store.append_activations(bad, batch_id="r1/2", request_id="r1")
    assert store.counts()["activations"] == 11  # the failed batch left nothing behind


def test_requests_and_missing_blocks_are_recorded(store):
    store.record_request(RequestRecord("r1", "m", "hi", "hello", [1, 2], [3], "stop", {"temperature": 0}))
    store.record_request(RequestRecord("r1", "m", "hi", "hello again", [1, 2], [3, 4], "length", {}))
    assert store.cursor().execute("SELECT output_text, output_ids FROM requests").fetchall() == [("hello again", [3, 4])]
    store.record_missing_block(batch_id="r1/3", request_id="r1", first_step=3, last_step=5, token_count=3,
                               reason="RuntimeError: encoder died")
    assert store.counts()["missing_blocks"] == 1


def test_expected_blocks_clear_on_arrival_and_become_missing_when_abandoned(store):
    for i in range(3):
        store.expect_block(batch_id=f"g/{i}", request_id="g", first_step=i * 4, last_step=i * 4 + 3, token_count=4)
    store.append_activations(rows("g", 4), batch_id="g/0", request_id="g")
    assert store.counts()["expected_blocks"] == 2
    assert store.abandon_request("g", "generator died") == 2
    missing = store.cursor().execute("SELECT batch_id, reason FROM missing_blocks ORDER BY batch_id").fetchall()
    assert missing == [("g/1", "generator died"), ("g/2", "generator died")]
    store.append_activations(rows("g", 4, start_step=8), batch_id="g/2", request_id="g")  # a late arrival
    assert [b for b, in store.cursor().execute("SELECT batch_id FROM missing_blocks").fetchall()] == ["g/1"]
    store.expect_block(batch_id="g/0", request_id="g", first_step=0, last_step=3, token_count=4)  # crossed calls
    assert store.counts()["expected_blocks"] == 0
    store.expect_block(batch_id="g/9", request_id="g", first_step=36, last_step=39, token_count=4)  # announced late
    assert store.counts()["expected_blocks"] == 0 and store.counts()["missing_blocks"] == 2


def test_retention_deletes_old_rows_and_shrinks_the_file(store):
    now = datetime.now(UTC)
    for i in range(20):
        store.append_activations(rows(f"old{i}", 20_000, created=now - timedelta(days=30), seed=i),
                                 batch_id=f"old{i}/0", request_id=f"old{i}")
    store.append_activations(rows("new", 500, created=now), batch_id="new/0", request_id="new")
    store.record_request(RequestRecord("old0", "m", None, "", [], [], "stop", {}, created_at=now - timedelta(days=30)))
    store.cursor().execute("CHECKPOINT")
    result = store.apply_retention(14)
    assert result.deleted_rows == 400_000 and result.deleted_requests == 1
    assert store.counts()["activations"] == 500
    assert result.bytes_after < result.bytes_before / 3, f"{result.bytes_before} → {result.bytes_after}"
    assert store.append_activations(rows("after", 3), batch_id="after/0", request_id="after") == 3  # still writable


def test_parquet_export_is_partitioned_by_date(store, tmp_path):
    day = datetime(2026, 11, 1, 12, tzinfo=UTC)
    store.append_activations(rows("a", 5, created=day), batch_id="a/0", request_id="a")
    store.append_activations(rows("b", 3, created=day + timedelta(days=1)), batch_id="b/0", request_id="b")
    result = store.export_parquet(tmp_path / "export")
    assert result.rows == 8
    assert sorted({f.split("/")[0] for f in result.files}) == ["date=2026-11-01", "date=2026-11-02"]
    back = duckdb.sql(f"SELECT count(*) FROM read_parquet('{tmp_path}/export/*/*.parquet')").fetchall()
    assert back == [(8,)]


def test_read_only_open_of_a_missing_store_is_clear(tmp_path):
    with pytest.raises(StoreNotFoundError, match="run a generation with --sae first"):
        ActivationStore(tmp_path / "none.duckdb", read_only=True)


def test_an_unwritable_location_is_clear(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create the store directory"):
        ActivationStore(blocker / "sub" / "a.duckdb")


def test_a_query_on_a_store_without_our_tables_is_clear(tmp_path):
    from engine.services.queries import top_features

    path = tmp_path / "foreign.duckdb"
    duckdb.connect(str(path)).close()
    with ActivationStore(path, read_only=True) as store:
        with pytest.raises(StoreSchemaError, match="lacks a table"):
            top_features(store, "r1")


def _holder(path, ready) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import duckdb, sys, pathlib
        con = duckdb.connect({str(path)!r})
        pathlib.Path({str(ready)!r}).write_text("held")
        sys.stdin.read()  # hold the lock until the test closes our stdin
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


def test_a_store_locked_by_another_process_is_a_clear_error(tmp_path):
    path, ready = tmp_path / "locked.duckdb", tmp_path / "ready"
    holder = _holder(path, ready)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the lock-holding process did not start"
        with pytest.raises(StoreLockedError, match="open in another process .*PID"):
            ActivationStore(path)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_writer_killed_mid_write_loses_at_most_the_batch_in_flight(tmp_path):
    """SIGKILL a process appending 5,000-row batches; the store reopens readable and every batch is
    whole (rows == 5,000 × recorded batches)."""
    path = tmp_path / "crash.duckdb"
    progress = tmp_path / "progress"
    code = textwrap.dedent(f"""
        import pathlib, sys
        sys.path.insert(0, {str(os.getcwd())!r})
        from tests.unit.test_store import rows
        from engine.services.store import ActivationStore
        store = ActivationStore({str(path)!r}, threads=1)
        for i in range(10_000):
            store.append_activations(rows("r", 5000, seed=i), batch_id=f"r/{{i}}", request_id="r")
            pathlib.Path({str(progress)!r}).write_text(str(i))
    """)
    writer = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not progress.exists() or int(progress.read_text() or 0) < 5):
            time.sleep(0.05)
        assert progress.exists(), "the writer did not get going"
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait(timeout=30)
    with ActivationStore(path) as reopened:
        counts = reopened.counts()
        assert counts["write_batches"] >= 5
        assert counts["activations"] == 5000 * counts["write_batches"], counts
