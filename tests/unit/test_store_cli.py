"""``raylens query``/``raylens store`` on empty, missing and damaged stores, with bad arguments,
and the read-only SQL the StoreActor offers."""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone

import duckdb
import pyarrow as pa
import pytest

from engine.services.store import ActivationStore, StoreCorruptError, StoreError
from engine.services.store_schema import ACTIVATION_SCHEMA
from pipelines.cli import main


def rows(n: int) -> pa.Table:
    now = datetime.now(timezone.utc)
    return pa.table({
        "request_id": ["A"] * n, "step": list(range(n)), "token_position": list(range(n)),
        "token_id": [100 + i % 50 for i in range(n)], "created_at": [now] * n, "sae_release": ["s"] * n,
        "sae_layer": [16] * n, "feature_id": [i % 97 for i in range(n)],
        "activation_value": [float(i % 13) for i in range(n)], "rank": [0] * n, "source_mode": ["inline"] * n,
        "model_id": ["m"] * n,
    }, schema=ACTIVATION_SCHEMA)


def config_for(tmp_path, db_path) -> str:
    path = tmp_path / "cfg.yaml"
    path.write_text(f"activations:\n  db_path: {db_path}\n  parquet_path: {tmp_path / 'parquet'}\n")
    return str(path)


@pytest.fixture
def empty_cfg(tmp_path):
    db = tmp_path / "store" / "a.duckdb"
    ActivationStore(db).close()
    return config_for(tmp_path, db)


@pytest.mark.parametrize("argv", [
    ["query", "top", "--request-id", "none"],
    ["query", "deltas", "--request-id", "none", "--feature", "3", "--ids-only"],
    ["query", "threshold", "--feature", "3", "--min", "0", "--since", "7d", "--ids-only"],
    ["query", "tokens", "--feature", "3", "--ids-only"],
])
def test_every_query_kind_on_an_empty_store_prints_no_rows(empty_cfg, capsys, argv):
    assert main(argv + ["--config", empty_cfg]) == 0
    assert "(no rows)" in capsys.readouterr().out
    assert main(argv + ["--config", empty_cfg, "--json"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv,name", [
    (["query", "top", "--request-id", "A", "--limit", "0"], "limit"),
    (["query", "top", "--request-id", "A", "--limit", str(2**64)], "limit"),
    (["query", "top", "--request-id", "A", "--step", "-3"], "step"),
    (["query", "deltas", "--request-id", "A", "--feature", str(2**70)], "feature"),
    (["query", "threshold", "--feature", "1", "--min", "0", "--since", "100000000000d"], "since"),
    (["query", "threshold", "--feature", "1", "--min", "inf"], "min"),
    (["query", "tokens", "--feature", "1", "--context", "-1"], "context"),
    (["query", "explain", str(2**64)], "feature"),
    (["store", "retention", "--days", "0"], "days"),
    (["store", "retention", "--days", str(2**64)], "days"),
])
def test_out_of_range_arguments_are_one_line_errors_exit_2(empty_cfg, capsys, argv, name):
    assert main(argv + ["--config", empty_cfg]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"raylens: error: `{name}` must be") and "\n" not in err, err


@pytest.mark.parametrize("action", ["retention", "export", "info"])
def test_housekeeping_on_a_path_with_no_store_is_an_error_and_creates_nothing(tmp_path, capsys, action):
    db = tmp_path / "nowhere" / "a.duckdb"
    assert main(["store", action, "--config", config_for(tmp_path, db)]) == 2
    assert "no activation store at" in capsys.readouterr().err
    assert not db.exists() and not db.parent.exists()


def test_retention_on_an_existing_store_still_runs(empty_cfg, capsys):
    # positive control: the existence check does not stop the normal case
    assert main(["store", "retention", "--days", "3", "--config", empty_cfg]) == 0
    assert "retention 3 d" in capsys.readouterr().out


def _damage_a_data_block(src, dst) -> None:
    """Copy ``src`` and overwrite bytes inside a block that holds activation rows."""
    con = duckdb.connect(str(src), read_only=True)
    block = con.execute("SELECT min(block_id) FROM pragma_storage_info('activations') WHERE block_id >= 0").fetchone()[0]
    block_size = con.execute("SELECT block_size FROM pragma_database_size()").fetchone()[0]
    con.close()
    shutil.copy(src, dst)
    data = bytearray(dst.read_bytes())
    offset = 3 * 4096 + block * block_size + 4096  # three header pages, then the blocks
    data[offset:offset + 256] = bytes((b + 1) % 256 for b in data[offset:offset + 256])
    dst.write_bytes(bytes(data))


def test_store_info_reports_a_damaged_file_instead_of_looking_healthy(tmp_path, capsys):
    good = tmp_path / "good.duckdb"
    with ActivationStore(good) as store:
        store.append_activations(rows(20_000), batch_id="b1", request_id="A")
        store.cursor().execute("CHECKPOINT")
    bad = tmp_path / "bad.duckdb"
    _damage_a_data_block(good, bad)

    assert main(["store", "info", "--config", config_for(tmp_path, good)]) == 0  # positive control
    info = json.loads(capsys.readouterr().out)
    assert info["integrity"] == "ok" and info["activations"] == 20_000

    assert main(["store", "info", "--config", config_for(tmp_path, bad)]) == 2
    err = capsys.readouterr().err
    assert "is damaged: table `activations`" in err and "checksum" in err, err
    with ActivationStore(bad, read_only=True) as store:
        assert store.counts()["activations"] == 20_000  # what made it look healthy before
        with pytest.raises(StoreCorruptError):
            store.verify()


@pytest.mark.parametrize("argv", [["query", "top", "--request-id", "A"],
                                  ["query", "tokens", "--feature", "1", "--ids-only"],
                                  ["query", "threshold", "--feature", "1", "--min", "0", "--ids-only"]])
def test_a_query_on_a_damaged_store_is_the_one_line_store_info_gives_not_a_traceback(tmp_path, capsys, argv):
    good = tmp_path / "good.duckdb"
    with ActivationStore(good) as store:
        store.append_activations(rows(20_000), batch_id="b1", request_id="A")
        store.cursor().execute("CHECKPOINT")
    bad = tmp_path / "bad.duckdb"
    _damage_a_data_block(good, bad)
    assert main([*argv, "--config", config_for(tmp_path, good)]) == 0  # positive control
    capsys.readouterr()
    assert main([*argv, "--config", config_for(tmp_path, bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("raylens: error: the activation store") and "is damaged: table `activations`" in err, err
    assert "\n" not in err and "Traceback" not in err


def test_a_file_that_is_not_a_duckdb_database_is_reported_damaged(tmp_path, capsys):
    bad = tmp_path / "text.duckdb"
    bad.write_text("not a database")
    assert main(["store", "info", "--config", config_for(tmp_path, bad)]) == 2
    assert "is damaged" in capsys.readouterr().err


# ------------------------------------------------------------------------------ read-only SQL


@pytest.fixture
def store(tmp_path):
    with ActivationStore(tmp_path / "s.duckdb") as s:
        s.append_activations(rows(10), batch_id="b1", request_id="A")
        yield s


def test_read_sql_answers_selects(store):
    assert store.read_sql("SELECT count(*) FROM activations WHERE step >= ?", [5]) == [(5,)]
    assert store.read_sql("WITH t AS (SELECT 1 AS x) SELECT x FROM t") == [(1,)]


@pytest.mark.parametrize("statement", [
    "DELETE FROM activations",
    "INSERT INTO write_batches VALUES ('x', 'A', 1, now())",
    "DROP TABLE activations",
    "SELECT 1; DELETE FROM activations",
    "COPY activations TO '/tmp/raylens-should-not-exist.csv'",
    "ATTACH ':memory:' AS other",
    "CHECKPOINT",
    "SET threads = 1",
])
def test_read_sql_refuses_anything_but_one_select(store, statement):
    with pytest.raises(StoreError, match="must be exactly one read-only SELECT"):
        store.read_sql(statement)
    assert store.counts()["activations"] == 10


def test_a_select_that_writes_through_a_cte_is_rolled_back(store):
    deleted = store.read_sql("WITH d AS (DELETE FROM activations RETURNING *) SELECT count(*) FROM d")
    assert deleted == [(10,)]  # DuckDB did run the delete inside the statement …
    assert store.counts()["activations"] == 10  # … and it was rolled back


def test_train_sae_takes_the_training_options_and_hands_them_on(monkeypatch, capsys):
    """``raylens train-sae`` used to refuse every option (an argparse remainder after a subcommand
    does not take leading options); it now parses the same options as the module does."""
    from pipelines.sae_training import train

    seen = {}
    monkeypatch.setattr(train, "run", lambda cfg, args: seen.update(cfg=cfg, out=args.out) or 0)
    assert main(["train-sae", "--corpus", "broad-manuals", "--width", "8192", "--out", "/tmp/sae-x"]) == 0
    assert seen["cfg"] == train.config_from(train._parse(["--corpus", "broad-manuals", "--width", "8192"])[1])
    assert seen["cfg"].corpus == "broad-manuals" and seen["cfg"].width == 8192 and str(seen["out"]) == "/tmp/sae-x"
    with pytest.raises(SystemExit) as exited:
        main(["train-sae", "--corpus", "nope"])
    assert exited.value.code == 2 and "broad-manuals" in capsys.readouterr().err
