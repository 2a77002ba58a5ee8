"""Feature explanations from Neuronpedia, fetched off the hot path and cached in the store.

Nothing here runs during generation: a query (``raylens query explain``, or
:func:`explain_features`) asks for explanations of feature ids, gets what the store's
``feature_metadata`` table already holds, and fetches only the rest from
``GET {base}/api/feature/{model}/{sae}/{index}`` with one pooled httpx client. Off unless
``sae.neuronpedia_url`` is set; a feature Neuronpedia does not know is cached as "no
explanation" so it is not asked for again.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import httpx
import pyarrow as pa

from engine.errors import RaylensError
from engine.services.store import ActivationStore

__all__ = ["NeuronpediaClient", "NeuronpediaError", "explain_features"]

log = logging.getLogger("raylens.neuronpedia")
SOURCE = "neuronpedia"


class NeuronpediaError(RaylensError):
    """Neuronpedia could not be asked (no URL configured, no Neuronpedia id for the SAE, network)."""


class NeuronpediaClient:
    def __init__(self, base_url: str, *, timeout_s: float = 5.0, transport: httpx.BaseTransport | None = None) -> None:
        self._client = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, transport=transport)

    def close(self) -> None:
        self._client.close()

    def explanation(self, neuronpedia_id: str, feature_id: int) -> str | None:
        """The first explanation of a feature, or None when Neuronpedia has none (404 included)."""
        model, _, sae = neuronpedia_id.partition("/")
        try:
            response = self._client.get(f"/api/feature/{model}/{sae}/{int(feature_id)}")
        except httpx.HTTPError as err:
            raise NeuronpediaError(f"cannot reach Neuronpedia at {self._client.base_url}: {err}") from err
        if response.status_code == 404:
            return None
        if response.status_code >= 400:
            raise NeuronpediaError(f"Neuronpedia answered HTTP {response.status_code} for feature {feature_id}")
        explanations = (response.json() or {}).get("explanations") or []
        return explanations[0].get("description") if explanations else None


def explain_features(store: ActivationStore, client: NeuronpediaClient, *, sae_release: str, sae_layer: int,
                     neuronpedia_id: str | None, feature_ids: Iterable[int], refresh: bool = False) -> pa.Table:
    """``feature_id, explanation`` for each id: cached rows first, the rest fetched and cached."""
    if not neuronpedia_id:
        raise NeuronpediaError(f"the SAE {sae_release} has no Neuronpedia id; explanations exist only for "
                               "published SAEs (e.g. llama_scope_lxr_8x)")
    ids = sorted({int(f) for f in feature_ids})
    cur = store.cursor()
    cached: dict[int, Any] = {}
    if not refresh and ids:
        rows = cur.execute(
            "SELECT feature_id, explanation FROM feature_metadata WHERE sae_release = ? AND sae_layer = ? "
            "AND source = ? AND list_contains(?, feature_id)", [sae_release, sae_layer, SOURCE, ids]).fetchall()
        cached = {int(f): text for f, text in rows}
    for feature in (f for f in ids if f not in cached):
        text = client.explanation(neuronpedia_id, feature)
        cached[feature] = text
        if not store.read_only:
            cur.execute("INSERT INTO feature_metadata VALUES (?, ?, ?, ?, ?, now()) ON CONFLICT DO UPDATE SET "
                        "explanation = excluded.explanation, fetched_at = excluded.fetched_at",
                        [sae_release, sae_layer, feature, SOURCE, text])
    return pa.table({"feature_id": pa.array(ids, pa.int32()),
                     "explanation": pa.array([cached[f] for f in ids], pa.string())})
