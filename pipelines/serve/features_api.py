"""The feature browser's read-only routes over the activation store (no model needed).

``GET /api/v1/features/{feature_id}``: how often the feature fires (the fraction of stored tokens
where it is in the top-k; ``dense`` when that is most of them), a histogram of its activations,
its top-activating contexts (the token, its activation, ``window`` tokens either side, the
request id) and Neuronpedia links when the SAE has a Neuronpedia id. ``GET /api/v1/requests``: the
newest requests, previewed by their last user message. ``GET /api/v1/requests/{request_id}``: the
request's features most specific first (peak activation over the feature's store-wide mean,
:func:`engine.services.queries.top_features`), its tokens with their strongest features each
(dense ones flagged), and with ``?feature=`` that feature's activation at every token (0 where it
is not in the top-k).

Every answer is bounded (at most ``MAX_BROWSE_ROWS`` contexts, requests or tokens). The routes
ask the questions of :mod:`engine.services.queries`, by name, of whoever holds the store: in
process, the store's own connection (:class:`~engine.services.store.ActivationStore`, one cursor
per thread); under Ray Serve, the StoreActor that owns the file (:class:`StoreActorReader`: DuckDB
lets no other process open a file its writer holds, not even read-only), within
``ray.call_timeout_s`` (else ``UNAVAILABLE``, retryable). Token text comes from
a tokenizer when the server has one; otherwise ``text`` is null and the page shows the id.
Errors: ``NO_STORE`` when the server has no store, ``NOT_FOUND`` for a request the store does not
know, ``INVALID_REQUEST`` for an id or limit out of range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from fastapi import APIRouter, Query, Request

from engine.errors import RaylensError
from engine.services import queries
from engine.services.queries import DENSE_FREQUENCY, MAX_BROWSE_ROWS

from .errors import ApiError, ErrorCode, api_error_from

__all__ = ["router", "FeatureSource", "StoreActorReader", "BROWSE_QUESTIONS", "neuronpedia_ids_from_registry"]

router = APIRouter(prefix="/api/v1", tags=["features"])

MAX_REQUEST_ID_CHARS = 512
#: The questions the routes ask (functions of :mod:`engine.services.queries`, by name).
BROWSE_QUESTIONS = ("feature_frequency", "feature_histogram", "feature_contexts", "recent_requests", "request_info",
                    "request_tokens", "feature_deltas", "top_features", "dense_features")


class StoreActorReader:
    """The store as the StoreActor that owns its file answers it: ``ask(question, …)`` runs
    ``engine.services.queries.<question>`` in the actor (``StoreActor.query``) and returns its
    Arrow table. The actor's typed errors come back as they were raised there."""

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle = handle
        self.timeout_s = float(timeout_s)

    @classmethod
    def of_config(cls, config: Any) -> "StoreActorReader":
        """The reader of ``config``'s StoreActor, found by name (the cluster must be connected and
        the actor started, as :func:`pipelines.cluster.topology.build_topology` does)."""
        import ray

        from pipelines.cluster.actor_specs import STORE, actor_roles

        handle = ray.get_actor(actor_roles(config)[STORE], namespace=config.ray.namespace)
        return cls(handle, config.ray.call_timeout_s)

    def ask(self, question: str, *args: Any, **kwargs: Any) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(self.handle.query.remote(question, *args, **kwargs), timeout=self.timeout_s)
        except RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, RaylensError):
                raise cause from None
            raise
        except (GetTimeoutError, RayActorError) as err:  # ActorUnavailableError is a RayActorError
            raise ApiError(ErrorCode.UNAVAILABLE, f"the activation store (its StoreActor) must answer within "
                                                  f"ray.call_timeout_s = {self.timeout_s:g} s, got "
                                                  f"{type(err).__name__}; retry shortly") from None


def neuronpedia_ids_from_registry() -> dict[str, str]:
    """``sae_release → "<model>/<sae>"`` (``{layer}`` still to fill) for the registry's published SAEs."""
    from engine.services.sae import SAE_REGISTRY

    ids: dict[str, str] = {}
    for name, source in SAE_REGISTRY.items():
        if source.neuronpedia_template:
            ids[name] = source.neuronpedia_template
            if source.release:
                ids[source.release] = source.neuronpedia_template
    return ids


@dataclass(frozen=True)
class FeatureSource:
    """What the routes read: the store (None: every route answers ``NO_STORE``), a tokenizer for
    token text (optional), and where feature pages live on Neuronpedia (off unless ``neuronpedia_url``
    is set; ``neuronpedia_ids`` maps a stored ``sae_release`` to its ``<model>/<sae>`` template)."""

    store: Any = None  # an ActivationStore, or a StoreActorReader
    tokenizer: Any = None
    neuronpedia_url: str | None = None
    neuronpedia_ids: Mapping[str, str] = field(default_factory=dict)

    def ask(self, question: str, *args: Any, **kwargs: Any) -> Any:
        """``queries.<question>(store, …)`` as an Arrow table, wherever the store is held."""
        if isinstance(self.store, StoreActorReader):
            return self.store.ask(question, *args, **kwargs)
        return getattr(queries, question)(self.store, *args, **kwargs)

    def text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def neuronpedia_link(self, sae_release: str, sae_layer: int, feature_id: int) -> str | None:
        from engine.services.sae import format_for_layer  # the browser needs no model: torch only when linking

        template = self.neuronpedia_ids.get(sae_release)
        if not self.neuronpedia_url or not template:
            return None
        return f"{self.neuronpedia_url.rstrip('/')}/{format_for_layer(template, sae_layer)}/{int(feature_id)}"


def _source(request: Request) -> FeatureSource:
    source: FeatureSource = request.app.state.features
    if source.store is None:
        raise ApiError(ErrorCode.NO_STORE, "this server must be given an activation store to browse features, got "
                                           "none: enable `activations` in the config (and run generations with an "
                                           "SAE), or start the browser on a store file.")
    return source


def _ask(source: FeatureSource, question: str, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """A question's rows; the store's typed errors (an id out of range) become coded API errors."""
    try:
        return source.ask(question, *args, **kwargs).to_pylist()
    except RaylensError as err:
        raise api_error_from(err) from None


def _tokens(source: FeatureSource, ids: list[int], start: int) -> list[dict[str, Any]]:
    return [{"position": start + i, "token_id": int(t), "text": source.text(t)} for i, t in enumerate(ids)]


@router.get("/features/{feature_id}")
def feature(request: Request, feature_id: int, limit: int = Query(20, ge=1, le=MAX_BROWSE_ROWS),
            window: int = Query(8, ge=0, le=64), buckets: int = Query(20, ge=1, le=200)) -> dict[str, Any]:
    source = _source(request)
    freq = _ask(source, "feature_frequency", feature_id)[0]
    histogram = _ask(source, "feature_histogram", feature_id, buckets=buckets)
    contexts, links = [], {}
    for row in _ask(source, "feature_contexts", feature_id, limit=limit, window=window):
        ids, start = row["context_ids"] or [], row["context_start"]
        offset = row["token_position"] - start
        if not ids or offset >= len(ids) or ids[offset] != row["token_id"]:
            ids, start, offset = [row["token_id"]], row["token_position"], 0  # no record, or an erased token
        tokens = _tokens(source, ids, start)
        contexts.append({"request_id": row["request_id"], "step": row["step"], "position": row["token_position"],
                         "activation": row["activation_value"], "token": tokens[offset],
                         "before": tokens[:offset], "after": tokens[offset + 1:],
                         "sae_release": row["sae_release"], "sae_layer": row["sae_layer"]})
        key = (row["sae_release"], row["sae_layer"])
        if key not in links:
            links[key] = source.neuronpedia_link(*key, feature_id)
    return {
        "feature_id": feature_id,
        "tokens_fired": freq["tokens_fired"], "tokens": freq["tokens"], "frequency": freq["frequency"],
        "dense": freq["dense"], "dense_frequency": DENSE_FREQUENCY,
        "max_activation": freq["max_activation"], "mean_activation": freq["mean_activation"],
        "histogram": histogram,
        "contexts": contexts,
        "neuronpedia": [{"sae_release": r, "sae_layer": layer, "url": url} for (r, layer), url in links.items() if url],
    }


@router.get("/requests")
def requests(request: Request, limit: int = Query(50, ge=1, le=MAX_BROWSE_ROWS)) -> dict[str, Any]:
    rows = _ask(_source(request), "recent_requests", limit=limit)
    for row in rows:
        row["created_at"] = row["created_at"].isoformat() if row["created_at"] else None
    return {"requests": rows}


@router.get("/requests/{request_id}")
def request_detail(request: Request, request_id: str, feature: int | None = Query(None, ge=0, le=2**31 - 1),
                   top: int = Query(5, ge=1, le=64),
                   features: int = Query(20, ge=1, le=MAX_BROWSE_ROWS)) -> dict[str, Any]:
    source = _source(request)
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ApiError(ErrorCode.INVALID_REQUEST, f"`request_id` must be at most {MAX_REQUEST_ID_CHARS} "
                                                  f"characters, got {len(request_id)}.", "request_id")
    info = _ask(source, "request_info", request_id)
    if not info:
        raise ApiError(ErrorCode.NOT_FOUND, f"`request_id` must name a request in the store, got {request_id!r}; "
                                            "GET /api/v1/requests lists the newest.", "request_id")
    record = info[0]
    rows = _ask(source, "request_tokens", request_id, top=top)
    chosen: dict[tuple[int, int], float] = {}
    if feature is not None:
        for row in _ask(source, "feature_deltas", request_id, feature):
            chosen[(row["step"], row["token_position"])] = row["activation"]
    dense = {row["feature_id"] for row in _ask(source, "dense_features", request_id=request_id)}
    tokens = []
    for row in _final_tokens(rows, record):
        strongest = [{"feature_id": f, "activation": a, "dense": f in dense}
                     for f, a in zip(row["feature_ids"], row["activations"])]
        token = {"position": row["token_position"], "step": row["step"], "token_id": row["token_id"],
                 "text": source.text(row["token_id"]), "features": strongest}
        if feature is not None:
            token["feature_activation"] = chosen.get((row["step"], row["token_position"]), 0.0)
        tokens.append(token)
    return {
        "request_id": request_id, "created_at": record["created_at"].isoformat() if record["created_at"] else None,
        "model_id": record["model_id"], "prompt_text": record["prompt_text"], "output_text": record["output_text"],
        "finish_reason": record["finish_reason"], "prompt_tokens": len(record["prompt_ids"] or []),
        "activation_rows": record["activation_rows"], "feature": feature, "tokens": tokens,
        "truncated": len(rows) >= MAX_BROWSE_ROWS, "dense_frequency": DENSE_FREQUENCY,
        "features": [{key: row[key] for key in ("feature_id", "max_activation", "tokens", "peak_position",
                                                  "store_frequency", "specificity", "dense")}
                     for row in _ask(source, "top_features", request_id, limit=features)],
    }


def _final_tokens(rows: list[dict[str, Any]], record: dict[str, Any]) -> list[dict[str, Any]]:
    """The encoded tokens of the request's final text, one per position (the latest step whose
    token is the final one there): tokens Backtrack erased are left out. Without a record, every
    encoded token."""
    final = (record["prompt_ids"] or []) + (record["output_ids"] or [])
    if not final:
        return rows
    kept: dict[int, dict[str, Any]] = {}
    for row in rows:  # ordered by position, then step: a later step replaces an earlier one
        position = row["token_position"]
        if position < len(final) and final[position] == row["token_id"]:
            kept[position] = row
    return [kept[p] for p in sorted(kept)]
