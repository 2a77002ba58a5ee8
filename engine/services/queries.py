"""Questions asked of the activation store; each returns an Arrow table.

All SQL binds its parameters. ``output="pandas"`` / ``"polars"`` converts the result when that
library is installed. Token ids come back as ids; :func:`decode_tokens` adds text when a
tokenizer is at hand.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

import duckdb
import pyarrow as pa

from engine.errors import InvalidRequestError
from engine.services.store import ActivationStore, StoreSchemaError

__all__ = [
    "feature_deltas",
    "threshold_search",
    "top_features",
    "top_activating_tokens",
    "decode_tokens",
    "parse_since",
]

Output = Literal["arrow", "pandas", "polars"]


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
    return _run(store, sql, [request_id, request_id, feature_id], output)


def threshold_search(store: ActivationStore, feature_id: int, min_value: float, *, since: timedelta | None = None,
                     limit: int = 1000, output: Output = "arrow") -> Any:
    """Every request/step, across runs, where ``feature_id`` fired at ``min_value`` or more."""
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
    return _run(store, sql, [feature_id, limit, context], output)


def decode_tokens(table: pa.Table, tokenizer: Any) -> pa.Table:
    """Add ``token`` (and ``context`` when ``context_ids`` is present) text columns."""
    if "token_id" in table.column_names:
        ids = table.column("token_id").to_pylist()
        table = table.append_column("token", pa.array(tokenizer.batch_decode([[i] for i in ids]), pa.string()))
    if "context_ids" in table.column_names:
        contexts = [ids or [] for ids in table.column("context_ids").to_pylist()]
        table = table.append_column("context", pa.array(tokenizer.batch_decode(contexts), pa.string()))
    return table


_SINCE = re.compile(r"^(\d+)\s*([smhdw])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str) -> timedelta:
    """``7d``, ``12h``, ``30m``, ``45s``, ``2w`` → timedelta."""
    match = _SINCE.match(text.strip().lower())
    if not match:
        raise InvalidRequestError(f"`since` must look like 7d, 12h, 30m, 45s or 2w, got {text!r}",
                                  parameter="since", value=text)
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
