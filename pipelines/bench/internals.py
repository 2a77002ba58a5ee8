"""Benchmark: embeddings per second batched vs one text per call, and a full named-tensor dump beside
a plain forward (``raylens bench --internals``)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from .measure import PROMPT, _machine

__all__ = ["run_internals_bench", "format_internals"]

INTERNALS_SENTENCES = ["n : Nat\n⊢ n + 0 = n", "The lighthouse keeper climbed the stairs at dusk.",
                       "xs : List Nat\nh : xs ≠ []\n⊢ xs.length > 0", "What makes a good cup of tea?",
                       "def add(a, b):\n    return a + b", "Maps were drawn on clay tablets long before paper."]


def _internals_texts(n: int) -> list[str]:
    """``n`` texts of varied lengths (one to four sentences), the same on every run."""
    k = len(INTERNALS_SENTENCES)
    return [" ".join(INTERNALS_SENTENCES[(i + j) % k] for j in range(1 + i % 4)) for i in range(n)]


def run_internals_bench(engine: Any, *, texts: int = 32, repeats: int = 3,
                        progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Embeddings per second, batched vs one text per call; and the cost of a full named-tensor
    dump (every internal of every layer) beside a plain forward of the same decoder stack with a
    fresh KV cache, in memory and written to disk. Runs are interleaved like the other rows."""
    import tempfile

    import torch
    from transformers import DynamicCache

    from engine.model.kv_cache import cache_argument
    from engine.model.named_capture import capture

    model = engine.backend.reference_model
    corpus = _internals_texts(texts)
    engine.embed(corpus[:4])  # warm-up
    rates: dict[str, list[float]] = {"batched (16 per forward)": [], "one text per call": []}
    for r in range(repeats):
        started = time.perf_counter()
        engine.embed(corpus, batch_size=16)
        rates["batched (16 per forward)"].append(len(corpus) / (time.perf_counter() - started))
        started = time.perf_counter()
        for text in corpus:
            engine.embed([text])
        rates["one text per call"].append(len(corpus) / (time.perf_counter() - started))
        progress(f"repeat {r + 1}/{repeats}  embeddings/s: batched {rates['batched (16 per forward)'][-1]:.1f}, "
                 f"one by one {rates['one text per call'][-1]:.1f}")

    ids = engine.encode(PROMPT)
    device = next(model.parameters()).device
    with tempfile.TemporaryDirectory() as tmp:
        def plain() -> None:
            with torch.inference_mode():
                model.base_model(input_ids=torch.tensor([ids], device=device), use_cache=True,
                                 **cache_argument(model.base_model, DynamicCache(config=model.config)))

        paths: dict[str, Callable[[], Any]] = {
            "plain forward": plain,
            "full dump, in memory": lambda: capture(model, ids, ["*"]),
            "full dump, written (safetensors + manifest)": lambda: capture(model, ids, ["*"], out=tmp),
        }
        dump = capture(model, ids, ["*"], out=tmp)  # warm-up, and the dump's size
        ms: dict[str, list[float]] = {name: [] for name in paths}
        for r in range(repeats * 3):
            for name, fn in paths.items():
                started = time.perf_counter()
                fn()
                ms[name].append((time.perf_counter() - started) * 1000)
        progress("capture ms: " + ", ".join(f"{n} {statistics.median(v):.1f}" for n, v in ms.items()))
    plain_ms = statistics.median(ms["plain forward"])
    return {
        "machine": _machine(engine.backend), "model": engine.backend.info.model_id,
        "texts": len(corpus),
        "mean_text_tokens": statistics.mean(len(engine.tokenizer(t)["input_ids"]) for t in corpus),
        "embeddings_per_s": {name: statistics.median(v) for name, v in rates.items()},
        "prompt_tokens": len(ids), "dump_tensors": len(dump),
        "dump_mib": sum(t.numel() * t.element_size() for t in dump.values()) / 2**20,
        "capture_ms": {name: statistics.median(v) for name, v in ms.items()},
        "capture_ratio": {name: statistics.median(v) / plain_ms for name, v in ms.items()},
    }


def format_internals(report: dict[str, Any]) -> str:
    emb, cap, ratio = report["embeddings_per_s"], report["capture_ms"], report["capture_ratio"]
    one = emb["one text per call"]
    lines = [f"{report['texts']} texts of {report['mean_text_tokens']:.0f} tokens on average, "
             f"{report['machine']['device']} ({report['machine']['dtype']})", "",
             "| embeddings | texts/s | vs one by one |", "|---|---|---|"]
    lines += [f"| {name} | {rate:.1f} | {rate / one:.2f} |" for name, rate in emb.items()]
    lines += ["", f"capture of {report['prompt_tokens']} prompt tokens: {report['dump_tensors']} tensors, "
                  f"{report['dump_mib']:.1f} MiB", "", "| forward | ms | vs plain |", "|---|---|---|"]
    lines += [f"| {name} | {cap[name]:.1f} | {ratio[name]:.2f} |" for name in cap]
    return "\n".join(lines)
