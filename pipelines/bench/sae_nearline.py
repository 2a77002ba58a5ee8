"""Benchmark: SAE encode tokens/s, activation-store append rows/s, and generation with nearline
SAE beside SAE off, on the same loaded model (``raylens bench --sae``)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from .measure import PROMPT

__all__ = ["run_sae_bench", "format_sae"]


def _synthetic_rows(tokens: int, identity: Any) -> Any:
    """Realistic activation rows through the production row builder."""
    import numpy as np

    from engine.services.sae_blocks import HiddenBlock, rows_from_topk

    rng = np.random.default_rng(0)
    block = HiddenBlock("bench", 0, steps=list(range(tokens)), positions=list(range(tokens)),
                        token_ids=rng.integers(0, 1000, tokens).tolist())
    values = rng.random((tokens, identity.top_k), dtype=np.float32) + 0.1
    indices = rng.integers(0, identity.d_sae, (tokens, identity.top_k))
    return rows_from_topk(block, values, indices, identity, source_mode="nearline", model_id="bench")


def run_sae_bench(engine: Any, *, new_tokens: int = 128, repeats: int = 3, sae_id: str | None = None,
                  progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """SAE encode tokens/s, store append rows/s, and generation with nearline SAE vs SAE off."""
    import dataclasses
    import tempfile

    import torch

    from engine import Engine
    from engine.services.store import ActivationStore

    backend = engine.backend
    with tempfile.TemporaryDirectory() as tmp:
        cfg = engine.config
        sae_cfg = dataclasses.replace(cfg.sae, enabled=True, mode="nearline", **({"sae_id": sae_id} if sae_id else {}))
        sae_engine = Engine(dataclasses.replace(
            cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=f"{tmp}/bench.duckdb"),
            sae=sae_cfg), backend=backend)
        try:
            recorder, store = sae_engine.recorder, sae_engine.store
            assert recorder is not None and recorder.encoder is not None and store is not None  # enabled above
            encoder = recorder.encoder
            block = torch.randn(4096, backend.info.hidden_size, device=backend.device)
            encoder.encode_topk(block)  # warm-up
            encode_rates = []
            for _ in range(repeats):
                started = time.perf_counter()
                encoder.encode_topk(block)
                encode_rates.append(block.shape[0] / (time.perf_counter() - started))
            progress(f"SAE encode: {statistics.median(encode_rates):,.0f} tokens/s")

            rows = _synthetic_rows(10_000, encoder.identity)  # 10k tokens × top-k features
            append_rates = []
            with ActivationStore(f"{tmp}/append.duckdb", threads=cfg.activations.threads) as store:
                for i in range(repeats):
                    started = time.perf_counter()
                    store.append_activations(rows, batch_id=f"bench/{i}", request_id="bench")
                    append_rates.append(rows.num_rows / (time.perf_counter() - started))
            progress(f"store append: {statistics.median(append_rates):,.0f} rows/s")

            ids = engine.encode(PROMPT)
            paths = {"engine default, SAE off": engine, "engine default + SAE nearline": sae_engine}
            runs: dict[str, list[float]] = {name: [] for name in paths}
            for name, eng in paths.items():
                eng.generate(input_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True)  # warm-up
            for r in range(repeats):
                for name, eng in paths.items():
                    started = time.perf_counter()
                    result = eng.generate(input_ids=ids, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
                    runs[name].append(len(result.output_ids) / (time.perf_counter() - started))
                    progress(f"repeat {r + 1}/{repeats}  {name:<40} {runs[name][-1]:8.1f} tok/s")
            sae_engine.flush()
            stored = store.counts()["activations"]
        finally:
            sae_engine.close()
    off = statistics.median(runs["engine default, SAE off"])
    on = statistics.median(runs["engine default + SAE nearline"])
    return {
        "sae": {"release": encoder.identity.release, "d_sae": encoder.identity.d_sae, "top_k": encoder.identity.top_k},
        "encode_tokens_per_s": statistics.median(encode_rates),
        "store_append_rows_per_s": statistics.median(append_rates),
        "generation": {"sae_off_tokens_per_s": off, "sae_nearline_tokens_per_s": on, "ratio": on / off,
                       "rows_stored": stored, "runs": runs},
    }


def format_sae(report: dict[str, Any]) -> str:
    gen = report["generation"]
    return "\n".join([
        f"SAE {report['sae']['release']} ({report['sae']['d_sae']} features, top-{report['sae']['top_k']} stored)",
        "",
        "| measure | value |",
        "|---|---|",
        f"| SAE encode, 4096-token blocks | {report['encode_tokens_per_s']:,.0f} tokens/s |",
        f"| store append, Arrow batches of 10k tokens × top-k | {report['store_append_rows_per_s']:,.0f} rows/s |",
        f"| generation, SAE off | {gen['sae_off_tokens_per_s']:.1f} tokens/s |",
        f"| generation, SAE nearline | {gen['sae_nearline_tokens_per_s']:.1f} tokens/s |",
        f"| nearline / off | {gen['ratio']:.3f} |",
    ])
