"""StoreActor: the only writer of the activation store, and the place queries go while it runs.

``max_restarts`` re-runs ``__init__``, which reopens the DuckDB file (its WAL replays): a
restarted StoreActor has every committed batch. ``append`` is idempotent by batch id, so callers
may retry it after an ``ActorUnavailableError`` ("may have run"). A retried
``claim_request_ids`` claims other ids than a first attempt that ran: harmless, the ids it returns
are claimed and unused.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import ray

from engine.services import queries
from engine.config import ActivationsConfig
from engine.errors import InvalidRequestError
from engine.services.store import ActivationStore, RequestRecord

from .versioning import code_version

__all__ = ["StoreActor"]

_QUERIES = {
    "feature_deltas": queries.feature_deltas,
    "threshold_search": queries.threshold_search,
    "top_features": queries.top_features,
    "top_activating_tokens": queries.top_activating_tokens,
    # the feature browser's questions (pipelines/serve/features_api.py under Ray Serve)
    **{name: getattr(queries, name) for name in ("feature_frequency", "feature_histogram", "feature_contexts",
                                                 "recent_requests", "request_info", "request_tokens",
                                                 "dense_features")},
}


@ray.remote
class StoreActor:
    def __init__(self, activations: dict[str, Any]) -> None:
        self.activations = dict(activations)
        self.store = ActivationStore.from_config(ActivationsConfig(**activations))

    def version(self) -> str:
        return code_version()

    def db_path(self) -> str:
        """The DuckDB file this actor owns (the topology refuses a second owner of one file)."""
        return str(self.store.db_path)

    def settings(self) -> dict[str, Any]:
        """The ``activations`` section it was built from (to name what differs in a conflict)."""
        return dict(self.activations)

    def claim_request_ids(self, request_ids: list[str], run_id: str, max_chars: int | None = None) -> list[str]:
        return self.store.claim_request_ids(request_ids, run_id, max_chars=max_chars)

    def request_counts(self, request_ids: list[str]) -> dict[str, int]:
        return self.store.request_counts(request_ids)

    def append(self, rows: pa.Table, batch_id: str, request_id: str) -> int:
        return self.store.append_activations(rows, batch_id=batch_id, request_id=request_id)

    def expect_block(self, batch_id: str, request_id: str, first_step: int, last_step: int, token_count: int) -> None:
        self.store.expect_block(batch_id=batch_id, request_id=request_id, first_step=first_step,
                                last_step=last_step, token_count=token_count)

    def record_missing(self, batch_id: str, request_id: str, first_step: int, last_step: int, token_count: int,
                       reason: str) -> None:
        self.store.record_missing_block(batch_id=batch_id, request_id=request_id, first_step=first_step,
                                        last_step=last_step, token_count=token_count, reason=reason)

    def abandon_request(self, request_id: str, reason: str) -> int:
        return self.store.abandon_request(request_id, reason)

    def record_request(self, record: RequestRecord) -> None:
        self.store.record_request(record)

    def counts(self) -> dict[str, int]:
        return self.store.counts()

    def query(self, name: str, *args: Any, **kwargs: Any) -> pa.Table:
        """One of the store queries by name (``raylens query`` comes here while this actor holds
        the file); an unknown name is an error listing the known ones."""
        if name not in _QUERIES:
            raise InvalidRequestError(f"`name` must be one of {', '.join(sorted(_QUERIES))}, got {name!r}",
                                      parameter="name", value=name)
        return _QUERIES[name](self.store, *args, **kwargs)

    def sql(self, statement: str, params: list[Any] | None = None) -> list[tuple]:
        """Read-only inspection for status and tests (the caller writes the SQL): exactly one
        SELECT, run in a transaction that is always rolled back; anything else is refused
        (``ActivationStore.read_sql``)."""
        return self.store.read_sql(statement, params)

    def export_parquet(self, directory: str | None = None) -> dict[str, Any]:
        result = self.store.export_parquet(directory)
        return {"directory": result.directory, "rows": result.rows, "files": result.files}

    def apply_retention(self, days: int, compact: bool = True) -> dict[str, int]:
        result = self.store.apply_retention(days, compact=compact)
        return dict(vars(result))
