"""A small activation store with known rows, written through the store's own API (the feature
browser's tests read it back through the routes and the page).

Token ids are :class:`tests.helpers.CharTokenizer`'s (one character each), so every expected
context and token text is plain to read. Feature 7 fires at three tokens: the "c" of "cat" in
``req-cat`` (strongest), the "d" of "dog", the "m" of "mat"; feature 3 fires, weakly, at every
token; ``req-cat`` also holds a token Backtrack erased (position 13, step 2: "X", then "n" at step 3).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pyarrow as pa

from engine.services.store import ActivationStore, RequestRecord
from engine.services.store_schema import ACTIVATION_SCHEMA
from tests.helpers import CharTokenizer

TOK = CharTokenizer()
SAE_RELEASE, SAE_LAYER = "llama_scope_lxr_8x", 12
REQUESTS = {  # request id -> (prompt, output)
    "req-cat": ("The cat sat", " on the mat."),
    "req-dog": ("A dog ran", " home."),
}
#: (request id, position, activation) where feature 7 fires; everything else it misses.
FEATURE_7 = [("req-cat", 4, 9.5), ("req-dog", 2, 4.25), ("req-cat", 19, 2.0)]
ERASED = ("req-cat", 13, 2, "X")  # request, position, step, the erased character


def _row(request_id: str, step: int, position: int, token_id: int, feature: int, value: float, rank: int,
         created: datetime) -> dict[str, Any]:
    return {"request_id": request_id, "step": step, "token_position": position, "token_id": token_id,
            "created_at": created, "sae_release": SAE_RELEASE, "sae_layer": SAE_LAYER, "feature_id": feature,
            "activation_value": value, "rank": rank, "source_mode": "inline", "model_id": "char-model"}


def token_count() -> int:
    """Stored tokens: every position of every request, plus the one erased token."""
    return sum(len(TOK.encode(p + o)) for p, o in REQUESTS.values()) + 1


def fill_store(store: ActivationStore) -> None:
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    for n, (request_id, (prompt, output)) in enumerate(REQUESTS.items()):
        created = start + timedelta(minutes=n)  # req-dog is the newest
        prompt_ids, output_ids = TOK.encode(prompt), TOK.encode(output)
        rows = []
        for position, token_id in enumerate(prompt_ids + output_ids):
            step = 0 if position < len(prompt_ids) else position - len(prompt_ids) + 1
            if (request_id, position) == ERASED[:2]:  # the erased token held this position one step earlier
                rows.append(_row(request_id, ERASED[2], position, TOK.encode(ERASED[3])[0], 3, 0.75, 0, created))
            strong = [v for r, p, v in FEATURE_7 if (r, p) == (request_id, position)]
            if strong:
                rows.append(_row(request_id, step, position, token_id, 7, strong[0], 0, created))
            rows.append(_row(request_id, step, position, token_id, 3, 0.5 + 0.01 * position, 1 if strong else 0,
                             created))
        table = pa.Table.from_pylist(rows, schema=ACTIVATION_SCHEMA)
        assert store.append_activations(table, batch_id=f"{request_id}-0", request_id=request_id) == len(rows)
        store.record_request(RequestRecord(request_id, "char-model", prompt, output, prompt_ids, output_ids, "stop",
                                           {}, created_at=created))
