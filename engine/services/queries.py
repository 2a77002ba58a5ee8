"""Questions asked of the activation store; each returns an Arrow table.

All SQL binds its parameters. ``output="pandas"`` / ``"polars"`` converts the result when that
library is installed. Token ids come back as ids; :func:`decode_tokens` adds text when a
tokenizer is at hand. No matching rows is an answer: an empty table with the same columns.

Arguments are checked before any SQL runs, against the columns' types (ids and steps are 32-bit
integers), so an out-of-range value is an :class:`InvalidRequestError` naming the argument
instead of a DuckDB conversion error.
"""

from __future__ import annotations

import math
import numbers
import re
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

import duckdb
import pyarrow as pa

from engine.errors import InvalidRequestError
from engine.services.store import MAX_AGE_DAYS, ActivationStore, StoreSchemaError

__all__ = [
    "feature_deltas",
    "threshold_search",
    "top_features",
    "top_activating_tokens",
    "decode_tokens",
    "parse_since",
    "check_int",
]

Output = Literal["arrow", "pandas", "polars"]

_I32_MAX = 2**31 - 1


def check_int(name: str, value: Any, low: int, high: int = _I32_MAX) -> int:
    """``value`` if it is an integer in ``[low, high]``, else :class:`InvalidRequestError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise InvalidRequestError(f"`{name}` must be an integer in [{low}, {high}], got {value!r}", parameter=name,
                                  value=value)
    return int(value)


def _check_since(since: timedelta | None) -> None:
    if since is not None and not timedelta(0) < since <= timedelta(days=MAX_AGE_DAYS):
        raise InvalidRequestError(f"`since` must be more than 0 and at most {MAX_AGE_DAYS} days, got {since}",
                                  parameter="since", value=since)


def _run(store: ActivationStore, sql: str, params: list[Any], output: Output) -> Any:
    try:
        table = store.cursor().sql(sql, params=params).to_arrow_table()
    except duckdb.CatalogException as err:
        raise StoreSchemaError(f"the store `{store.db_path}` lacks a table this query reads ({err}); "
                               "it was created by another tool or never written by raylens") from None
    if output == "arrow":
        return table
    if output == "pandas":
        return table.to_pandas()
    if output == "polars":
        import polars  # optional

        return polars.from_arrow(table)
    raise ValueError(f"`output` must be arrow, pandas or polars, got {output!r}")


def feature_deltas(store: ActivationStore, request_id: str, feature_id: int, *, output: Output = "arrow") -> Any:
    """A feature's activation at every token the request encoded, in time order, and its change
    from the previous token. A token where the feature is not in the top-k counts as 0."""
    sql = """
        WITH tokens AS (
            SELECT DISTINCT step, token_position, token_id FROM activations WHERE request_id = ?
        ), hits AS (
            SELECT step, token_position, max(activation_value) AS activation
            FROM activations WHERE request_id = ? AND feature_id = ? GROUP BY step, token_position
        )
        SELECT t.step, t.token_position, t.token_id,
               coalesce(h.activation, 0.0) AS activation,
               coalesce(h.activation, 0.0)
                 - lag(coalesce(h.activation, 0.0), 1, 0.0) OVER (ORDER BY t.step, t.token_position) AS delta
        FROM tokens t LEFT JOIN hits h USING (step, token_position)
        ORDER BY t.step, t.token_position
    """
    check_int("feature", feature_id, 0)
    return _run(store, sql, [request_id, request_id, feature_id], output)


def threshold_search(store: ActivationStore, feature_id: int, min_value: float, *, since: timedelta | None = None,
                     limit: int = 1000, output: Output = "arrow") -> Any:
    """Every request/step, across runs, where ``feature_id`` fired at ``min_value`` or more."""
    check_int("feature", feature_id, 0)
    check_int("limit", limit, 1)
    _check_since(since)
    if isinstance(min_value, bool) or not isinstance(min_value, numbers.Real) or not math.isfinite(min_value):
        raise InvalidRequestError(f"`min` must be a finite number, got {min_value!r}", parameter="min",
                                  value=min_value)
    cutoff = datetime.now(timezone.utc) - since if since is not None else datetime(1970, 1, 1, tzinfo=timezone.utc)
    sql = """
        SELECT request_id, step, token_position, token_id, activation_value, rank, created_at, model_id, sae_release
        FROM activations
        WHERE feature_id = ? AND activation_value >= ? AND created_at >= ?
        ORDER BY activation_value DESC, request_id, step, token_position
        LIMIT ?
    """
    return _run(store, sql, [feature_id, min_value, cutoff, limit], output)


def top_features(store: ActivationStore, request_id: str, *, step: int | None = None, limit: int = 20,
                 output: Output = "arrow") -> Any:
    """A request's strongest features (by peak activation), over all its tokens or one step."""
    sql = """
        SELECT feature_id, max(activation_value) AS max_activation, avg(activation_value) AS mean_activation,
               count(*) AS tokens, arg_max(token_position, activation_value) AS peak_position,
               arg_max(step, activation_value) AS peak_step
        FROM activations
        WHERE request_id = ? AND (? IS NULL OR step = ?)
        GROUP BY feature_id
        ORDER BY max_activation DESC, feature_id
        LIMIT ?
    """
    if step is not None:
        check_int("step", step, 0)
    check_int("limit", limit, 1)
    return _run(store, sql, [request_id, step, step, limit], output)


def top_activating_tokens(store: ActivationStore, feature_id: int, *, limit: int = 20, context: int = 8,
                          output: Output = "arrow") -> Any:
    """The tokens that activate ``feature_id`` most, each with ``context_ids``: up to ``context``
    tokens before it and the token itself, from the request's final prompt + output (a token
    that Backtrack later erased shows what replaced it there)."""
    sql = """
        WITH best AS (
            SELECT request_id, step, token_position, token_id, activation_value
            FROM activations WHERE feature_id = ?
            ORDER BY activation_value DESC LIMIT ?
        )
        SELECT b.request_id, b.step, b.token_position, b.token_id, b.activation_value,
               list_slice(list_concat(r.prompt_ids, r.output_ids),
                          greatest(1, b.token_position + 1 - ?), b.token_position + 1) AS context_ids
        FROM best b LEFT JOIN requests r USING (request_id)
        ORDER BY b.activation_value DESC
    """
    check_int("feature", feature_id, 0)
    check_int("limit", limit, 1)
    check_int("context", context, 0)
    return _run(store, sql, [feature_id, limit, context], output)


def _decode(tokenizer: Any, batch: list[list[int]]) -> pa.Array:
    # never an empty batch: HF tokenizers decode [] as one empty string, one row too many
    return pa.array(tokenizer.batch_decode(batch) if batch else [], pa.string())


def decode_tokens(table: pa.Table, tokenizer: Any) -> pa.Table:
    """Add ``token`` (and ``context`` when ``context_ids`` is present) text columns."""
    if "token_id" in table.column_names:
        ids = table.column("token_id").to_pylist()
        table = table.append_column("token", _decode(tokenizer, [[i] for i in ids]))
    if "context_ids" in table.column_names:
        contexts = [ids or [] for ids in table.column("context_ids").to_pylist()]
        table = table.append_column("context", _decode(tokenizer, contexts))
    return table


_SINCE = re.compile(r"^(\d+)\s*([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w`` → timedelta (more than 0, at most ``MAX_AGE_DAYS``)."""
    match = _SINCE.match(text.strip().lower())
    if not match:
        raise InvalidRequestError(f"`since` must look like 7d, 12h, 30m, 45s or 2w, got {text!r}",
                                  parameter="since", value=text)
    amount, unit = match.group(1), _UNITS[match.group(2)]
    limit = {"seconds": 86400, "minutes": 1440, "hours": 24, "days": 1, "weeks": 1 / 7}[unit] * MAX_AGE_DAYS
    if len(amount) > 12 or not 0 < int(amount) <= limit:
        raise InvalidRequestError(f"`since` must be more than 0 and at most {MAX_AGE_DAYS}d, got {text!r}",
                                  parameter="since", value=text)
    return timedelta(**{unit: int(amount)})
