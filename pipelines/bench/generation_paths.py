"""Benchmark: raylens' generation paths beside bare ``model.generate``, in one process.

Every path generates the same number of new tokens greedily from the same prompt on the same
loaded model; runs are interleaved (path A, B, C, A, B, C, …) so drift in machine load hits all
paths alike, and the table reports the median tokens/s of each and its ratio to bare
``generate``. Tokens/s counts new tokens over the whole call, prefill included, for every path.

Run: ``raylens bench`` or ``python -m pipelines.bench [--new-tokens 128 --repeats 3 --out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["BenchRow", "run_bench", "run_sae_bench", "run_ray_bench", "run_strategy_bench", "run_cli", "main",
           "run_internals_bench"]

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class BenchRow:
    path: str
    tokens_per_s: float
    ratio: float
    runs: list[float]


def _mask_mod():
    """A logits-adjusting mod in the SelfPrompt style: numpy mask, back through ``from_numpy``."""
    from mods import ForwardPass, mod

    @mod
    def ban_token_zero(event, actions, tokenizer):
        if isinstance(event, ForwardPass):
            logits = event.logits.to_numpy()
            logits[0, 0] = -1e9
            return actions.adjust_logits(type(event.logits).from_numpy(logits).to(event.logits.device))
        return None

    return ban_token_zero


def run_bench(engine: Any, *, new_tokens: int = 128, repeats: int = 3,
              progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    import torch

    backend = engine.backend
    model = backend.model
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
            encoder = sae_engine.recorder.encoder
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
            stored = sae_engine.store.counts()["activations"]
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


def run_strategy_bench(engine: Any, *, repeats: int = 50) -> dict[str, Any]:
    """Per-step milliseconds of a constrained-generation step (a SelfPrompt masking the full
    vocabulary for a strategy) beside one forward pass of the model."""
    from mods.actions import ActionBuilder
    from mods.self_prompt import SelfPrompt
    from mods.strategies.base import token_texts
    from mods.strategies.strategy_constructor import CharsMode, CharsStrat, ChoicesStrat

    from engine.model.backend import ForwardRow

    backend, tokenizer = engine.backend, engine.tokenizer
    rid = "bench-strategy"
    ids = engine.encode(PROMPT)
    backend.acquire(rid)
    try:
        out = backend.forward([ForwardRow(rid, 0, tuple(ids))])[0]
        forward_ms = []
        for step in range(1, 11):
            ids.append(int(out.logits.argmax()))
            started = time.perf_counter()
            out = backend.forward([ForwardRow(rid, len(ids) - 1, (ids[-1],))])[0]
            forward_ms.append((time.perf_counter() - started) * 1000)
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
    finally:
        backend.release(rid)
    return {"forward_pass_ms": statistics.median(forward_ms), "vocabulary_table_ms": table_ms,
            "vocab": backend.info.vocab_size, "mask_step_ms": steps}


def format_strategy(report: dict[str, Any]) -> str:
    lines = [f"vocabulary {report['vocab']:,} ids; token-text table built once: {report['vocabulary_table_ms']:.0f} ms",
             "", "| step | ms | vs a forward pass |", "|---|---|---|",
             f"| one decode forward pass | {report['forward_pass_ms']:.2f} | 1.00 |"]
    for name, ms in report["mask_step_ms"].items():
        lines.append(f"| SelfPrompt mask step, {name} | {ms:.2f} | {ms / report['forward_pass_ms']:.3f} |")
    return "\n".join(lines)


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

    from .generate import PromptLine, run
    from .topology import actor_names, build_topology

    requests = [{"prompt": p, "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True} for p in RAY_PROMPTS]
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
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace=ray_cfg.ray.namespace)
        try:
            topo = build_topology(ray_cfg)
            run(ray_cfg, [PromptLine(0, {"prompt": RAY_PROMPTS[0], "max_tokens": 4, "request_id": "warm"})],
                Path(tmp) / "warm.jsonl", progress=lambda _: None)  # actors loaded, model warm
            backlog: list[tuple[float, int]] = []
            stop = threading.Event()

            def sample() -> None:
                t0 = time.perf_counter()
                while not stop.wait(sample_every_s):
                    stats = ray.get(topo.generator.stats.remote(), timeout=60)
                    backlog.append((round(time.perf_counter() - t0, 2), stats.get("sae", {}).get("backlog", 0)))

            one_at_a_time = dataclasses.replace(ray_cfg, ray=dataclasses.replace(ray_cfg.ray, generator_max_concurrency=1))
            lines = [PromptLine(i + 1, {**r, "request_id": f"bench-seq-{i}"}) for i, r in enumerate(requests)]
            sequential = run(one_at_a_time, lines, Path(tmp) / "ray-seq.jsonl", progress=progress)
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            lines = [PromptLine(i + 1, {**r, "request_id": f"bench-{i}"}) for i, r in enumerate(requests)]
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


def _machine(backend: Any) -> dict[str, Any]:
    import os

    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": backend.info.device,
        "dtype": backend.info.dtype,
    }
    if backend.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(backend.device)
    return info


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


def run_cli(args: argparse.Namespace) -> int:
    from engine import Engine

    from .bench_batching import build_random_model, format_concurrency, run_concurrency_bench

    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if getattr(args, "decode_modes", False):  # its own engines, one per mode
        return _decode_modes_cli(args, progress)
    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "random_model", None):
        path = build_random_model(args.random_model, tokenizer=getattr(args, "tokenizer", None), progress=progress)
        # a static cache is allocated whole: size it to the bench's requests, not the model's 128k context
        overrides["backend"] = {"model_id": str(path), "device": "cuda", "dtype": "bfloat16", "max_sequence": 1024}
        overrides["activations"] = {"enabled": False}
        overrides["sae"] = {"enabled": False}
    concurrency = sorted(set(getattr(args, "concurrency", None) or []))
    if concurrency:
        overrides.setdefault("backend", {})["max_batch"] = max(concurrency)
    print("raylens bench: loading model…", file=sys.stderr, flush=True)
    with Engine.from_config(args.config, overrides=overrides or None) as engine:
        if getattr(args, "internals", False):  # its own rows only: embeddings and named capture
            return _internals_cli(engine, args, progress)
        if getattr(args, "serve", False):  # its own rows only: the HTTP/WebSocket server
            return _serve_cli(engine, args, progress)
        if concurrency:
            report = {"concurrency": run_concurrency_bench(engine, concurrency=concurrency,
                                                           new_tokens=args.new_tokens, repeats=args.repeats,
                                                           progress=progress)}
            print(format_concurrency(report["concurrency"]))
            _write_report(args.out, report)
            return 0
        report = run_bench(engine, new_tokens=args.new_tokens, repeats=args.repeats, progress=progress)
        if args.sae:
            report["sae"] = run_sae_bench(engine, new_tokens=args.new_tokens, repeats=args.repeats,
                                          progress=progress)
        if args.ray:
            report["ray"] = run_ray_bench(engine, new_tokens=min(args.new_tokens, 64), progress=progress)
        report["strategy"] = run_strategy_bench(engine)
    print(format_table(report))
    print()
    print(format_strategy(report["strategy"]))
    if args.sae:
        print()
        print(format_sae(report["sae"]))
    if args.ray:
        print()
        print(format_ray(report["ray"]))
    _write_report(args.out, report)
    return 0


# ------------------------------------------------------------------ embeddings and named capture

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

    from engine.model.named_capture import capture

    model = engine.backend.model
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
                model.base_model(input_ids=torch.tensor([ids], device=device),
                                 past_key_values=DynamicCache(config=model.config), use_cache=True)

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


def _internals_cli(engine: Any, args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    report = {"internals": run_internals_bench(engine, repeats=args.repeats, progress=progress)}
    print(format_internals(report["internals"]))
    _write_report(args.out, report)
    return 0


# ------------------------------------------------------------------------------- HTTP serving


def run_serve_bench(engine: Any, *, new_tokens: int = 32, streams: Sequence[int] = (1, 4, 16),
                    progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """The attention-streaming WebSocket on a loopback server beside the same requests in-process.

    Per-token latency (median gap between token messages) with attention off and on, bytes per
    token for each attention encoding, and tokens/s with ``streams`` concurrent clients against the
    same number of concurrent in-process requests (threads over ``submit``)."""
    import asyncio
    import threading

    import websockets

    from .serve.app import build_app
    from .serve.engine_stream import submit
    from .serve.local import serve_in_thread
    from .serve.settings import ServeSettings

    ids = engine.encode(PROMPT)
    base = {"type": "generate", "input_ids": ids, "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}

    async def one(url: str, extra: dict[str, Any]) -> tuple[list[float], int, int]:
        gaps, size, tokens = [], 0, 0
        async with websockets.connect(url, max_size=None) as ws:
            await ws.send(json.dumps({**base, **extra}))
            last = time.perf_counter()
            while True:
                raw = await ws.recv()
                now = time.perf_counter()
                size += len(raw)
                if isinstance(raw, bytes):
                    continue
                kind = json.loads(raw)["type"]
                if kind != "token":
                    return gaps, size, tokens
                gaps.append((now - last) * 1000.0)
                last, tokens = now, tokens + 1

    encodings = {"attention off": {}, "per_layer float32 base64": {"return_attention": True},
                 "per_layer float16 gzip": {"return_attention": True, "attention_dtype": "float16",
                                            "attention_compression": "gzip"},
                 "per_layer float32 binary frames": {"return_attention": True, "binary": True},
                 "aggregated mean": {"return_attention": True, "attention_format": "aggregated"}}
    report: dict[str, Any] = {"machine": _machine(engine.backend), "model": engine.backend.info.model_id,
                              "prompt_tokens": len(ids), "new_tokens": new_tokens, "latency_ms": {},
                              "bytes_per_token": {}, "tokens_per_s": {}}
    settings = ServeSettings(max_new_tokens=new_tokens, max_ws_connections=max(streams) + 1)
    with serve_in_thread(build_app(engine, settings)) as http_url:
        url = http_url.replace("http://", "ws://") + "/api/v1/generate/stream"
        asyncio.run(one(url, {"max_new_tokens": 2}))  # warm-up
        for name, extra in encodings.items():
            gaps, size, tokens = asyncio.run(one(url, extra))
            report["latency_ms"][name] = statistics.median(gaps[1:] or gaps)  # after the first (prefill) token
            report["bytes_per_token"][name] = size / max(tokens, 1)
            progress(f"{name}: {report['latency_ms'][name]:.1f} ms/token, {report['bytes_per_token'][name]:.0f} B/token")
        for n in streams:
            async def many() -> int:
                results = await asyncio.gather(*(one(url, {}) for _ in range(n)))
                return sum(tokens for _, _, tokens in results)

            started = time.perf_counter()
            total = asyncio.run(many())
            served = total / (time.perf_counter() - started)

            def in_process(out: list[int]) -> None:
                handle = submit(engine, input_ids=ids, max_tokens=new_tokens, temperature=0, ignore_eos=True)
                out.append(sum(len(e.token_ids) for e in handle if hasattr(e, "token_ids")))

            counts: list[int] = []
            threads = [threading.Thread(target=in_process, args=(counts,)) for _ in range(n)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            local = sum(counts) / (time.perf_counter() - started)
            report["tokens_per_s"][n] = {"websocket": served, "in_process": local, "ratio": served / local}
            progress(f"{n} streams: websocket {served:.1f} tok/s, in-process {local:.1f} tok/s")
    return report


def format_serve(report: dict[str, Any]) -> str:
    lines = [f"{report['model']} on {report['machine']['device']}, prompt {report['prompt_tokens']} tokens, "
             f"{report['new_tokens']} new tokens", "", "| stream | ms/token | bytes/token |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.1f} | {report['bytes_per_token'][name]:.0f} |"
              for name, ms in report["latency_ms"].items()]
    lines += ["", "| concurrent streams | WebSocket tok/s | in-process tok/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {n} | {row['websocket']:.1f} | {row['in_process']:.1f} | {row['ratio']:.2f} |"
              for n, row in report["tokens_per_s"].items()]
    return "\n".join(lines)


def _serve_cli(engine: Any, args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    report = {"serve": run_serve_bench(engine, new_tokens=min(args.new_tokens, 64), progress=progress)}
    print(format_serve(report["serve"]))
    _write_report(args.out, report)
    return 0


def _write_report(out: str | None, report: dict[str, Any]) -> None:
    """``--out FILE``: the report as JSON."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2), encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)


def _decode_modes_cli(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    from engine.config import load_config

    from .bench_decode_modes import format_decode_modes, run_decode_modes_bench
    from .cli import UsageError

    counts = sorted(set(args.concurrency or [8]))
    if len(counts) > 1:
        raise UsageError("--decode-modes takes at most one --concurrency N")
    print("raylens bench: loading one engine per decode mode…", file=sys.stderr, flush=True)
    report = run_decode_modes_bench(load_config(args.config), concurrency=counts[0], new_tokens=args.new_tokens,
                                    repeats=args.repeats, progress=progress)
    print(format_decode_modes(report))
    _write_report(args.out, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .cli import main as cli_main

    return cli_main(["bench", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
