"""Recorded behaviour of the generation core, to hold a rebuild of it to the same results.

:func:`record` runs a fixed set of scenarios on the embedded model — one request alone, a batch of
requests whose mods take every kind of action (adjusted logits, a Backtrack at Sampled, forced
tokens at Added, an adjusted prefill), a prefix-cache hit, a prompt prefilled in chunks beside a
decoding neighbour, and the inline SAE's stored rows — and reduces each result to a digest: its
tokens exactly, every event's internals by a few numbers, its ingest payload (times and ids
aside) and the activation rows. ``tests/data/core_fixtures.json`` holds the digest the core gave
before it was rebuilt around a scheduler that owns requests and KV blocks;
``tests/integration/test_core_fixtures.py`` requires the core to give the same one today.

Regenerate only for a deliberate change of behaviour, and say which in the commit:
``python -m tests.core_fixtures --write``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers import TEST_MODS, build_config, keeping_logits

FIXTURE = Path(__file__).resolve().parent / "data" / "core_fixtures.json"
IGNORED_PAYLOAD_KEYS = {"created_at", "completed_at", "execution_time_ms", "request_id"}
NEW_TOKENS = 12
# The forward the fixture was recorded on: torch's default GEMM (MKL's sgemm), gathering attention,
# eager decode. Other forward paths (the default oneDNN-prepacked weights among them) are held to
# this one by tests/integration/test_forward_paths.py, on the same scenarios.
RECORDED_FORWARD = {"weight_prepack": "off", "paged_attention": "off", "graph_decode": "off"}
BATCH_PROMPTS = {
    "logits": ("What is the capital of France?", "forward_pass/adjust_logits.py"),
    "backtrack": ("What is the capital of France?", "sampled/backtrack.py"),
    "forced": ("What is the capital of France?", "added/force_tokens.py"),
    "prefill": ("What is the capital of France?", "prefilled/adjust_prefill.py"),
    "plain": ("Describe the sea at night in one sentence.", None),
}
SYSTEM = ("You are a patient tutor for a class of curious twelve-year-olds. Answer in plain words, one idea "
          "per sentence, and give a concrete everyday example whenever you can.")
LONG_PROMPT = ("Summarise, in one sentence, what this says: the lighthouse keeper climbed the stairs every "
               "evening at dusk, wound the clockwork, trimmed the wick and watched the ships pass the rocks.")


def _numbers(tensor: Any) -> dict[str, Any] | None:
    """A tensor as a few numbers that move when any of its values does: shape, sum, sum of
    squares, and its first and last values."""
    if tensor is None:
        return None
    array = np.asarray(tensor.to_numpy() if hasattr(tensor, "to_numpy") else tensor, dtype=np.float64)
    flat = array.reshape(-1)
    finite = flat[np.isfinite(flat)]
    return {"shape": list(array.shape), "sum": float(finite.sum()), "sumsq": float((finite ** 2).sum()),
            "head": [float(x) for x in flat[:4]], "tail": [float(x) for x in flat[-4:]],
            "nonfinite": int(flat.size - finite.size)}


def _event(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__, "step": int(event.step)}
    for name in ("sampled_token", "added_tokens", "forced", "max_steps"):
        value = getattr(event, name, None)
        if value is not None:
            out[name] = [int(t) for t in value] if isinstance(value, list) else value
    ids = getattr(event, "input_ids", None)
    if ids is not None:
        out["input_ids"] = [int(t) for t in ids]
    for name in ("hidden_states", "attention_patterns"):
        out[name] = _numbers(getattr(event, name, None))
    logits = getattr(event, "logits", None)
    if logits is not None:
        array = np.asarray(logits.to_numpy(), dtype=np.float64).reshape(-1)
        top = np.argsort(-array, kind="stable")[:5]
        out["logits_top"] = [[int(i), float(array[i])] for i in top]
    return out


def _payload(payload: Any) -> Any:
    if isinstance(payload, dict):
        return {k: _payload(v) for k, v in payload.items() if k not in IGNORED_PAYLOAD_KEYS}
    if isinstance(payload, list):
        return [_payload(v) for v in payload]
    return payload


def digest(result: Any) -> dict[str, Any]:
    return {"prompt_ids": list(result.prompt_ids), "sequence_ids": list(result.sequence_ids),
            "output_ids": list(result.output_ids), "output_text": result.output_text,
            "finish_reason": str(result.finish_reason), "error": result.error,
            "events": [_event(e) for e in result.events], "payload": _payload(result.payload),
            "ignored": [[i.step, i.event_type, type(i.action).__name__, i.reason] for i in result.ignored_actions]}


def _hit_tokens(engine: Any) -> int:
    """Prompt tokens the engine's prefix cache served so far."""
    stats = engine.cache_stats() if hasattr(engine, "cache_stats") else engine.backend.cache_stats()
    return stats["hit_tokens"]


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def record(engine: Any, small: Any, sae_engine: Any) -> dict[str, Any]:
    """Every scenario's digest. ``engine``: the embedded model with the local config; ``small``:
    the same model with 8-position KV blocks and a 24-token step budget (prefix hits over many
    blocks, chunked prefill); ``sae_engine``: the local config with the committed SAE inline and a
    store."""
    out: dict[str, Any] = {}
    out["single"] = digest(engine.generate("Tell me about dragons", max_tokens=NEW_TOKENS, temperature=0.0,
                                           request_id="fx-single"))

    handles = {}
    with engine.loop.admission_held():  # one batch, admitted in one step: the same batches every run
        for name, (prompt, mod_file) in BATCH_PROMPTS.items():
            mods = [str(TEST_MODS / mod_file)] if mod_file else None
            handles[name] = engine.submit(prompt, max_tokens=NEW_TOKENS, temperature=0.0, mods=mods,
                                          request_id=f"fx-batch-{name}")
    out["batch"] = {name: digest(h.result(timeout=600)) for name, h in handles.items()}

    warm = small.generate(messages=_chat("Why is the sky blue?"), max_tokens=4, temperature=0.0,
                          request_id="fx-prefix-warm")
    before = _hit_tokens(small)
    hit = small.generate(messages=_chat("Why do cats purr?"), max_tokens=NEW_TOKENS, temperature=0.0,
                         request_id="fx-prefix-hit")
    out["prefix"] = {"warm": digest(warm), "hit": digest(hit), "hit_tokens": _hit_tokens(small) - before}

    with small.loop.admission_held():
        neighbour = small.submit("Count from one to five.", max_tokens=NEW_TOKENS, temperature=0.0,
                                 request_id="fx-chunk-neighbour", prefix_cache=False)
        long = small.submit(LONG_PROMPT, max_tokens=NEW_TOKENS, temperature=0.0, request_id="fx-chunk-long",
                            prefix_cache=False)
    out["chunked"] = {"neighbour": digest(neighbour.result(timeout=600)), "long": digest(long.result(timeout=600))}

    result = sae_engine.generate("Tell me about dragons", max_tokens=NEW_TOKENS, temperature=0.0,
                                 request_id="fx-sae")
    sae_engine.flush()
    rows = sae_engine.store.cursor().execute(
        "SELECT step, token_position, token_id, feature_id, rank, activation_value FROM activations "
        "WHERE request_id = ? ORDER BY step, token_position, rank", ["fx-sae"]).fetchall()
    out["sae"] = {"result": digest(result), "rows": [list(r[:5]) + [float(r[5])] for r in rows]}
    return out


def _digested(cfg: Any) -> Any:
    """``cfg`` for engines whose results are digested: the digests read every ForwardPass's logits
    after the run (the engines keep them) and every payload's top tokens (recorded for every
    request, not only for payloads sent to an ingest URL)."""
    cfg = keeping_logits(cfg)
    return dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, payload_top_tokens=True))


def build_engines(tmp: Path, **backend: Any) -> tuple[Any, Any, Any]:
    """The three engines :func:`record` runs on, with ``backend`` overrides (a forward path)."""
    from engine import Engine

    engine = Engine(_digested(build_config(**backend)))
    small = Engine(_digested(build_config(kv_block_size=8, max_step_tokens=24, **backend)))
    cfg = _digested(build_config(**backend))
    cfg = dataclasses.replace(
        cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=str(tmp / "fixtures.duckdb")),
        sae=dataclasses.replace(cfg.sae, enabled=True, mode="inline", block_steps=4))
    return engine, small, Engine(cfg, backend=engine.backend)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = sys.argv[1:] if argv is None else argv
    if args != ["--write"]:
        print("usage: python -m tests.core_fixtures --write   (records tests/data/core_fixtures.json)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        engine, small, sae_engine = build_engines(Path(tmp), **RECORDED_FORWARD)
        try:
            data = record(engine, small, sae_engine)
        finally:
            sae_engine.close()
            small.close()
            engine.close()
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
