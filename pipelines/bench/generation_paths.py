"""Benchmark: raylens' generation paths beside bare ``model.generate``, in one process.

Every path generates the same number of new tokens greedily from the same prompt on the same
loaded model; runs are interleaved (path A, B, C, A, B, C, …) so drift in machine load hits all
paths alike, and the table reports the median tokens/s of each and its ratio to bare
``generate``. Tokens/s counts new tokens over the whole call, prefill included, for every path.

Run: ``raylens bench`` or ``python -m pipelines.cli bench [--new-tokens 128 --repeats 3 --out FILE]``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from .measure import PROMPT, _machine, _mask_mod

__all__ = ["BenchRow", "run_bench", "format_table"]


@dataclass(frozen=True)
class BenchRow:
    path: str
    tokens_per_s: float
    ratio: float
    runs: list[float]


def run_bench(engine: Any, *, new_tokens: int = 128, repeats: int = 3,
              progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    import torch

    backend = engine.backend
    model = backend.reference_model
    ids = engine.encode(PROMPT)
    original = (backend.config.extract_hidden_states, backend.config.extract_attention)
    # bare generate runs the same attention implementation: SDPA behind a wrapper that captures
    # nothing unless a row asks

    def bare_generate() -> int:
        input_ids = torch.tensor([ids], device=backend.device)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False)
        return out.shape[1] - len(ids)

    def engine_path(hidden: bool, attention: bool, mods: list[Any] | None = None) -> Callable[[], int]:
        def run() -> int:
            engine.set_capture(hidden_states=hidden, attention=attention)
            result = engine.generate(input_ids=ids, max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                     mods=mods)
            return len(result.output_ids)
        return run

    paths: dict[str, Callable[[], int]] = {
        "hf model.generate (bare)": bare_generate,
        "engine, no capture": engine_path(False, False),
        "engine + hidden states": engine_path(True, False),
        "engine + hidden + attention (default)": engine_path(True, True),
        "engine default + logits mod": engine_path(True, True, [_mask_mod()]),
    }
    runs: dict[str, list[float]] = {name: [] for name in paths}
    try:
        for name, fn in paths.items():  # warm-up: first-call allocations and lazy imports
            fn()
        for r in range(repeats):
            for name, fn in paths.items():
                started = time.perf_counter()
                produced = fn()
                elapsed = time.perf_counter() - started
                if produced != new_tokens:
                    raise RuntimeError(f"{name} produced {produced} tokens, expected {new_tokens}")
                runs[name].append(produced / elapsed)
                progress(f"repeat {r + 1}/{repeats}  {name:<40} {produced / elapsed:8.1f} tok/s")
    finally:
        engine.set_capture(hidden_states=original[0], attention=original[1])
    baseline = statistics.median(runs["hf model.generate (bare)"])
    rows = [BenchRow(name, statistics.median(v), statistics.median(v) / baseline, v) for name, v in runs.items()]
    return {
        "machine": _machine(backend),
        "model": backend.info.model_id,
        "prompt_tokens": len(ids),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "rows": [row.__dict__ for row in rows],
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [
        f"model {report['model']} on {report['machine']['device']} ({report['machine']['dtype']}), "
        f"{report['prompt_tokens']} prompt tokens, {report['new_tokens']} new tokens, greedy, "
        f"median of {report['repeats']}",
        "",
        f"| {'path':<40} | {'tokens/s':>9} | {'vs generate':>11} |",
        f"|{'-' * 42}|{'-' * 11}|{'-' * 13}|",
    ]
    for row in report["rows"]:
        lines.append(f"| {row['path']:<40} | {row['tokens_per_s']:>9.1f} | {row['ratio']:>10.2f}x |")
    return "\n".join(lines)
