"""Benchmark: the same prompts through the in-process engine and end to end through the Ray actors
(``raylens bench --ray``): tokens/s of each and the SAE backlog over time."""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["RAY_PROMPTS", "run_ray_bench", "format_ray"]

RAY_PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
               "Describe a walk through an autumn forest.", "What makes a good cup of tea?",
               "Tell me about the history of maps.", "Describe the sea at night."]


def run_ray_bench(engine: Any, *, new_tokens: int = 64, progress: Callable[[str], None] = lambda _: None,
                  sample_every_s: float = 0.5) -> dict[str, Any]:
    """The same prompts through the in-process engine (SAE nearline) and end to end through Ray
    (generator + 2 SAE workers + store + ingest); tokens/s of each and the SAE backlog over time."""
    import dataclasses
    import tempfile
    import threading
    import uuid
    from pathlib import Path

    import ray

    from engine import Engine
    from engine.core.inputs import GenerationRequest
    from pipelines.cluster.actor_specs import actor_names
    from pipelines.cluster.topology import build_topology
    from pipelines.jobs.generate import PromptLine, run

    requests: list[dict[str, Any]] = [{"prompt": p, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
                                      for p in RAY_PROMPTS]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = engine.config
        cfg = dataclasses.replace(
            cfg, activations=dataclasses.replace(cfg.activations, enabled=True, db_path=f"{tmp}/local.duckdb"),
            sae=dataclasses.replace(cfg.sae, enabled=True, mode="nearline"),
            ingest=dataclasses.replace(cfg.ingest, url=None))
        local = Engine(cfg, backend=engine.backend)
        try:
            local.generate(RAY_PROMPTS[0], max_tokens=4)  # warm-up
            started = time.perf_counter()
            tokens = sum(len(local.generate(**r).output_ids) for r in requests)
            local.flush()
            local_rate = tokens / (time.perf_counter() - started)
        finally:
            local.close()
        progress(f"in-process engine + SAE nearline: {local_rate:.1f} tok/s")

        ray_cfg = dataclasses.replace(
            cfg, activations=dataclasses.replace(cfg.activations, db_path=f"{tmp}/ray.duckdb"),
            ray=dataclasses.replace(cfg.ray, namespace=f"raylens-bench-{uuid.uuid4().hex[:6]}", sae_workers=2))
        ray.init(address="local", num_cpus=8,  # its own instance, never a running cluster
                 include_dashboard=False, log_to_driver=False, namespace=ray_cfg.ray.namespace)
        try:
            topo = build_topology(ray_cfg)
            run(ray_cfg, [PromptLine(0, GenerationRequest(prompt=RAY_PROMPTS[0], max_tokens=4, request_id="warm"))],
                Path(tmp) / "warm.jsonl", progress=lambda _: None)  # actors loaded, model warm
            backlog: list[tuple[float, int]] = []
            stop = threading.Event()

            def sample() -> None:
                t0 = time.perf_counter()
                while not stop.wait(sample_every_s):
                    stats = ray.get(topo.generator.stats.remote(), timeout=60)
                    backlog.append((round(time.perf_counter() - t0, 2), stats.get("sae", {}).get("backlog", 0)))

            one_at_a_time = dataclasses.replace(ray_cfg, ray=dataclasses.replace(ray_cfg.ray, generator_max_concurrency=1))
            lines = [PromptLine(i + 1, GenerationRequest(**r, request_id=f"bench-seq-{i}")) for i, r in enumerate(requests)]
            sequential = run(one_at_a_time, lines, Path(tmp) / "ray-seq.jsonl", progress=progress)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            lines = [PromptLine(i + 1, GenerationRequest(**r, request_id=f"bench-{i}")) for i, r in enumerate(requests)]
            summary = run(ray_cfg, lines, Path(tmp) / "ray.jsonl", progress=progress)
            stop.set()
            sampler.join(timeout=60)
        finally:
            for name in actor_names(ray_cfg):
                try:
                    ray.kill(ray.get_actor(name, namespace=ray_cfg.ray.namespace), no_restart=True)
                except ValueError:
                    pass
            ray.shutdown()
    return {"prompts": len(requests), "new_tokens": new_tokens, "in_process_tokens_per_s": local_rate,
            "ray_one_at_a_time_tokens_per_s": sequential["tokens_per_s"],
            "ray_tokens_per_s": summary["tokens_per_s"], "concurrency": ray_cfg.ray.generator_max_concurrency,
            "ratio_one_at_a_time": sequential["tokens_per_s"] / local_rate,
            "ratio": summary["tokens_per_s"] / local_rate,
            "sae_rows": summary["sae_rows"], "sae_blocks_missing": summary["sae_blocks_missing"],
            "sae_backlog": backlog, "max_backlog": max((b for _, b in backlog), default=0)}


def format_ray(report: dict[str, Any]) -> str:
    trace = ", ".join(f"{t:.1f}s:{b}" for t, b in report["sae_backlog"][:: max(1, len(report["sae_backlog"]) // 12)])
    return "\n".join([
        f"{report['prompts']} prompts × {report['new_tokens']} new tokens, SAE nearline in both paths",
        "",
        "| path | tokens/s | vs in-process |",
        "|---|---|---|",
        f"| in-process engine, one request at a time | {report['in_process_tokens_per_s']:.1f} | 1.00 |",
        f"| Ray (generator + 2 SAE workers + store + ingest), one request at a time | "
        f"{report['ray_one_at_a_time_tokens_per_s']:.1f} | {report['ratio_one_at_a_time']:.2f} |",
        f"| Ray, {report['concurrency']} requests at a time on the generator | {report['ray_tokens_per_s']:.1f} | "
        f"{report['ratio']:.2f} |",
        "",
        f"SAE backlog (blocks in flight) over time: {trace or 'n/a'}; peak {report['max_backlog']}",
    ])
