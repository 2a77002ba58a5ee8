"""Benchmark: what a constrained-generation step (a SelfPrompt strategy masking the vocabulary)
costs beside one decode forward pass (a row of every ``raylens bench``)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .measure import PROMPT

__all__ = ["run_strategy_bench", "format_strategy"]


def run_strategy_bench(engine: Any, *, repeats: int = 50) -> dict[str, Any]:
    """Per-step milliseconds of a constrained-generation step (a SelfPrompt masking the full
    vocabulary for a strategy) beside one forward pass of the model."""
    from mods.actions import ActionBuilder
    from mods.self_prompt import SelfPrompt
    from mods.strategies.base import token_texts
    from mods.strategies.strategy_constructor import CharsMode, CharsStrat, ChoicesStrat

    from engine.model.backend import ForwardBatch, ForwardRow

    backend, tokenizer = engine.backend, engine.tokenizer
    rid = "bench-strategy"
    ids = engine.encode(PROMPT)

    def decode(loop: Any) -> tuple[Any, list[float]]:
        """Ten greedy decode forwards of one request, on the loop's thread with its KV blocks."""
        kv, runner = loop.scheduler.kv, loop.runner

        def feed(start: int, tokens: list[int]) -> Any:
            table = kv.prepare(rid, start, len(tokens))
            row = ForwardRow(rid, start, tuple(tokens), table=table)
            return runner.execute(ForwardBatch((row,), kv.num_blocks, kv.take_copies())).rows()[0]

        kv.add(rid)
        try:
            out, timings = feed(0, ids), []
            for _ in range(10):
                ids.append(int(out.logits.argmax()))
                started = time.perf_counter()
                out = feed(len(ids) - 1, [ids[-1]])
                timings.append((time.perf_counter() - started) * 1000)
            return out, timings
        finally:
            kv.remove(rid)

    out, forward_ms = engine.loop.call(decode)
    from mods.types import ForwardPass
    from engine.model.tensor import TensorShim

    event = ForwardPass(rid, 10, TensorShim(out.logits[None, :], readonly=True), input_ids=list(ids))
    started = time.perf_counter()
    token_texts(tokenizer)  # the one-time vocabulary table (once per tokenizer per process)
    table_ms = (time.perf_counter() - started) * 1000
    cases = {"STRING chars (~all of the vocabulary allowed)": CharsStrat(CharsMode.STRING, stop='"'),
             "JS_FLOAT chars (digits and signs)": CharsStrat(CharsMode.JS_FLOAT, stop="\n"),
             "choices yes/no": ChoicesStrat(["yes", "no"])}
    steps: dict[str, float] = {}
    for name, strategy in cases.items():
        helper = SelfPrompt(strategy=strategy)
        helper.handle_forward_pass(event, ActionBuilder(event), tokenizer)  # compile + first mask
        timings = []
        for _ in range(repeats):
            started = time.perf_counter()
            helper.handle_forward_pass(event, ActionBuilder(event), tokenizer)
            timings.append((time.perf_counter() - started) * 1000)
        steps[name] = statistics.median(timings)
    return {"forward_pass_ms": statistics.median(forward_ms), "vocabulary_table_ms": table_ms,
            "vocab": backend.info.vocab_size, "mask_step_ms": steps}


def format_strategy(report: dict[str, Any]) -> str:
    lines = [f"vocabulary {report['vocab']:,} ids; token-text table built once: {report['vocabulary_table_ms']:.0f} ms",
             "", "| step | ms | vs a forward pass |", "|---|---|---|",
             f"| one decode forward pass | {report['forward_pass_ms']:.2f} | 1.00 |"]
    for name, ms in report["mask_step_ms"].items():
        lines.append(f"| SelfPrompt mask step, {name} | {ms:.2f} | {ms / report['forward_pass_ms']:.3f} |")
    return "\n".join(lines)
