"""ActivationStore: the one owner of a DuckDB activation database, plus Parquet export.

DuckDB lets exactly one process open a database file for writing; this class holds that one
explicit connection (never DuckDB's hidden module-global one) and gives each thread its own
cursor, as DuckDB's Python docs prescribe for threads. In a Ray deployment the StoreActor is the
process that owns it.

Writes: rows arrive as Arrow tables and go in with one ``INSERT … SELECT`` per batch, in one
transaction together with the batch's id in ``write_batches`` — so a batch is either wholly in
the store or not at all (a crash loses at most the batch in flight), and appending the same batch
id again is a no-op (retries are safe).

Retention deletes rows older than N days. DuckDB reuses freed blocks but never shrinks the file,
so retention then compacts: it copies the live data into a fresh file and swaps it in.

Integrity: DuckDB checksums every block, but checks a block only when it reads it, and opening a
file or counting rows reads almost none — a damaged file looks healthy until a query touches the
damaged block. :meth:`ActivationStore.verify` reads every column of every table, so DuckDB's own
checksums run over the whole file.

:meth:`ActivationStore.read_sql` runs caller-written SQL read-only: only statements DuckDB's parser
types as SELECT, in a transaction that is always rolled back (a SELECT can still write, through a
data-modifying CTE such as ``WITH d AS (DELETE … RETURNING *) SELECT …``).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Sequence

import duckdb
import pyarrow as pa

from engine.config import ActivationsConfig
from engine.errors import RaylensError
from engine.services.store_schema import ACTIVATION_SCHEMA, LATEST_VERSION, MIGRATIONS

__all__ = [
    "ActivationStore",
    "StoreError",
    "StoreLockedError",
    "StoreNotFoundError",
    "StoreSchemaError",
    "StoreCorruptError",
    "MAX_AGE_DAYS",
    "RequestRecord",
    "RetentionResult",
    "ExportResult",
]


class StoreError(RaylensError):
    """The activation store cannot be opened or written."""


class StoreLockedError(StoreError):
    """Another process holds the database. Recoverable once it closes."""

    recoverable = True


class StoreNotFoundError(StoreError):
    """A read-only open of a store that was never written."""


class StoreSchemaError(StoreError):
    """The store lacks a table or is newer than this code."""


class StoreCorruptError(StoreError):
    """The file is not a DuckDB database, or a block fails DuckDB's checksum. Not recoverable in
    place: restore a copy or a Parquet export, or move the file aside to start a new store."""


#: The longest age a retention period or ``since`` may name (100 years); beyond it dates overflow.
MAX_AGE_DAYS = 36_500

_CORRUPT_HINT = ("restore it from a copy or a Parquet export (raylens store export), or move it aside to "
                 "start a new store")


@dataclass(frozen=True)
class RequestRecord:
    """One generation, readable without the ingest backend."""

    request_id: str
    model_id: str
    prompt_text: str | None
    output_text: str
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    finish_reason: str
    config: dict[str, Any]
    created_at: datetime | None = None


@dataclass(frozen=True)
class RetentionResult:
    deleted_rows: int
    deleted_requests: int
    bytes_before: int
    bytes_after: int


@dataclass(frozen=True)
class ExportResult:
    directory: str
    rows: int
    files: list[str]


def _scalar(cur: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | None = None) -> Any:
    """The first value of a query's first row, or None. Reads the whole result: DuckDB 2 refuses
    new work on a connection with a half-read result."""
    rows = cur.execute(sql, params or []).fetchall()
    return rows[0][0] if rows else None


def _sql_string(text: str) -> str:
    """A SQL string literal, for the few statements (ATTACH, COPY TO) that take no parameters."""
    return "'" + text.replace("'", "''") + "'"


class ActivationStore:
    """``create=False``: the file must exist (housekeeping on a mistyped path must not create a
    new, empty store and report success on it)."""

    def __init__(self, db_path: str | Path, parquet_path: str | Path | None = None, *, read_only: bool = False,
                 threads: int = 2, memory_limit: str = "1GB", create: bool = True) -> None:
        self.db_path = Path(db_path)
        self.parquet_path = Path(parquet_path) if parquet_path is not None else self.db_path.parent / "parquet"
        self.read_only = read_only
        self.create = create and not read_only
        self._settings = {"threads": threads, "memory_limit": memory_limit}
        self._local = threading.local()
        self._write_lock = threading.Lock()
        self._con = self._connect()
        if not read_only:
            self.migrate()
        self._check_version()

    @classmethod
    def from_config(cls, cfg: ActivationsConfig, *, read_only: bool = False, create: bool = True) -> "ActivationStore":
        return cls(cfg.db_path, cfg.parquet_path, read_only=read_only, threads=cfg.threads,
                   memory_limit=cfg.memory_limit, create=create)

    # ------------------------------------------------------------------------------ connection

    def _connect(self) -> duckdb.DuckDBPyConnection:
        if not self.create and not self.db_path.is_file():
            raise StoreNotFoundError(f"no activation store at `{self.db_path}`; run a generation with --sae first "
                                     "(or point activations.db_path at an existing store)")
        if not self.read_only:
            try:
                self.db_path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise StoreError(f"cannot create the store directory `{self.db_path.parent}`: {err.strerror}") from err
        try:
            return duckdb.connect(str(self.db_path), read_only=self.read_only, config=self._settings)
        except duckdb.IOException as err:
            message = str(err)
            if "lock" in message.lower():
                raise StoreLockedError(
                    f"the activation store `{self.db_path}` is open in another process ({message.split('(')[-1].rstrip(').')}). "
                    "DuckDB allows one writer: stop that process, or go through the StoreActor (raylens status)"
                ) from None
            if "not a valid DuckDB database" in message or "Could not read enough bytes" in message:
                raise StoreCorruptError(f"the activation store `{self.db_path}` is damaged ({message.splitlines()[0]}); "
                                        f"{_CORRUPT_HINT}") from None
            raise StoreError(f"cannot open the activation store `{self.db_path}`: {message}") from err
        except duckdb.Error as err:
            raise StoreError(f"cannot open the activation store `{self.db_path}`: {err}") from err

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """This thread's cursor on the one connection."""
        cur = getattr(self._local, "cursor", None)
        if cur is None:
            cur = self._local.cursor = self._con.cursor()
        return cur

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None  # type: ignore[assignment]

    def __enter__(self) -> "ActivationStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------- schema

    def schema_version(self) -> int:
        try:
            version = _scalar(self.cursor(), "SELECT max(version) FROM schema_migrations")
        except duckdb.CatalogException:
            return 0
        return int(version or 0)

    def migrate(self) -> list[int]:
        """Apply every migration not yet recorded; returns the versions applied."""
        cur = self.cursor()
        cur.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                    "description VARCHAR NOT NULL, applied_at TIMESTAMPTZ NOT NULL)")
        current = self.schema_version()
        applied = []
        for migration in MIGRATIONS:
            if migration.version <= current:
                continue
            cur.execute("BEGIN TRANSACTION")
            try:
                for statement in migration.statements:
                    cur.execute(statement)
                cur.execute("INSERT INTO schema_migrations VALUES (?, ?, now())",
                            [migration.version, migration.description])
                cur.execute("COMMIT")
            except Exception:
                cur.execute("ROLLBACK")
                raise
            applied.append(migration.version)
        return applied

    def verify(self) -> None:
        """Read every column of every table so DuckDB checks every block's checksum; raise
        :class:`StoreCorruptError` naming the first table that fails."""
        cur = self.cursor()
        tables = [r[0] for r in cur.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() ORDER BY 1").fetchall()]
        for table in tables:
            try:
                # hash() of the whole row reads every column; identifiers come from the catalog
                _scalar(cur, f'SELECT count(*), max(hash(t)) FROM "{table.replace(chr(34), chr(34) * 2)}" t')
            except duckdb.Error as err:
                raise StoreCorruptError(f"the activation store `{self.db_path}` is damaged: table `{table}`: "
                                        f"{str(err).splitlines()[0]}; {_CORRUPT_HINT}") from None

    def read_sql(self, statement: str, params: list[Any] | None = None) -> list[tuple]:
        """Run one caller-written SELECT read-only → its rows. Anything else is refused: a
        statement DuckDB's parser does not type as SELECT, or more than one statement."""
        try:
            statements = self._con.extract_statements(statement)
        except duckdb.Error as err:
            raise StoreError(f"`sql` must be one valid SELECT statement: {str(err).splitlines()[0]}") from None
        kinds = [s.type.name for s in statements]
        if kinds != ["SELECT"]:
            raise StoreError(f"`sql` must be exactly one read-only SELECT statement, got {', '.join(kinds) or 'none'} "
                             f"({statement[:80]!r}); writes go through the store's own methods",
                             parameter="statement", value=statement)
        cur = self.cursor()
        cur.execute("BEGIN TRANSACTION")
        try:
            return cur.execute(statement, params or []).fetchall()
        finally:
            cur.execute("ROLLBACK")  # whatever a SELECT managed to change is undone

    def _check_version(self) -> None:
        version = self.schema_version()
        if version > LATEST_VERSION:
            raise StoreSchemaError(f"the store `{self.db_path}` has schema version {version}, newer than this "
                                   f"raylens ({LATEST_VERSION}); upgrade raylens")

    # ------------------------------------------------------------------------------- writes

    def append_activations(self, rows: pa.Table, *, batch_id: str, request_id: str) -> int:
        """Append one batch atomically; returns rows written (0 when ``batch_id`` is already stored)."""
        if self.read_only:
            raise StoreError("this store was opened read-only")
        rows = rows.select(ACTIVATION_SCHEMA.names).cast(ACTIVATION_SCHEMA)
        cur = self.cursor()
        with self._write_lock:
            cur.execute("BEGIN TRANSACTION")
            try:
                if _scalar(cur, "SELECT 1 FROM write_batches WHERE batch_id = ?", [batch_id]):
                    cur.execute("ROLLBACK")
                    return 0
                cur.register("incoming_rows", rows)
                cur.execute("INSERT INTO activations SELECT * FROM incoming_rows")
                cur.unregister("incoming_rows")
                cur.execute("INSERT INTO write_batches VALUES (?, ?, ?, now())", [batch_id, request_id, rows.num_rows])
                # the batch arrived: it is neither expected nor missing any more (it may be late)
                cur.execute("DELETE FROM expected_blocks WHERE batch_id = ?", [batch_id])
                cur.execute("DELETE FROM missing_blocks WHERE batch_id = ?", [batch_id])
                cur.execute("COMMIT")
            except Exception:
                cur.execute("ROLLBACK")
                raise
        return rows.num_rows

    def record_missing_block(self, *, batch_id: str, request_id: str, first_step: int, last_step: int,
                             token_count: int, reason: str) -> None:
        """Record that a block's features could not be computed (never a silent gap)."""
        with self._write_lock:
            self.cursor().execute(
                "INSERT INTO missing_blocks VALUES (?, ?, ?, ?, ?, ?, now()) ON CONFLICT (batch_id) DO UPDATE "
                "SET reason = excluded.reason, recorded_at = excluded.recorded_at",
                [batch_id, request_id, first_step, last_step, token_count, reason[:2000]])

    def expect_block(self, *, batch_id: str, request_id: str, first_step: int, last_step: int,
                     token_count: int) -> None:
        """Note a block handed to an SAE worker, unless it is already stored (calls may cross); for
        an abandoned request it is recorded missing straight away."""
        cur = self.cursor()
        with self._write_lock:
            if _scalar(cur, "SELECT 1 FROM write_batches WHERE batch_id = ?", [batch_id]):
                return
            reason = _scalar(cur, "SELECT reason FROM abandoned_requests WHERE request_id = ?", [request_id])
            if reason is not None:
                cur.execute("INSERT INTO missing_blocks VALUES (?, ?, ?, ?, ?, ?, now()) ON CONFLICT (batch_id) "
                            "DO NOTHING", [batch_id, request_id, first_step, last_step, token_count, reason])
                return
            cur.execute("INSERT INTO expected_blocks VALUES (?, ?, ?, ?, ?, now()) ON CONFLICT (batch_id) DO NOTHING",
                        [batch_id, request_id, first_step, last_step, token_count])

    def abandon_request(self, request_id: str, reason: str) -> int:
        """Turn a request's expected-but-unstored blocks into ``missing_blocks`` rows (its generator
        died); returns how many. A block that still arrives later is stored and un-missed."""
        cur = self.cursor()
        with self._write_lock:
            cur.execute("BEGIN TRANSACTION")
            moved = _scalar(cur, "SELECT count(*) FROM expected_blocks WHERE request_id = ?", [request_id])
            cur.execute(
                "INSERT INTO missing_blocks SELECT batch_id, request_id, first_step, last_step, token_count, ?, now() "
                "FROM expected_blocks WHERE request_id = ? ON CONFLICT (batch_id) DO NOTHING", [reason[:2000], request_id])
            cur.execute("DELETE FROM expected_blocks WHERE request_id = ?", [request_id])
            cur.execute("INSERT INTO abandoned_requests VALUES (?, ?, now()) ON CONFLICT (request_id) DO NOTHING",
                        [request_id, reason[:2000]])
            cur.execute("COMMIT")
        return int(moved or 0)

    def record_request(self, record: RequestRecord) -> None:
        created = record.created_at or datetime.now(timezone.utc)
        with self._write_lock:
            self.cursor().execute(
                "INSERT INTO requests VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO UPDATE SET "
                "output_text = excluded.output_text, output_ids = excluded.output_ids, "
                "finish_reason = excluded.finish_reason, config = excluded.config",
                [record.request_id, created, record.model_id, record.prompt_text, record.output_text,
                 list(record.prompt_ids), list(record.output_ids), record.finish_reason,
                 json.dumps(record.config, default=str)])

    # --------------------------------------------------------------------- request ids per job run

    def claim_request_ids(self, request_ids: Sequence[str], run_id: str, *,
                          max_chars: int | None = None) -> list[str]:
        """Claim an id for each request of job run ``run_id``; returns the ids to run under, in order.

        An id that any earlier run used (claimed, or with rows in any table) is never reused: its
        rows describe that run's tokens, and SAE batch ids derive from the request id, so a reused id
        would also make the new run's blocks look stored already. Such a request runs as
        ``<id>~<run_id>`` (``~<run_id>.<n>`` for repeats within the run). Fresh ids stay as given.
        With ``max_chars``, an id that would be longer (the suffix included) keeps the suffix and as
        much of the given id as fits.
        """
        cur = self.cursor()
        with self._write_lock:
            cur.execute("BEGIN TRANSACTION")
            try:
                taken = self._used_request_ids(cur, list(request_ids))
                chosen: list[str] = []
                for given in request_ids:
                    candidate, n = given, 0
                    while candidate in taken or (max_chars is not None and len(candidate) > max_chars):
                        n += 1  # rare: a reused or too long id; one more look-up per try
                        suffix = f"~{run_id}" + (f".{n}" if n > 1 else "")
                        candidate = (given if max_chars is None else given[:max_chars - len(suffix)]) + suffix
                        taken |= self._used_request_ids(cur, [candidate])
                    chosen.append(candidate)
                    taken.add(candidate)
                cur.execute("INSERT INTO request_claims SELECT u, ?, now() FROM (SELECT unnest(?::VARCHAR[]) AS u)",
                            [run_id, chosen])
                cur.execute("COMMIT")
            except Exception:
                cur.execute("ROLLBACK")
                raise
        return chosen

    @staticmethod
    def _used_request_ids(cur: duckdb.DuckDBPyConnection, ids: list[str]) -> set[str]:
        tables = ("request_claims", "requests", "write_batches", "expected_blocks", "missing_blocks",
                  "abandoned_requests")
        union = " UNION ALL ".join(f"SELECT request_id FROM {t}" for t in tables)  # fixed names, no input
        rows = cur.execute(f"SELECT DISTINCT request_id FROM ({union}) WHERE list_contains(?::VARCHAR[], request_id)",
                           [ids]).fetchall()
        return {r for r, in rows}

    def request_counts(self, request_ids: Sequence[str]) -> dict[str, int]:
        """Rows that belong to these requests only (a job's own summary in a shared store)."""
        cur = self.cursor()
        ids = list(request_ids)
        return {table: int(_scalar(cur, f"SELECT count(*) FROM {table} WHERE list_contains(?::VARCHAR[], request_id)",
                                   [ids]))  # fixed table names; the ids are bound
                for table in ("activations", "requests", "missing_blocks", "expected_blocks")}

    # ---------------------------------------------------------------------------- housekeeping

    def counts(self) -> dict[str, int]:
        cur = self.cursor()
        return {table: int(_scalar(cur, f"SELECT count(*) FROM {table}"))  # fixed table names, no input
                for table in ("activations", "requests", "write_batches", "missing_blocks", "expected_blocks")}

    def apply_retention(self, days: int, *, compact: bool = True, now: datetime | None = None) -> RetentionResult:
        """Delete rows (and requests) older than ``days``; with ``compact``, shrink the file."""
        if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= MAX_AGE_DAYS:
            raise StoreError(f"`days` must be an integer in [1, {MAX_AGE_DAYS}], got {days!r}", parameter="days",
                             value=days)
        cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=days)
        before = self._file_bytes()
        cur = self.cursor()
        with self._write_lock:
            cur.execute("BEGIN TRANSACTION")
            rows = _scalar(cur, "DELETE FROM activations WHERE created_at < ?", [cutoff])
            requests = _scalar(cur, "DELETE FROM requests WHERE created_at < ?", [cutoff])
            cur.execute("DELETE FROM write_batches WHERE written_at < ?", [cutoff])
            cur.execute("COMMIT")
            cur.execute("CHECKPOINT")
            if compact and rows:
                self._compact()
        return RetentionResult(int(rows), int(requests), before, self._file_bytes())

    def _file_bytes(self) -> int:
        wal = self.db_path.with_name(self.db_path.name + ".wal")
        return sum(p.stat().st_size for p in (self.db_path, wal) if p.exists())

    def _compact(self) -> None:
        """Copy the live data into a new file and swap it in (DuckDB never shrinks a file itself)."""
        fresh = self.db_path.with_name(self.db_path.name + ".compact")
        fresh.unlink(missing_ok=True)
        cur = self.cursor()
        name = _scalar(cur, "SELECT current_database()")
        cur.execute(f"ATTACH {_sql_string(str(fresh))} AS raylens_compact")
        cur.execute(f'COPY FROM DATABASE "{name}" TO raylens_compact')
        cur.execute("DETACH raylens_compact")
        self.close()
        os.replace(fresh, self.db_path)
        self._local = threading.local()
        self._con = self._connect()

    def export_parquet(self, directory: str | Path | None = None) -> ExportResult:
        """Write the activations as Parquet, partitioned by date (``date=YYYY-MM-DD/…``)."""
        out = Path(directory) if directory is not None else self.parquet_path
        out.mkdir(parents=True, exist_ok=True)
        cur = self.cursor()
        rows = int(_scalar(cur, "SELECT count(*) FROM activations"))
        cur.execute(
            "COPY (SELECT *, CAST(created_at AS DATE) AS date FROM activations) "
            f"TO {_sql_string(str(out))} (FORMAT parquet, PARTITION_BY (date), OVERWRITE_OR_IGNORE true)")
        files = sorted(str(p.relative_to(out)) for p in out.rglob("*.parquet"))
        return ExportResult(str(out), rows, files)
