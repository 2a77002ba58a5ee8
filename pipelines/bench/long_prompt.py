"""Benchmark: a long prompt beside streaming requests — do the streams keep their pace?

Eight requests stream tokens; once each has produced a few, one request with a long prompt
(default 6,000 tokens) arrives. Without chunked prefill its whole prompt is one forward, and every
stream waits for it; with the step token budget (``backend.max_step_tokens``) the prompt is
prefilled in chunks across steps while the streams keep decoding. Reported per mode, side by side
in one run: the streams' inter-token gaps (median and worst) before the long prompt arrived and
while it prefilled, and the long prompt's time to first token.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any, Callable

__all__ = ["run_long_prompt_bench", "format_long_prompt"]

STREAM_PROMPT = "Tell me a long story about a lighthouse keeper."


def _long_ids(tokenizer: Any, n: int) -> list[int]:
    text = " ".join(f"Paragraph {i}: the tide came in over the rocks and the gulls called." for i in range(n // 8))
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    while len(ids) < n:
        ids += ids
    return ids[:n]


def measure(engine: Any, *, prompt_tokens: int, streams: int, warm_tokens: int = 4,
            progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """One run on ``engine``: the streams' token times before and during the long prefill."""
    long_ids = _long_ids(engine.tokenizer, prompt_tokens)
    stamps: list[list[float]] = [[] for _ in range(streams)]
    warm = threading.Barrier(streams + 1)
    handles = [engine.submit(STREAM_PROMPT, max_tokens=4096 // 8, temperature=0.0, ignore_eos=True)
               for _ in range(streams)]

    def read(i: int) -> None:
        told = False
        for _ in handles[i]:
            stamps[i].append(time.perf_counter())
            if not told and len(stamps[i]) >= warm_tokens:
                told = True
                warm.wait()
        if not told:
            warm.wait()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(streams)]
    for thread in readers:
        thread.start()
    warm.wait()
    arrived = time.perf_counter()
    long = engine.submit(input_ids=long_ids, max_tokens=1, temperature=0.0, ignore_eos=True)
    first = next(iter(long))  # its first token: the whole prompt is in
    prefilled = time.perf_counter()
    del first
    long.result()
    for handle in handles:
        handle.cancel()
    for thread in readers:
        thread.join(60)
    before, during = [], []
    for times in stamps:
        for a, b in zip(times, times[1:]):
            if b <= arrived:
                before.append(b - a)
            elif a < prefilled and b > arrived:
                during.append(b - a)
    progress(f"long prompt of {prompt_tokens} tokens: first token after {prefilled - arrived:.2f} s")
    return {
        "ttft_s": prefilled - arrived,
        "gap_before_ms": {"median": 1000 * statistics.median(before) if before else None,
                          "max": 1000 * max(before) if before else None},
        "gap_during_ms": {"median": 1000 * statistics.median(during) if during else None,
                          "max": 1000 * max(during) if during else None,
                          "tokens": len(during)},
    }


def run_long_prompt_bench(config_path: Any, *, prompt_tokens: int = 6000, streams: int = 8,
                          budgets: tuple[int | None, ...] = (None, 512, 128),
                          progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Each budget in ``budgets`` (None: no chunking, the whole prompt in one step) on its own
    engine over the same config; the rows side by side."""
    from engine import Engine

    rows = []
    for budget in budgets:
        step_tokens = budget if budget is not None else prompt_tokens + 64 * streams
        # no prefix cache: the streams share one prompt, and a hit would change what a step feeds
        overrides: dict[str, dict[str, Any]] = {
            "backend": {"max_batch": streams + 1, "max_step_tokens": step_tokens, "prefix_caching": False},
            "activations": {"enabled": False}, "sae": {"enabled": False}}
        with Engine.from_config(config_path, overrides=overrides) as engine:
            engine.generate(STREAM_PROMPT, max_tokens=2, temperature=0.0)  # warm-up
            progress(f"step token budget {step_tokens} ({'chunked' if budget else 'one step'})…")
            row = measure(engine, prompt_tokens=prompt_tokens, streams=streams, progress=progress)
            rows.append({"max_step_tokens": step_tokens, "chunked": budget is not None, **row,
                         "model": engine.backend.info.model_id, "device": engine.backend.info.device})
    return {"prompt_tokens": prompt_tokens, "streams": streams, "rows": rows}


def format_long_prompt(report: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.0f}"

    lines = [f"{report['streams']} streams, then one {report['prompt_tokens']}-token prompt", "",
             "| prefill | step token budget | streams' gap before (median / max ms) | "
             "gap while it prefills (median / max ms) | long prompt TTFT (s) |",
             "|---|---:|---:|---:|---:|"]
    for row in report["rows"]:
        b, d = row["gap_before_ms"], row["gap_during_ms"]
        lines.append(f"| {'chunked' if row['chunked'] else 'whole prompt in one step'} | {row['max_step_tokens']} | "
                     f"{ms(b['median'])} / {ms(b['max'])} | {ms(d['median'])} / {ms(d['max'])} | "
                     f"{row['ttft_s']:.2f} |")
    return "\n".join(lines)
