"""Benchmark: the decode paths (``backend.graph_decode``) side by side on one machine — the question
"does ``torch.compile`` speed up the CPU path?" answered with numbers, compile time included.

One engine per mode over the same config (each loads its own copy of the model: meant for the
embedded model; on a GPU ``auto``'s CUDA graphs are the answer). For each mode: the untimed
warm-up's wall time (where compiling happens: once per decode shape), then tokens/s for one
request and for N concurrent ones, interleaved across modes, medians. Every mode's tokens are
compared with ``off``'s: a mode that changes an output is reported, not hidden.

Run: ``raylens bench --decode-modes [--concurrency N] [--new-tokens 64 --repeats 3 --out FILE]``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from contextlib import ExitStack
from typing import Any, Callable, Sequence

from engine.config.sections import GraphDecode

__all__ = ["run_decode_modes_bench", "format_decode_modes", "DECODE_MODES"]

DECODE_MODES: tuple[GraphDecode, ...] = ("off", "static", "compile")


def run_decode_modes_bench(config: Any, *, modes: Sequence[GraphDecode] = DECODE_MODES, concurrency: int = 8,
                           new_tokens: int = 64, repeats: int = 3,
                           progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """``config``: a path or a :class:`~engine.config.RaylensConfig`; each mode overrides only
    ``backend.graph_decode`` (and ``max_batch``, so N requests share one step)."""
    from engine import Engine
    from engine.config import RaylensConfig, load_config

    from .measure import _machine
    from .batching import _prompts

    base = config if isinstance(config, RaylensConfig) else load_config(config)
    workloads = {1: _prompts(1), concurrency: _prompts(concurrency)}
    with ExitStack() as stack:
        engines: dict[str, Any] = {}
        for mode in modes:
            # the activation store and SAE are off: the bench measures decoding, and the engines
            # must not share one store file; no prefix cache: repeats run the same prompts
            cfg = dataclasses.replace(
                base, backend=dataclasses.replace(base.backend, graph_decode=mode, prefix_caching=False,
                                                  max_batch=max(concurrency, base.backend.max_batch)),
                activations=dataclasses.replace(base.activations, enabled=False),
                sae=dataclasses.replace(base.sae, enabled=False))
            engines[mode] = stack.enter_context(Engine(cfg))
        inputs = {n: [engines[modes[0]].encode(p) for p in prompts] for n, prompts in workloads.items()}

        def run(mode: str, n: int) -> list[list[int]]:
            handles = [engines[mode].submit(input_ids=ids, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
                       for ids in inputs[n]]
            return [list(h.result().output_ids) for h in handles]

        warmup: dict[str, float] = {}
        outputs: dict[str, dict[int, list[list[int]]]] = {}
        for mode in modes:  # every decode shape the timed runs use is built (and compiled) here
            started = time.perf_counter()
            outputs[mode] = {n: run(mode, n) for n in inputs}
            warmup[mode] = time.perf_counter() - started
            progress(f"warm-up {mode:<8} {warmup[mode]:7.1f} s")
        runs: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in inputs}
        for r in range(repeats):
            for n in inputs:
                for mode in modes:
                    started = time.perf_counter()
                    produced = sum(len(ids) for ids in run(mode, n))
                    rate = produced / (time.perf_counter() - started)
                    runs[(mode, n)].append(rate)
                    progress(f"repeat {r + 1}/{repeats}  {mode:<8} {n:>3} request(s) {rate:8.1f} tok/s")
        stats = {mode: dict(engines[mode].backend.graph_stats) for mode in modes}
        machine = _machine(engines[modes[0]].backend)
        model = engines[modes[0]].backend.info.model_id
    reference = outputs[modes[0]]
    rows = []
    for mode in modes:
        row: dict[str, Any] = {"mode": mode, "warmup_s": round(warmup[mode], 2),
                               "same_tokens_as_" + modes[0]: outputs[mode] == reference,
                               "decode_stats": stats[mode]}
        for n in inputs:
            median = statistics.median(runs[(mode, n)])
            row[f"tokens_per_s_{n}"] = median
            row[f"vs_{modes[0]}_{n}"] = median / statistics.median(runs[(modes[0], n)])
            row[f"runs_{n}"] = runs[(mode, n)]
        rows.append(row)
    return {"machine": machine, "model": model, "new_tokens": new_tokens, "repeats": repeats,
            "concurrency": list(inputs), "rows": rows}


def format_decode_modes(report: dict[str, Any]) -> str:
    first = report["rows"][0]["mode"]
    counts = report["concurrency"]
    head = " | ".join(f"tokens/s, {n} request{'s' if n > 1 else ''} | vs {first}" for n in counts)
    lines = [f"model {report['model']} on {report['machine']['device']} ({report['machine']['dtype']}), "
             f"{report['new_tokens']} new tokens per request, greedy, median of {report['repeats']}; "
             f"torch {report['machine']['torch']}, {report['machine']['torch_threads']} threads", "",
             f"| graph_decode | warm-up (s) | {head} | same tokens as {first} |",
             "|---|---:|" + "---:|---:|" * len(counts) + "---|"]
    for row in report["rows"]:
        cells = " | ".join(f"{row[f'tokens_per_s_{n}']:.1f} | {row[f'vs_{first}_{n}']:.2f}x" for n in counts)
        same = "yes" if row[f"same_tokens_as_{first}"] else "**no**"
        lines.append(f"| `{row['mode']}` | {row['warmup_s']:.1f} | {cells} | {same} |")
    return "\n".join(lines)
