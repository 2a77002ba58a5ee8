"""Grammar-constrained beside unconstrained generation, tokens/s at 1 and 8 concurrent requests on
the in-process engine, in the same run (``raylens bench --structured``). The goal: a JSON-schema
request at most 10 % slower than a free one.

Both sides generate exactly ``new_tokens`` each (``ignore_eos``; the schema asks for at least 50
array items, so the grammar never ends first), sampled at temperature 0.8 with one seed per
request, so the only difference is the grammar: its mask filled each step, unpacked in the batched
sampler, and its matcher advanced by each token. Repeats alternate the two sides; the best run of
each counts (the least disturbed by other work on the machine).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from pipelines.bench.measure import PROMPT, _machine

__all__ = ["SCHEMA", "run_structured_bench", "format_structured"]

# long on purpose: an object holding a list of short notes, at least 50 of them
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "notes": {"type": "array", "minItems": 50, "items": {"type": "object", "properties": {
        "text": {"type": "string", "maxLength": 60}, "mood": {"enum": ["calm", "stormy", "hopeful"]}},
        "required": ["text", "mood"], "additionalProperties": False}}},
    "required": ["title", "notes"], "additionalProperties": False}


def _run(engine: Any, n: int, new_tokens: int, constrained: bool,
         keep: list[list[int]] | None = None) -> tuple[int, float]:
    """``n`` requests admitted together; (tokens generated, seconds). ``keep`` collects each
    request's token ids."""
    fields: dict[str, Any] = {"max_tokens": new_tokens, "temperature": 0.8, "ignore_eos": True}
    if constrained:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}
    tokens = [0] * n
    errors: list[str] = []

    def one(i: int) -> None:
        result = engine.generate(prompt=PROMPT, seed=i, **fields)
        if str(result.finish_reason) != "length":
            errors.append(f"request {i} ended with {result.finish_reason}: {result.error}")
        tokens[i] = len(result.sequence_ids)
        if keep is not None:
            keep.append(list(result.sequence_ids))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    started = time.perf_counter()
    with engine.loop.admission_held():
        for t in threads:
            t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError("; ".join(errors))
    return sum(tokens), elapsed


def grammar_host_ms(engine: Any, sequences: list[list[int]]) -> float:
    """The grammar's own work per token, replayed on the host over generated sequences: the mask
    filled, unpacked and applied to a row of logits, the token advanced. This is what a
    constrained step adds beside a free one, measured apart from the forward (whose time on a
    shared machine varies far more than this does)."""
    import torch

    from engine.core.structured import grammar_spec
    from engine.model.sampling import unpack_mask

    fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}
    compiled = engine.processor.grammars.compile(grammar_spec(fmt, None, None))
    logits = torch.zeros(1, engine.backend.info.vocab_size)
    spent, count = 0.0, 0
    for tokens in sequences:
        state = compiled.new_state()
        for token in tokens:
            started = time.perf_counter()
            allowed = unpack_mask(state.mask()[None, :], logits.shape[-1])
            logits.masked_fill(~allowed, float("-inf"))
            state.advance([token])
            spent += time.perf_counter() - started
            count += 1
    return 1000.0 * spent / max(count, 1)


def run_structured_bench(engine: Any, *, concurrency: tuple[int, ...] = (1, 8), new_tokens: int = 64,
                         repeats: int = 3, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    rows = []
    _run(engine, 1, 8, True)  # warm-up: the llguidance tokenizer is built on the first structured request
    _run(engine, 1, 8, False)
    sequences: list[list[int]] = []
    for n in concurrency:
        best = {"free": 0.0, "json_schema": 0.0}
        for r in range(repeats):
            for side in ("free", "json_schema"):
                tokens, seconds = _run(engine, n, new_tokens, side == "json_schema",
                                       sequences if side == "json_schema" and r == 0 else None)
                best[side] = max(best[side], tokens / seconds)
                progress(f"structured: {n} concurrent, {side}, repeat {r + 1}: {tokens / seconds:.1f} tok/s")
        rows.append({"concurrency": n, "free_tok_s": round(best["free"], 2),
                     "json_schema_tok_s": round(best["json_schema"], 2),
                     "ratio": round(best["json_schema"] / best["free"], 3)})
    host_ms = grammar_host_ms(engine, sequences)
    for row in rows:  # the grammar's share of a free step: n rows' grammar work per step of n tokens
        step_ms = 1000.0 * row["concurrency"] / row["free_tok_s"]
        row["grammar_ms_per_step"] = round(host_ms * row["concurrency"], 3)
        row["grammar_share_of_free_step"] = round(host_ms * row["concurrency"] / step_ms, 4)
    return {"rows": rows, "new_tokens": new_tokens, "repeats": repeats, "grammar_host_ms_per_token": round(host_ms, 4),
            "schema": SCHEMA, "machine": _machine(engine.backend)}


def format_structured(report: dict[str, Any]) -> str:
    lines = [f"grammar-constrained (json_schema) vs free generation, {report['new_tokens']} tokens per request, "
             f"best of {report['repeats']}",
             f"(grammar host work, replayed: {report['grammar_host_ms_per_token']} ms per token)",
             "| concurrent | free tok/s | json_schema tok/s | json_schema / free | grammar ms per step | "
             "grammar share of a free step |", "|---|---|---|---|---|---|"]
    for row in report["rows"]:
        lines.append(f"| {row['concurrency']} | {row['free_tok_s']} | {row['json_schema_tok_s']} | {row['ratio']} | "
                     f"{row['grammar_ms_per_step']} | {row['grammar_share_of_free_step']:.1%} |")
    return "\n".join(lines)
