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
from engine.services.previews import preview
from engine.services.store import MAX_AGE_DAYS, ActivationStore, StoreSchemaError

__all__ = [
    "feature_deltas",
    "threshold_search",
    "top_features",
    "dense_features",
    "DENSE_FREQUENCY",
    "top_activating_tokens",
    "decode_tokens",
    "parse_since",
    "check_int",
    "feature_contexts",
    "feature_histogram",
    "feature_frequency",
    "request_tokens",
    "request_info",
    "recent_requests",
    "MAX_BROWSE_ROWS",
]

Output = Literal["arrow", "pandas", "polars"]

_I32_MAX = 2**31 - 1


def check_int(name: str, value: Any, low: int, high: int = _I32_MAX) -> int:
    """``value`` if it is an integer in ``[low, high]``, else :class:`InvalidRequestError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= int(value) <= high:
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
    return _convert(table, output)


def _convert(table: pa.Table, output: Output) -> Any:
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


#: A feature stored at this share of all stored tokens or more is *dense*: it fires on most text,
#: so it says little about any one request (it is flagged, and ranks low by specificity).
DENSE_FREQUENCY = 0.5
TopOrder = Literal["specificity", "activation"]


def top_features(store: ActivationStore, request_id: str, *, step: int | None = None, limit: int = 20,
                 order: TopOrder = "specificity", output: Output = "arrow") -> Any:
    """A request's features (over all its tokens or one step), most specific first.

    ``specificity`` is the feature's peak activation in this request over its store-wide mean
    activation (every stored token counted, 0 where it is not in the top-k): how far above its
    usual level the feature fires here, as Neuronpedia ranks a text's features by activation
    against density. A feature that fires everywhere scores about 1; one that fires rarely and
    fires here scores high. ``store_frequency`` is the share of stored tokens where it fires,
    ``dense`` whether that share is at least :data:`DENSE_FREQUENCY`. ``order="activation"``
    ranks by peak activation instead."""
    sql = """
        WITH req AS (
            SELECT feature_id, max(activation_value) AS max_activation, avg(activation_value) AS mean_activation,
                   count(*) AS tokens, arg_max(token_position, activation_value) AS peak_position,
                   arg_max(step, activation_value) AS peak_step
            FROM activations
            WHERE request_id = ? AND (? IS NULL OR step = ?)
            GROUP BY feature_id
        ), total AS (
            SELECT count(*) AS n FROM (SELECT DISTINCT request_id, step, token_position FROM activations)
        ), everywhere AS (
            SELECT feature_id, count(*) AS fired, sum(activation_value) AS activation_sum
            FROM activations WHERE feature_id IN (SELECT feature_id FROM req) GROUP BY feature_id
        ), ranked AS (
            SELECT r.*, e.fired / t.n AS store_frequency, e.activation_sum / t.n AS store_mean,
                   r.max_activation / nullif(e.activation_sum / t.n, 0) AS specificity,
                   e.fired / t.n >= ? AS dense
            FROM req r JOIN everywhere e USING (feature_id), total t
        )
        SELECT * FROM ranked
        ORDER BY CASE WHEN ? = 'activation' THEN max_activation ELSE specificity END DESC NULLS LAST,
                 max_activation DESC, feature_id
        LIMIT ?
    """
    if step is not None:
        check_int("step", step, 0)
    check_int("limit", limit, 1)
    if order not in ("specificity", "activation"):
        raise InvalidRequestError(f"`order` must be specificity or activation, got {order!r}", parameter="order",
                                  value=order)
    return _run(store, sql, [request_id, step, step, DENSE_FREQUENCY, order, limit], output)


def dense_features(store: ActivationStore, *, request_id: str | None = None, output: Output = "arrow") -> Any:
    """The dense features (stored at :data:`DENSE_FREQUENCY` of all stored tokens or more), of
    ``request_id`` only when given: ``feature_id``, ``tokens_fired``, ``frequency``, most frequent
    first."""
    sql = """
        WITH total AS (
            SELECT count(*) AS n FROM (SELECT DISTINCT request_id, step, token_position FROM activations)
        ), fired AS (
            SELECT feature_id, count(*) AS tokens_fired FROM activations
            WHERE ? IS NULL OR feature_id IN (SELECT feature_id FROM activations WHERE request_id = ?)
            GROUP BY feature_id
        )
        SELECT f.feature_id, f.tokens_fired, f.tokens_fired / t.n AS frequency
        FROM fired f, total t
        WHERE f.tokens_fired / t.n >= ?
        ORDER BY frequency DESC, f.feature_id
    """
    return _run(store, sql, [request_id, request_id, DENSE_FREQUENCY], output)


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


# ------------------------------------------------------------------- the feature browser's questions
#
# Positions: ``token_position`` indexes the request's final ``prompt_ids + output_ids`` (0-based).
# One encoded token is one (request_id, step, token_position); a token Backtrack erased keeps its
# rows under its own step, so a position may appear at two steps.

MAX_BROWSE_ROWS = 500


def feature_contexts(store: ActivationStore, feature_id: int, *, limit: int = 20, window: int = 8,
                     output: Output = "arrow") -> Any:
    """The tokens where ``feature_id`` is strongest, each with ``context_ids``: up to ``window``
    tokens either side of it from the request's final prompt + output, ``context_start`` (the
    position of ``context_ids[0]``), and the SAE that produced the row."""
    check_int("feature", feature_id, 0)
    check_int("limit", limit, 1, MAX_BROWSE_ROWS)
    check_int("window", window, 0, 64)
    sql = """
        WITH best AS (
            SELECT request_id, step, token_position, token_id, activation_value, sae_release, sae_layer
            FROM activations WHERE feature_id = ?
            ORDER BY activation_value DESC, request_id, step, token_position LIMIT ?
        )
        SELECT b.request_id, b.step, b.token_position, b.token_id, b.activation_value, b.sae_release, b.sae_layer,
               greatest(0, b.token_position - ?) AS context_start,
               list_slice(list_concat(r.prompt_ids, r.output_ids),
                          greatest(0, b.token_position - ?) + 1, b.token_position + 1 + ?) AS context_ids
        FROM best b LEFT JOIN requests r USING (request_id)
        ORDER BY b.activation_value DESC, b.request_id, b.step, b.token_position
    """
    return _run(store, sql, [feature_id, limit, window, window, window], output)


def feature_histogram(store: ActivationStore, feature_id: int, *, buckets: int = 20,
                      output: Output = "arrow") -> Any:
    """``buckets`` equal-width bins from the feature's lowest to its highest stored activation:
    ``bucket, low, high, count`` (every bin, empty ones included; no rows when it never fired)."""
    check_int("feature", feature_id, 0)
    check_int("buckets", buckets, 1, 200)
    sql = """
        WITH v AS (SELECT activation_value AS a FROM activations WHERE feature_id = ?),
        span AS (SELECT min(a) AS lo, max(a) AS hi FROM v),
        binned AS (
            SELECT least(CAST(floor((a - lo) / nullif(hi - lo, 0) * ?) AS INTEGER), ? - 1) AS bucket,
                   count(*) AS n
            FROM v, span GROUP BY 1
        )
        SELECT g.bucket, lo + (hi - lo) * g.bucket / ? AS low, lo + (hi - lo) * (g.bucket + 1) / ? AS high,
               coalesce(b.n, 0) AS count
        FROM span, (SELECT CAST(range AS INTEGER) AS bucket FROM range(?)) g
        LEFT JOIN binned b ON coalesce(b.bucket, 0) = g.bucket
        WHERE lo IS NOT NULL
        ORDER BY g.bucket
    """
    return _run(store, sql, [feature_id, buckets, buckets, buckets, buckets, buckets], output)


def feature_frequency(store: ActivationStore, feature_id: int, *, output: Output = "arrow") -> Any:
    """One row: ``tokens_fired`` (stored tokens where the feature is in the top-k), ``tokens``
    (all stored tokens), their ratio ``frequency``, whether it is ``dense`` (:data:`DENSE_FREQUENCY`),
    and the feature's peak and mean activation."""
    check_int("feature", feature_id, 0)
    sql = """
        WITH tokens AS (SELECT count(*) AS n FROM (SELECT DISTINCT request_id, step, token_position FROM activations)),
        fired AS (
            SELECT count(*) AS n, max(peak) AS peak, avg(peak) AS mean FROM (
                SELECT max(activation_value) AS peak FROM activations WHERE feature_id = ?
                GROUP BY request_id, step, token_position)
        )
        SELECT fired.n AS tokens_fired, tokens.n AS tokens,
               CASE WHEN tokens.n = 0 THEN 0.0 ELSE fired.n / tokens.n END AS frequency,
               tokens.n > 0 AND fired.n / tokens.n >= ? AS dense,
               fired.peak AS max_activation, fired.mean AS mean_activation
        FROM fired, tokens
    """
    return _run(store, sql, [feature_id, DENSE_FREQUENCY], output)


def request_tokens(store: ActivationStore, request_id: str, *, top: int = 5, max_tokens: int = MAX_BROWSE_ROWS,
                   output: Output = "arrow") -> Any:
    """A request's encoded tokens in order (``step, token_position, token_id``), each with its
    ``top`` strongest features: ``feature_ids`` and ``activations``, strongest first."""
    check_int("top", top, 1, 64)
    check_int("max_tokens", max_tokens, 1, 100_000)
    sql = """
        SELECT step, token_position, any_value(token_id) AS token_id,
               list_slice(list(feature_id ORDER BY activation_value DESC, feature_id), 1, ?) AS feature_ids,
               list_slice(list(activation_value ORDER BY activation_value DESC, feature_id), 1, ?) AS activations
        FROM activations WHERE request_id = ?
        GROUP BY step, token_position
        ORDER BY token_position, step
        LIMIT ?
    """
    return _run(store, sql, [top, top, request_id, max_tokens], output)


def request_info(store: ActivationStore, request_id: str, *, output: Output = "arrow") -> Any:
    """The request's record (text, ids, finish) and how many activation rows it has; no rows when
    neither table knows the id."""
    sql = """
        WITH rows AS (SELECT count(*) AS n FROM activations WHERE request_id = ?)
        SELECT ? AS request_id, r.created_at, r.model_id, r.prompt_text, r.output_text, r.prompt_ids,
               r.output_ids, r.finish_reason, rows.n AS activation_rows
        FROM rows LEFT JOIN requests r ON r.request_id = ?
        WHERE r.request_id IS NOT NULL OR rows.n > 0
    """
    return _run(store, sql, [request_id, request_id, request_id], output)


def recent_requests(store: ActivationStore, *, limit: int = 50, output: Output = "arrow") -> Any:
    """The newest requests (by ``created_at``) with previews and row counts. ``prompt_preview`` is
    the prompt's last user message (:mod:`engine.services.previews`: not the chat template's
    system prompt every request starts with), or the prompt itself when it has no user turn."""
    check_int("limit", limit, 1, MAX_BROWSE_ROWS)
    sql = """
        SELECT r.request_id, r.created_at, r.model_id, r.prompt_text AS prompt_preview,
               left(r.output_text, 200) AS output_preview, r.finish_reason,
               coalesce(len(r.prompt_ids), 0) + coalesce(len(r.output_ids), 0) AS tokens,
               (SELECT count(*) FROM activations a WHERE a.request_id = r.request_id) AS activation_rows
        FROM requests r
        ORDER BY r.created_at DESC, r.request_id
        LIMIT ?
    """
    table = _run(store, sql, [limit], "arrow")
    previews = pa.array([preview(text) for text in table.column("prompt_preview").to_pylist()], pa.string())
    table = table.set_column(table.column_names.index("prompt_preview"), "prompt_preview", previews)
    return _convert(table, output)
